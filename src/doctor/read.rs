//! The doctor's filesystem edge: what the checks decide from, read under one root (`/` on a
//! real host, the simulated kernel's tree otherwise). Only reads: files are opened read-only,
//! a directory is listed, a link is read.
//! No device node is opened, nothing is written, nothing is opened exclusively.

use super::{
    acs_from_config, Acs, ConfigFacts, DeviceFacts, HookState, InterruptFacts, LibvirtFacts, Mate,
    ModuleFacts, ModuleState, Standing,
};
use crate::config::Settings;
use crate::host::modules::{Availability, ModuleIndex};
use crate::host::sysfs::{RawFunction, Sysfs};
use crate::inventory::{is_managed, Identity};
use crate::model::pci::PciAddress;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// libvirt's sockets (the monolithic daemon's, then the modular `virtqemud`'s), relative to
/// the root.
const LIBVIRT_SOCKETS: [&str; 2] = ["run/libvirt/libvirt-sock", "run/libvirt/virtqemud-sock"];
/// Where libvirt reads vfiod's hook, and its single-script hook, relative to the root.
const HOOK: &str = "etc/libvirt/hooks/qemu.d/vfiod";
const QEMU_SCRIPT: &str = "etc/libvirt/hooks/qemu";
/// Where distributions install polkitd.
const POLKITD: [&str; 4] = [
    "usr/lib/polkit-1/polkitd",
    "usr/libexec/polkitd",
    "usr/libexec/polkit-1/polkitd",
    "usr/lib/polkit/polkitd",
];

/// `rel` as the operator knows it: `/sys/...`.
fn shown(rel: &str) -> String {
    format!("/{rel}")
}

/// Entries of `/sys/class/iommu`.
pub fn iommu_units(root: &Path) -> Option<Vec<String>> {
    let entries = std::fs::read_dir(root.join("sys/class/iommu")).ok()?;
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    Some(names)
}

/// Interrupt remapping as `/proc/interrupts` shows it, and the VFIO modules' consent to go
/// without it.
pub fn interrupts(root: &Path) -> InterruptFacts {
    let lines = std::fs::read_to_string(root.join("proc/interrupts"))
        .ok()
        .map(|text| count_chips(&text));
    let allow_unsafe = ["vfio_iommu_type1", "iommufd"].iter().any(|m| {
        std::fs::read_to_string(
            root.join("sys/module")
                .join(m)
                .join("parameters/allow_unsafe_interrupts"),
        )
        .is_ok_and(|v| matches!(v.trim(), "Y" | "y" | "1"))
    });
    InterruptFacts {
        lines,
        allow_unsafe,
    }
}

/// (lines on remapped chips, lines on plain IO-APIC or MSI chips) of `/proc/interrupts`.
pub fn count_chips(text: &str) -> (usize, usize) {
    let mut remapped = 0;
    let mut plain = 0;
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.iter().any(|w| w.starts_with("IR-")) {
            remapped += 1;
        } else if words
            .iter()
            .any(|w| *w == "IO-APIC" || w.starts_with("PCI-MSI"))
        {
            plain += 1;
        }
    }
    (remapped, plain)
}

/// The VFIO modules.
pub fn modules(root: &Path) -> ModuleFacts {
    let index = ModuleIndex::read(root);
    let state = |name: &str| -> ModuleState {
        let dir = root.join("sys/module").join(name);
        if dir.is_dir() {
            // Loaded modules have `initstate`; built-in ones with parameters show a
            // directory without it.
            return if dir.join("initstate").exists() {
                ModuleState::Loaded
            } else {
                ModuleState::BuiltIn
            };
        }
        // vfio-pci's driver registered is the module loaded, whatever its spelling.
        let dashed = name.replace('_', "-");
        let answers = [index.availability(name), index.availability(&dashed)];
        if answers.contains(&Availability::Loaded) {
            ModuleState::Loaded
        } else if answers.contains(&Availability::Builtin) {
            ModuleState::BuiltIn
        } else if answers.contains(&Availability::Module) {
            ModuleState::Installed
        } else if answers.contains(&Availability::Unknown) {
            ModuleState::Missing
        } else {
            ModuleState::Unknown
        }
    };
    ModuleFacts {
        vfio: state("vfio"),
        vfio_pci: state("vfio_pci"),
        vfio_iommu_type1: state("vfio_iommu_type1"),
        iommufd: state("iommufd"),
    }
}

