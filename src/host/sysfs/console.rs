//! The console GPU: the boot VGA device (`boot_vga` = 1) while it drives the host's console. A
//! VM given it takes the host's console away (vfio-pci even removes the firmware framebuffer
//! that lives in its memory when it binds the boot VGA device), so it is a host use, unless the
//! operator passes it on purpose (`[host] allow_console_gpu`).
//!
//! What the kernel shows, read by [`read_facts`] (the edge):
//! - `boot_vga` of a VGA-class function: 1 on the device the firmware used to boot;
//! - `sys/class/graphics/fbN`: a framebuffer, its device the PCI function of a DRM driver's
//!   framebuffer (`nouveaudrmfb`, `amdgpudrmfb`), or a platform device for the firmware's own
//!   (`EFI VGA`, `simpledrm`, `VESA VGA`), which lives in the boot VGA device's memory;
//! - `sys/class/vtconsole/vtconN`: the console drivers, `name` "(M) frame buffer device"
//!   (fbcon) or "(S) VGA+" (the VGA text console), `bind` 1 while it drives the consoles.
//!
//! [`console_uses`] decides from those facts (pure, tested as a table). A DRM client holding
//! `/dev/dri/cardN` (a display server) is a process holding a device node: that is the kernel
//! holder scan's to find, not this module's.

use super::Sysfs;
use crate::model::pci::PciAddress;
use std::collections::BTreeMap;
use std::path::{Component, Path};

/// A framebuffer (`sys/class/graphics/fbN`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Framebuffer {
    /// `fb0`.
    pub name: String,
    /// What its `device` is: a PCI function, or another device (the firmware's framebuffer,
    /// a platform device). A framebuffer without a device (a virtual one) is not listed.
    pub device: FbDevice,
    /// Its driver's `name` ("nouveaudrmfb", "EFI VGA"); "" when unreadable.
    pub driver: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FbDevice {
    /// A DRM driver's framebuffer on this function.
    Pci(PciAddress),
    /// The firmware's framebuffer (efifb, simpledrm, vesafb): in the boot VGA device's memory.
    Firmware,
}

/// What kind of console driver a `vtconN` is, from its `name`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConsoleDriver {
    /// fbcon: "(M) frame buffer device".
    Framebuffer,
    /// vgacon: "(S) VGA+" and its EGA/MDA siblings, on the legacy VGA range of the boot VGA
    /// device.
    VgaText,
    /// The dummy console, or one vfiod does not know: drives no GPU.
    Other,
}

impl ConsoleDriver {
    /// From a `vtconN/name` text.
    pub fn from_name(name: &str) -> ConsoleDriver {
        if name.contains("frame buffer device") {
            ConsoleDriver::Framebuffer
        } else if ["VGA+", "EGA", "MDA"].iter().any(|k| name.contains(k)) {
            ConsoleDriver::VgaText
        } else {
            ConsoleDriver::Other
        }
    }
}

/// A console driver (`sys/class/vtconsole/vtconN`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VtConsole {
    /// `vtcon1`.
    pub name: String,
    pub driver: ConsoleDriver,
    /// `bind` reads 1: it drives the host's virtual terminals.
    pub bound: bool,
}

/// Everything [`console_uses`] decides from, as the edge read it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConsoleFacts {
    pub framebuffers: Vec<Framebuffer>,
    pub consoles: Vec<VtConsole>,
    /// The functions whose `boot_vga` reads 1 (one on a sane host).
    pub boot_vga: Vec<PciAddress>,
}

/// The boot VGA functions that drive the host's console, with why ("boot VGA device driving
/// the host console (fb0)"), except those in `allowed` (`[host] allow_console_gpu`). A GPU
/// that is not the boot VGA device, or a boot VGA device with no console bound to it (a
/// headless host's only GPU, a `vtcon` unbound on purpose), is not a use. Pure.
pub fn console_uses(
    facts: &ConsoleFacts,
    allowed: &[PciAddress],
) -> BTreeMap<PciAddress, Vec<String>> {
    let bound = |kind| facts.consoles.iter().any(|c| c.bound && c.driver == kind);
    let (fbcon, vgacon) = (
        bound(ConsoleDriver::Framebuffer),
        bound(ConsoleDriver::VgaText),
    );
    let mut out: BTreeMap<PciAddress, Vec<String>> = BTreeMap::new();
    for gpu in facts.boot_vga.iter().filter(|a| !allowed.contains(a)) {
        let mut via = Vec::new();
        if fbcon {
            let on = |want: FbDevice| {
                facts
                    .framebuffers
                    .iter()
                    .filter(move |f| f.device == want)
                    .map(|f| f.name.clone())
            };
            via.extend(on(FbDevice::Pci(*gpu)));
            via.extend(
                on(FbDevice::Firmware).map(|fb| format!("{fb}, the firmware's framebuffer")),
            );
        }
        if vgacon {
            via.push("VGA text console".to_string());
        }
        if !via.is_empty() {
            out.entry(*gpu).or_default().push(format!(
                "boot VGA device driving the host console ({})",
                via.join("; ")
            ));
        }
    }
    out
}

