//! A domain XML with some of its PCI hostdevs pointed at other host functions: what the
//! destination's `migrate` hook outputs (libvirt takes a filter hook's output as the domain's
//! new XML) when a device whose driver migrates its state moves with the VM and must land on
//! this host's equivalent function. Pure; everything else in the XML is kept byte for byte.

use super::number::parse_unsigned;
use crate::model::pci::PciAddress;
use roxmltree::Node;

/// `xml` with the `<source><address>` of each PCI hostdev (and hostdev interface) whose host
/// function is a `from` of `map` replaced by its `to`. Hostdevs not in the map are untouched;
/// a `from` the XML does not have is an error (the caller expected to move it).
pub fn retarget_hostdevs(xml: &str, map: &[(PciAddress, PciAddress)]) -> Result<String, String> {
    let doc = super::limits::parse(xml)?;
    let mut edits: Vec<(std::ops::Range<usize>, String)> = Vec::new();
    let mut found = Vec::new();
    for node in doc.descendants().filter(|n| is_pci_hostdev(n)) {
        let Some(address) = node
            .children()
            .find(|n| n.has_tag_name("source"))
            .and_then(|s| s.children().find(|n| n.has_tag_name("address")))
        else {
            continue;
        };
        let Some(from) = read(address) else { continue };
        if let Some((_, to)) = map.iter().find(|(f, _)| *f == from) {
            let kind = address
                .attribute("type")
                .map(|t| format!(" type='{}'", escape(t)))
                .unwrap_or_default();
            edits.push((
                address.range(),
                format!(
                    "<address{kind} domain='0x{:04x}' bus='0x{:02x}' slot='0x{:02x}' function='0x{:x}'/>",
                    to.domain, to.bus, to.slot, to.function
                ),
            ));
            found.push(from);
        }
    }
    if let Some((missing, _)) = map.iter().find(|(f, _)| !found.contains(f)) {
        return Err(format!("the domain has no PCI hostdev of {missing}"));
    }
    let mut out = xml.to_string();
    edits.sort_by_key(|(r, _)| std::cmp::Reverse(r.start));
    for (range, text) in edits {
        out.replace_range(range, &text);
    }
    Ok(out)
}

fn is_pci_hostdev(n: &Node<'_, '_>) -> bool {
    if !n.is_element() || n.tag_name().namespace().is_some() {
        return false;
    }
    match n.tag_name().name() {
        "hostdev" => {
            n.attribute("mode").unwrap_or("subsystem") == "subsystem"
                && n.attribute("type") == Some("pci")
        }
        "interface" => n.attribute("type") == Some("hostdev"),
        _ => false,
    }
}

fn read(address: Node<'_, '_>) -> Option<PciAddress> {
    let field = |name: &str| match address.attribute(name) {
        Some(t) => parse_unsigned(t).ok(),
        None => Some(0),
    };
    let (domain, bus, slot, function) = (
        field("domain")?,
        field("bus")?,
        field("slot")?,
        field("function")?,
    );
    if bus > 0xff || slot > 0x1f || function > 7 {
        return None;
    }
    Some(PciAddress::new(
        domain,
        bus as u8,
        slot as u8,
        function as u8,
    ))
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('\'', "&apos;")
        .replace('<', "&lt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    #[test]
    fn only_the_named_sources_change() {
        let xml = "<domain><name>m</name><devices>\
            <hostdev mode='subsystem' type='pci' managed='no'>\
            <source><address domain='0x0000' bus='0x81' slot='0x00' function='0x1'/></source>\
            <alias name='ua-vfiod-4-0'/>\
            <address type='pci' domain='0x0000' bus='0x07' slot='0x00' function='0x0'/></hostdev>\
            <interface type='hostdev'><source><address type='pci' bus='129' slot='0' function='2'/></source></interface>\
            <hostdev mode='subsystem' type='pci'><source><address bus='0x82'/></source></hostdev>\
            </devices></domain>";
        let out = retarget_hostdevs(
            xml,
            &[
                (a("0000:81:00.1"), a("0000:01:00.3")),
                (a("0000:81:00.2"), a("0000:01:00.4")),
            ],
        )
        .unwrap();
        let now = super::super::hostdevs(&out).unwrap();
        let sources: Vec<_> = now.iter().map(|h| h.source).collect();
        assert_eq!(
            sources,
            [a("0000:01:00.3"), a("0000:01:00.4"), a("0000:82:00.0")]
        );
        // The guest's address and the alias are the VM's: unchanged.
        assert_eq!(now[0].guest_address.as_deref(), Some("0000:07:00.0"));
        assert_eq!(now[0].alias.as_deref(), Some("ua-vfiod-4-0"));
        assert!(
            out.contains(
                "<address type='pci' domain='0x0000' bus='0x01' slot='0x00' function='0x4'/>"
            ),
            "{out}"
        );
        // Nothing to move: the same text.
        assert_eq!(retarget_hostdevs(xml, &[]).unwrap(), xml);
        let e = retarget_hostdevs(xml, &[(a("0000:99:00.0"), a("0000:01:00.1"))]).unwrap_err();
        assert!(e.contains("no PCI hostdev of 0000:99:00.0"), "{e}");
        assert!(retarget_hostdevs("<domain", &[]).is_err());
    }
}
