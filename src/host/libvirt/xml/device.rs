//! The host PCI functions of a domain's `<devices>`, read the way libvirt's own parser
//! (`virDomainHostdevDefParseXML`, `virDomainNetDefParseXML`) reads them:
//!
//! - `<hostdev>`: `mode` defaults to `subsystem`; `type='pci'` is a PCI function; `usb`, `scsi`,
//!   `scsi_host`, `mdev` (and any other type) and `mode='capabilities'` are counted, not
//!   returned. A subsystem hostdev with no `type`, or an unknown `mode`, is an error (libvirt
//!   refuses both).
//! - `<interface type='hostdev'>`, and `<interface type='network'>` with an `<actual
//!   type='hostdev'>` (the network chose a VF from its pool; status XML): the type of the
//!   `<source><address>` decides, `pci` being a PCI function; no type is an error (libvirt's
//!   "missing source address type") unless the source names a USB `<vendor>`.
//! - The host function is the first `<address>` of the first `<source>`, whatever its `type`
//!   (libvirt ignores it there); a missing address is `0000:00:00.0`, as in libvirt; a missing
//!   `<source>` is an error. `managed='yes'` (exactly) is managed, anything else is not.
//! - The guest's address is the device's first direct `<address>` child, when it is
//!   `type='pci'` and not libvirt's "to be assigned" (domain, bus and slot all 0).

use super::number::{parse_unsigned, NumberError};
use super::{child, children, quote, Hostdev, Origin};
use crate::model::pci::PciAddress;
use roxmltree::Node;

/// What a domain's `<devices>` assign.
#[derive(Debug, Default)]
pub(super) struct Devices {
    pub hostdevs: Vec<Hostdev>,
    /// USB, SCSI, mdev, capabilities hostdevs: not PCI host functions.
    pub others: usize,
}

/// Every `<devices>` child of `<domain>` (libvirt's XPath `./devices/hostdev` reads them all).
pub(super) fn read(domain: Node<'_, '_>) -> Result<Devices, String> {
    let mut out = Devices::default();
    for devices in children(domain, "devices") {
        for device in devices.children().filter(|n| n.is_element()) {
            if device.tag_name().namespace().is_some() {
                continue;
            }
            match device.tag_name().name() {
                "hostdev" => hostdev(device, &mut out)?,
                "interface" => interface(device, &mut out)?,
                _ => {}
            }
        }
    }
    Ok(out)
}

fn hostdev(device: Node<'_, '_>, out: &mut Devices) -> Result<(), String> {
    match device.attribute("mode").unwrap_or("subsystem") {
        "subsystem" => match device.attribute("type") {
            Some("pci") => out.hostdevs.push(pci(device, device, Origin::Hostdev)?),
            Some(_) => out.others += 1,
            None => return Err("a <hostdev mode='subsystem'> has no type".into()),
        },
        "capabilities" => out.others += 1,
        mode => return Err(format!("a <hostdev> has an unknown mode={}", quote(mode))),
    }
    Ok(())
}

fn interface(device: Node<'_, '_>, out: &mut Devices) -> Result<(), String> {
    match device.attribute("type") {
        Some("hostdev") => network_hostdev(device, device, Origin::Interface, out),
        Some("network") => match child(device, "actual") {
            Some(actual) if actual.attribute("type") == Some("hostdev") => {
                network_hostdev(actual, device, Origin::Network, out)
            }
            _ => Ok(()),
        },
        _ => Ok(()),
    }
}

/// A hostdev given as a NIC: `holder` (the `<interface>` or its `<actual>`) has the source and
/// `managed`; `device` (the `<interface>`) has the alias and the guest's address.
fn network_hostdev(
    holder: Node<'_, '_>,
    device: Node<'_, '_>,
    origin: Origin,
    out: &mut Devices,
) -> Result<(), String> {
    // libvirt: string(./source/address/@type), and a ./source/vendor means USB.
    let address_type = children(holder, "source")
        .flat_map(|s| children(s, "address"))
        .find_map(|a| a.attribute("type"));
    let usb_vendor = children(holder, "source").any(|s| child(s, "vendor").is_some());
    match address_type {
        Some("pci") => out.hostdevs.push(pci(holder, device, origin)?),
        Some(_) => out.others += 1,
        None if usb_vendor => out.others += 1,
        None => return Err(format!("{} source address has no type", label(origin))),
    }
    Ok(())
}

fn pci(holder: Node<'_, '_>, device: Node<'_, '_>, origin: Origin) -> Result<Hostdev, String> {
    let what = label(origin);
    let source = child(holder, "source").ok_or_else(|| format!("{what} has no <source>"))?;
    let source = match child(source, "address") {
        Some(address) => {
            let [domain, bus, slot, function] = numbers(address, what, "source")?;
            in_range(what, "source", address, domain, bus, slot, function)?
        }
        None => PciAddress::new(0, 0, 0, 0),
    };
    let guest_address = match child(device, "address") {
        Some(address) if address.attribute("type") == Some("pci") => {
            let [domain, bus, slot, function] = numbers(address, what, "guest")?;
            if domain == 0 && bus == 0 && slot == 0 {
                None
            } else {
                let a = in_range(what, "guest", address, domain, bus, slot, function)?;
                Some(a.to_string())
            }
        }
        _ => None,
    };
    Ok(Hostdev {
        source,
        alias: child(device, "alias")
            .and_then(|a| a.attribute("name"))
            .map(str::to_string),
        guest_address,
        managed: holder.attribute("managed") == Some("yes"),
        origin,
    })
}

/// How an error names the device kind.
fn label(origin: Origin) -> &'static str {
    match origin {
        Origin::Hostdev => "a PCI <hostdev>",
        Origin::Interface => "an <interface type='hostdev'>",
        Origin::Network => "an <interface type='network'> with <actual type='hostdev'>",
    }
}

const FIELDS: [&str; 4] = ["domain", "bus", "slot", "function"];

/// The four attributes of a PCI `<address>`, each 0 when absent.
fn numbers(address: Node<'_, '_>, what: &str, which: &str) -> Result<[u32; 4], String> {
    let mut out = [0; 4];
    for (value, name) in out.iter_mut().zip(FIELDS) {
        let Some(text) = address.attribute(name) else {
            continue;
        };
        *value = parse_unsigned(text).map_err(|e| {
            let why = match e {
                NumberError::NotANumber => "is not a number",
                NumberError::TooLarge => "is out of range (at most 0xffffffff)",
            };
            format!("{what} {which} address {name}={} {why}", quote(text))
        })?;
    }
    Ok(out)
}

/// libvirt's limits: any 32-bit domain (VMD domains are above 0xffff), bus 0xff, slot 0x1f,
/// function 7.
fn in_range(
    what: &str,
    which: &str,
    address: Node<'_, '_>,
    domain: u32,
    bus: u32,
    slot: u32,
    function: u32,
) -> Result<PciAddress, String> {
    for (value, max, name) in [
        (bus, 0xff, "bus"),
        (slot, 0x1f, "slot"),
        (function, 7, "function"),
    ] {
        if value > max {
            let text = address.attribute(name).unwrap_or_default();
            return Err(format!(
                "{what} {which} address {name}={} is out of range (at most {max:#x})",
                quote(text)
            ));
        }
    }
    Ok(PciAddress::new(
        domain,
        bus as u8,
        slot as u8,
        function as u8,
    ))
}
