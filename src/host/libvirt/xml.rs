//! Domain XML, read without I/O: which host PCI functions a domain definition assigns, and the
//! domain's name. Used on the XML libvirt returns and on the XML a libvirt hook gets on stdin.

use super::DomainDevices;
use crate::model::pci::PciAddress;

/// The host PCI functions a domain definition assigns: `<hostdev mode='subsystem' type='pci'>`
/// and `<interface type='hostdev'>` (an SR-IOV VF given as a NIC), by their `<source><address>`.
/// Pure. Assignments by other means (a network of `forward mode='hostdev'` pools) show up in the
/// XML of a running domain as one of these two.
pub fn assigned_functions(xml: &str) -> Result<Vec<PciAddress>, String> {
    let doc = roxmltree::Document::parse(xml).map_err(|e| format!("invalid XML: {e}"))?;
    let root = doc.root_element();
    if !root.has_tag_name("domain") {
        return Err(format!(
            "the root element is <{}>, not <domain>",
            root.tag_name().name()
        ));
    }
    let mut out = Vec::new();
    let Some(devices) = root.children().find(|n| n.has_tag_name("devices")) else {
        return Ok(out);
    };
    for dev in devices.children().filter(|n| n.is_element()) {
        let pci = match dev.tag_name().name() {
            "hostdev" => {
                dev.attribute("mode").unwrap_or("subsystem") == "subsystem"
                    && dev.attribute("type") == Some("pci")
            }
            "interface" => dev.attribute("type") == Some("hostdev"),
            _ => false,
        };
        if !pci {
            continue;
        }
        let address = dev
            .children()
            .find(|n| n.has_tag_name("source"))
            .and_then(|s| s.children().find(|n| n.has_tag_name("address")));
        let Some(address) = address else {
            // A hostdev whose source is not given by address (e.g. not yet resolved): nothing
            // this function can name.
            continue;
        };
        if address.attribute("type").is_some_and(|t| t != "pci") {
            continue;
        }
        out.push(source_address(address)?);
    }
    Ok(out)
}

/// `<address domain='0x0000' bus='0x3b' slot='0x02' function='0x0'/>`: values are hex with
/// `0x`, or decimal, as libvirt accepts them.
fn source_address(node: roxmltree::Node<'_, '_>) -> Result<PciAddress, String> {
    let field = |name: &str, max: u32| -> Result<u32, String> {
        let text = node.attribute(name).unwrap_or("0");
        let value = match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
            Some(hex) => u32::from_str_radix(hex, 16),
            None => text.parse(),
        }
        .map_err(|_| format!("hostdev source address {name}={text:?} is not a number"))?;
        if value > max {
            return Err(format!(
                "hostdev source address {name}={text:?} is out of range"
            ));
        }
        Ok(value)
    };
    let text = format!(
        "{:04x}:{:02x}:{:02x}.{:x}",
        field("domain", 0xffff)?,
        field("bus", 0xff)?,
        field("slot", 0x1f)?,
        field("function", 0x7)?
    );
    text.parse()
        .map_err(|e| format!("hostdev source address {text}: {e}"))
}

/// A domain's name and the host PCI functions its definition assigns. Pure.
pub fn domain_devices(xml: &str) -> Result<DomainDevices, String> {
    let functions = assigned_functions(xml)?;
    let doc = roxmltree::Document::parse(xml).map_err(|e| format!("invalid XML: {e}"))?;
    let name = doc
        .root_element()
        .children()
        .find(|n| n.has_tag_name("name"))
        .and_then(|n| n.text())
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .ok_or("the domain has no <name>")?;
    Ok(DomainDevices {
        domain: name.to_string(),
        functions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    #[test]
    fn hostdevs_and_hostdev_interfaces_are_found() {
        let xml = r#"<domain type='kvm' id='3'>
          <name>web1</name>
          <devices>
            <disk type='file' device='disk'><source file='/x.qcow2'/></disk>
            <hostdev mode='subsystem' type='pci' managed='yes'>
              <driver name='vfio'/>
              <source><address domain='0x0000' bus='0x3b' slot='0x02' function='0x1'/></source>
              <address type='pci' domain='0x0000' bus='0x05' slot='0x00' function='0x0'/>
            </hostdev>
            <interface type='hostdev' managed='yes'>
              <source><address type='pci' domain='0x0000' bus='0xaf' slot='0x00' function='0x2'/></source>
            </interface>
            <interface type='network'><source network='default'/></interface>
            <hostdev mode='subsystem' type='usb'><source><vendor id='0x1234'/></source></hostdev>
            <hostdev mode='subsystem' type='pci'>
              <source><address domain='0' bus='23' slot='0' function='0'/></source>
            </hostdev>
          </devices>
        </domain>"#;
        assert_eq!(
            assigned_functions(xml).unwrap(),
            vec![a("0000:3b:02.1"), a("0000:af:00.2"), a("0000:17:00.0")]
        );
    }

    #[test]
    fn a_domain_without_devices_assigns_nothing() {
        assert_eq!(
            assigned_functions("<domain><name>x</name></domain>").unwrap(),
            vec![]
        );
    }

    #[test]
    fn bad_xml_is_an_error_that_says_why() {
        for (xml, expect) in [
            ("<domain>", "invalid XML"),
            ("<network/>", "not <domain>"),
            (
                "<domain><devices><hostdev type='pci'><source><address bus='0x1ff'/></source></hostdev></devices></domain>",
                "bus=\"0x1ff\" is out of range",
            ),
            (
                "<domain><devices><hostdev type='pci'><source><address slot='x'/></source></hostdev></devices></domain>",
                "slot=\"x\" is not a number",
            ),
        ] {
            let err = assigned_functions(xml).unwrap_err();
            assert!(err.contains(expect), "{xml}: {err}");
        }
    }

    #[test]
    fn a_hook_domain_is_named_by_its_xml() {
        let xml = "<domain><name> vm1 </name><devices><hostdev type='pci'>\
                   <source><address bus='0x3b'/></source></hostdev></devices></domain>";
        assert_eq!(
            domain_devices(xml).unwrap(),
            DomainDevices {
                domain: "vm1".into(),
                functions: vec![a("0000:3b:00.0")]
            }
        );
        let err = domain_devices("<domain><name/></domain>").unwrap_err();
        assert!(err.contains("no <name>"), "{err}");
    }
}