/// Reads the framebuffers, the console drivers and, when a console is bound, which function is
/// the boot VGA device. A host without framebuffers or consoles (a container, most simulated
/// hosts) costs two directory reads.
pub fn read_facts(sysfs: &Sysfs) -> ConsoleFacts {
    let mut facts = ConsoleFacts::default();
    let backend = sysfs.backend();
    let list = |rel: &str, prefix: &str| -> Vec<String> {
        let mut names: Vec<String> = backend
            .read_dir(&sysfs.path(rel))
            .unwrap_or_default()
            .into_iter()
            .filter_map(|n| n.into_string().ok())
            .filter(|n| n.starts_with(prefix))
            .collect();
        names.sort();
        names
    };
    for name in list("sys/class/vtconsole", "vtcon") {
        let dir = sysfs.path("sys/class/vtconsole").join(&name);
        let text = sysfs.read_text(&dir.join("name")).unwrap_or_default();
        let bound = sysfs.read_text(&dir.join("bind")).is_ok_and(|b| b == "1");
        facts.consoles.push(VtConsole {
            name,
            driver: ConsoleDriver::from_name(&text),
            bound,
        });
    }
    if !facts.consoles.iter().any(|c| c.bound) {
        return facts;
    }
    for name in list("sys/class/graphics", "fb") {
        let dir = sysfs.path("sys/class/graphics").join(&name);
        // A framebuffer with no device is a virtual one: on no GPU.
        if backend.read_link(&dir.join("device")).is_err() {
            continue;
        }
        let Ok(canon) = backend.canonicalize(&dir.join("device")) else {
            continue;
        };
        let device = match pci_function_of(&canon) {
            Some(a) => FbDevice::Pci(a),
            None => FbDevice::Firmware,
        };
        let driver = sysfs.read_text(&dir.join("name")).unwrap_or_default();
        facts.framebuffers.push(Framebuffer {
            name,
            device,
            driver,
        });
    }
    let is_boot_vga = |a: PciAddress| {
        sysfs
            .read_text(&sysfs.device_attr(a, "boot_vga"))
            .is_ok_and(|v| v == "1")
    };
    // The DRM framebuffers' functions say where to look; the firmware's framebuffer or the VGA
    // text console can be on any VGA function: then every function is asked (only VGA-class
    // ones have the attribute).
    let everywhere = facts
        .framebuffers
        .iter()
        .any(|f| f.device == FbDevice::Firmware)
        || facts
            .consoles
            .iter()
            .any(|c| c.bound && c.driver == ConsoleDriver::VgaText);
    let candidates: Vec<PciAddress> = if everywhere {
        sysfs.list_functions().unwrap_or_default()
    } else {
        facts
            .framebuffers
            .iter()
            .filter_map(|f| match f.device {
                FbDevice::Pci(a) => Some(a),
                FbDevice::Firmware => None,
            })
            .collect()
    };
    for a in candidates {
        if !facts.boot_vga.contains(&a) && is_boot_vga(a) {
            facts.boot_vga.push(a);
        }
    }
    facts.boot_vga.sort();
    facts
}

/// The PCI function a device's canonical sysfs path is under: the innermost PCI address on it
/// (none for a platform or virtual device).
fn pci_function_of(path: &Path) -> Option<PciAddress> {
    path.components()
        .filter_map(|c| match c {
            Component::Normal(s) => s.to_str()?.parse().ok(),
            _ => None,
        })
        .next_back()
}