/// The configuration's facts and the selected functions, each with its IOMMU group and the ACS
/// above it. Selection is the daemon's ([`is_managed`]) with the configuration's `[[protect]]`
/// only: what the host itself uses is the daemon's to find (it opens block devices
/// exclusively, which the doctor never does).
pub fn devices(
    sysfs: &Sysfs,
    settings: &Settings,
    sources: Vec<String>,
) -> (ConfigFacts, Vec<DeviceFacts>) {
    let addresses = sysfs.list_functions().unwrap_or_default();
    let raws: BTreeMap<PciAddress, RawFunction> = addresses
        .iter()
        .filter_map(|a| Some((*a, RawFunction::read(sysfs, *a).ok()?)))
        .collect();
    let identities: BTreeMap<PciAddress, Identity> =
        raws.iter().map(|(a, r)| (*a, Identity::from(r))).collect();
    let protected = |r: &RawFunction| {
        settings
            .is_protected_by_config(r.address, r.vendor_id, r.device_id, r.class)
            .map(|s| s.to_string())
    };
    let standing = |r: &RawFunction| -> Standing {
        if let Some(by) = protected(r) {
            return Standing::Protected(by);
        }
        if is_managed(
            settings,
            r.address,
            Identity::from(r),
            r.physfn,
            &identities,
            false,
        ) {
            Standing::Selected
        } else {
            Standing::NotSelected
        }
    };
    let selected: Vec<&RawFunction> = raws
        .values()
        .filter(|r| r.physfn.is_none() && standing(r) == Standing::Selected)
        .collect();
    let config = ConfigFacts::Loaded {
        sources,
        rules: settings.select.len(),
        selected: selected.len(),
    };
    let devices = selected
        .into_iter()
        .map(|r| {
            let mates = r
                .iommu_group
                .and_then(|g| sysfs.iommu_group_members(g).ok())
                .unwrap_or_default()
                .into_iter()
                .filter(|a| *a != r.address)
                .map(|a| match raws.get(&a) {
                    Some(m) => Mate {
                        address: a,
                        bridge: m.class.is_bridge(),
                        standing: standing(m),
                    },
                    // Unreadable: it cannot be shown to be selected.
                    None => Mate {
                        address: a,
                        bridge: false,
                        standing: Standing::NotSelected,
                    },
                })
                .collect();
            DeviceFacts {
                address: r.address,
                group: r.iommu_group,
                mates,
                upstream: upstream(sysfs, r.address),
            }
        })
        .collect();
    (config, devices)
}

/// The bridges above a function (nearest first), from its place in `/sys/devices`, with what
/// ACS each shows in its configuration space.
fn upstream(sysfs: &Sysfs, address: PciAddress) -> Vec<(PciAddress, Acs)> {
    let Ok(path) = sysfs.backend().canonicalize(&sysfs.device_dir(address)) else {
        return Vec::new();
    };
    let mut bridges: Vec<PciAddress> = path
        .components()
        .filter_map(|c| c.as_os_str().to_str()?.parse().ok())
        .filter(|a| *a != address)
        .collect();
    bridges.reverse();
    bridges
        .into_iter()
        .map(|b| {
            let acs = sysfs
                .backend()
                .read(&sysfs.device_attr(b, "config"))
                .map_or(Acs::Unknown, |c| acs_from_config(&c));
            (b, acs)
        })
        .collect()
}

/// libvirt: the daemon that runs, its sockets, and the hook where it reads it. The sockets
/// are looked at, not connected to: systemd would start the daemon.
pub fn libvirt(root: &Path, uri: Option<String>) -> LibvirtFacts {
    use std::os::unix::fs::FileTypeExt;
    LibvirtFacts {
        uri,
        daemon: crate::host::libvirt::local_daemon(root),
        sockets: LIBVIRT_SOCKETS
            .iter()
            .filter(|rel| {
                std::fs::symlink_metadata(root.join(rel)).is_ok_and(|m| m.file_type().is_socket())
            })
            .map(|rel| shown(rel))
            .collect(),
        hook: hook(root),
    }
}

fn hook(root: &Path) -> HookState {
    use std::os::unix::fs::PermissionsExt;
    let path = root.join(HOOK);
    // Followed: the installed hook is a link to vfiod-qemu-hook.
    match std::fs::metadata(&path) {
        Ok(m) if m.is_file() => HookState::Installed {
            path: shown(HOOK),
            executable: m.permissions().mode() & 0o111 != 0,
            modified: std::fs::symlink_metadata(&path)
                .and_then(|l| l.modified())
                .ok(),
        },
        _ => HookState::Missing {
            path: shown(HOOK),
            qemu_script: root.join(QEMU_SCRIPT).is_file(),
        },
    }
}

/// The polkitd binary under the root, if installed.
pub fn polkitd(root: &Path) -> Option<String> {
    POLKITD
        .iter()
        .find(|rel| root.join(rel).is_file())
        .map(|rel| shown(rel))
}

/// The configuration as read for the doctor.
#[derive(Debug)]
pub enum Configuration {
    Loaded {
        settings: Box<Settings>,
        /// The files read, in order (none: the defaults).
        sources: Vec<String>,
    },
    Invalid(crate::config::ConfigError),
}

/// The configuration to check: `path` (a file, or a directory laid out as `/etc/vfiod`), else
/// `$VFIOD_CONFIG` (a main file), else the installed files.
pub fn configuration(path: Option<&Path>) -> Configuration {
    use crate::config::{DEFAULT_CONFIG_PATH, DEFAULT_DROPIN_DIR};
    let (main, dropins, required): (PathBuf, Option<PathBuf>, bool) = match path {
        Some(p) if p.is_dir() => (p.join("vfiod.toml"), Some(p.join("conf.d")), false),
        Some(p) => (p.to_path_buf(), None, true),
        None => match std::env::var_os("VFIOD_CONFIG") {
            Some(p) => (PathBuf::from(p), None, true),
            None => (
                PathBuf::from(DEFAULT_CONFIG_PATH),
                Some(PathBuf::from(DEFAULT_DROPIN_DIR)),
                false,
            ),
        },
    };
    match Settings::load(&main, dropins.as_deref(), required) {
        Ok(s) => Configuration::Loaded {
            sources: s.sources.iter().map(|p| p.display().to_string()).collect(),
            settings: Box::new(s),
        },
        Err(e) => Configuration::Invalid(e),
    }
}
