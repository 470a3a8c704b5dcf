//! Domain XML, read without I/O: which host PCI functions a domain definition assigns, and the
//! domain's name. Used on the XML libvirt returns and on the XML a libvirt hook gets on stdin.

use super::DomainDevices;
use crate::model::pci::PciAddress;

/// The host PCI functions a domain definition assigns: `<hostdev mode='subsystem' type='pci'>`
/// and `<interface type='hostdev'>` (an SR-IOV VF given as a NIC), by their `<source><address>`.
/// Pure. Assignments by other means (a network of `forward mode='hostdev'` pools) show up in the
/// XML of a running domain as one of these two.
pub fn assigned_functions(xml: &str) -> Result<Vec<PciAddress>, String> {
    Ok(hostdevs(xml)?.into_iter().map(|h| h.source).collect())
}

/// A PCI hostdev of a domain definition, as the claims need it: which host function, the
/// device's alias (`<alias name=.../>`: libvirt's own, or a `ua-` alias the attacher chose), and
/// where the guest sees it (`<address type='pci'>` beside `<source>`, in the live XML).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hostdev {
    pub source: PciAddress,
    pub alias: Option<String>,
    /// "0000:07:00.0"; `None` when the definition does not say (an inactive definition may not).
    pub guest_address: Option<String>,
}

/// The PCI hostdevs (`<hostdev mode='subsystem' type='pci'>` and `<interface type='hostdev'>`)
/// of a domain definition. Pure.
pub fn hostdevs(xml: &str) -> Result<Vec<Hostdev>, String> {
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
    for dev in devices.children().filter(|n| is_pci_hostdev(n)) {
        let Some(address) = dev
            .children()
            .find(|n| n.has_tag_name("source"))
            .and_then(|s| s.children().find(|n| n.has_tag_name("address")))
            .filter(|a| a.attribute("type").is_none_or(|t| t == "pci"))
        else {
            continue;
        };
        let source = source_address(address)?;
        let alias = dev
            .children()
            .find(|n| n.has_tag_name("alias"))
            .and_then(|a| a.attribute("name"))
            .map(str::to_string);
        let guest_address = dev
            .children()
            .find(|n| n.has_tag_name("address") && n.attribute("type") == Some("pci"))
            .map(source_address)
            .transpose()?
            .map(|a| a.to_string());
        out.push(Hostdev {
            source,
            alias,
            guest_address,
        });
    }
    Ok(out)
}

fn is_pci_hostdev(dev: &roxmltree::Node<'_, '_>) -> bool {
    if !dev.is_element() {
        return false;
    }
    match dev.tag_name().name() {
        "hostdev" => {
            dev.attribute("mode").unwrap_or("subsystem") == "subsystem"
                && dev.attribute("type") == Some("pci")
        }
        "interface" => dev.attribute("type") == Some("hostdev"),
        _ => false,
    }
}

/// The `<hostdev>` that gives a domain host function `source`, with `managed='no'`: vfiod binds
/// the function to vfio-pci itself, and libvirt must never rebind it behind vfiod's back. The
/// alias (`ua-` prefix, libvirt's rule for user aliases) names it in libvirt's events and XML.
pub fn hostdev_xml(source: PciAddress, alias: &str) -> String {
    format!(
        "<hostdev mode='subsystem' type='pci' managed='no'>\
         <source><address domain='0x{:04x}' bus='0x{:02x}' slot='0x{:02x}' function='0x{:x}'/></source>\
         <alias name='{alias}'/></hostdev>",
        source.domain, source.bus, source.slot, source.function
    )
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
    fn hostdevs_carry_their_alias_and_guest_address() {
        let xml = r#"<domain><name>n</name><devices>
            <hostdev mode='subsystem' type='pci' managed='no'>
              <driver name='vfio'/>
              <source><address domain='0x0000' bus='0x01' slot='0x00' function='0x1'/></source>
              <alias name='ua-vfiod-7-0'/>
              <address type='pci' domain='0x0000' bus='0x07' slot='0x00' function='0x0'/>
            </hostdev>
            <hostdev mode='subsystem' type='pci'>
              <source><address domain='0x0000' bus='0x01' slot='0x00' function='0x2'/></source>
            </hostdev></devices></domain>"#;
        assert_eq!(
            hostdevs(xml).unwrap(),
            vec![
                Hostdev {
                    source: a("0000:01:00.1"),
                    alias: Some("ua-vfiod-7-0".into()),
                    guest_address: Some("0000:07:00.0".into()),
                },
                Hostdev {
                    source: a("0000:01:00.2"),
                    alias: None,
                    guest_address: None,
                },
            ]
        );
        // What vfiod attaches parses back to the same function and alias.
        let mine = format!(
            "<domain><devices>{}</devices></domain>",
            hostdev_xml(a("0000:af:1f.7"), "ua-vfiod-12-1")
        );
        let back = hostdevs(&mine).unwrap();
        assert_eq!(back[0].source, a("0000:af:1f.7"));
        assert_eq!(back[0].alias.as_deref(), Some("ua-vfiod-12-1"));
        assert!(mine.contains("managed='no'"), "{mine}");
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