/// The console GPUs of the host under `sysfs`, but `allowed`: [`console_uses`] of
/// [`read_facts`].
pub fn detect(sysfs: &Sysfs, allowed: &[PciAddress]) -> BTreeMap<PciAddress, Vec<String>> {
    console_uses(&read_facts(sysfs), allowed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    fn fb(name: &str, device: FbDevice) -> Framebuffer {
        Framebuffer {
            name: name.into(),
            device,
            driver: String::new(),
        }
    }

    fn con(name: &str, text: &str, bound: bool) -> VtConsole {
        VtConsole {
            name: name.into(),
            driver: ConsoleDriver::from_name(text),
            bound,
        }
    }

    #[test]
    fn console_drivers_from_their_names() {
        for (text, want) in [
            ("(M) frame buffer device", ConsoleDriver::Framebuffer),
            ("(S) VGA+", ConsoleDriver::VgaText),
            ("(S) dummy device", ConsoleDriver::Other),
            ("", ConsoleDriver::Other),
        ] {
            assert_eq!(ConsoleDriver::from_name(text), want, "{text:?}");
        }
    }

    #[test]
    fn the_boot_vga_device_is_used_while_a_console_drives_it() {
        let gpu = a("0000:17:00.0");
        let other = a("0000:65:00.0");
        let fbcon = con("vtcon1", "(M) frame buffer device", true);
        let fbcon_off = con("vtcon1", "(M) frame buffer device", false);
        let vgacon = con("vtcon0", "(S) VGA+", true);
        let dummy = con("vtcon0", "(S) dummy device", true);
        let on_gpu = fb("fb0", FbDevice::Pci(gpu));
        let on_other = fb("fb1", FbDevice::Pci(other));
        let firmware = fb("fb0", FbDevice::Firmware);
        let used = |why: &str| vec![(gpu, vec![why.to_string()])];
        let none: Vec<(PciAddress, Vec<String>)> = vec![];
        // (framebuffers, consoles, boot_vga, allowed, uses)
        let table =
            vec![
            // fbcon on the boot GPU's DRM framebuffer.
            (
                vec![on_gpu.clone()],
                vec![dummy.clone(), fbcon.clone()],
                vec![gpu],
                vec![],
                used("boot VGA device driving the host console (fb0)"),
            ),
            // The operator passes it on purpose.
            (
                vec![on_gpu.clone()],
                vec![fbcon.clone()],
                vec![gpu],
                vec![gpu],
                none.clone(),
            ),
            // fbcon unbound (echo 0 > bind): the console is gone from it.
            (
                vec![on_gpu.clone()],
                vec![fbcon_off.clone()],
                vec![gpu],
                vec![],
                none.clone(),
            ),
            // A framebuffer on a GPU that is not the boot VGA device: not the console GPU.
            (
                vec![on_other.clone()],
                vec![fbcon.clone()],
                vec![gpu],
                vec![],
                none.clone(),
            ),
            // The firmware's framebuffer (efifb, simpledrm) lives in the boot GPU's memory.
            (
                vec![firmware.clone()],
                vec![fbcon.clone()],
                vec![gpu],
                vec![],
                used(
                    "boot VGA device driving the host console (fb0, the firmware's framebuffer)",
                ),
            ),
            // The VGA text console.
            (
                vec![],
                vec![vgacon.clone()],
                vec![gpu],
                vec![],
                used("boot VGA device driving the host console (VGA text console)"),
            ),
            // A headless host: the boot VGA device, no console on it.
            (vec![on_gpu.clone()], vec![dummy.clone()], vec![gpu], vec![], none.clone()),
            // No boot VGA device known: nothing to name.
            (vec![firmware.clone()], vec![fbcon.clone()], vec![], vec![], none.clone()),
            // Both consoles on it: one reason naming both.
            (
                vec![on_gpu.clone(), on_other.clone()],
                vec![vgacon.clone(), fbcon.clone()],
                vec![gpu],
                vec![other],
                used("boot VGA device driving the host console (fb0; VGA text console)"),
            ),
        ];
        for (i, (framebuffers, consoles, boot_vga, allowed, want)) in table.into_iter().enumerate()
        {
            let facts = ConsoleFacts {
                framebuffers,
                consoles,
                boot_vga,
            };
            let got: Vec<_> = console_uses(&facts, &allowed).into_iter().collect();
            assert_eq!(got, want, "row {i}: {facts:?} allowed {allowed:?}");
        }
    }
}
