//! Domain XML, read without I/O: the domain's name and UUID, the host PCI functions it assigns
//! (and how many other host devices), and vfiod's record in its `<metadata>`. One parser,
//! [`parse_domain`]; the older entry points ([`hostdevs`], [`assigned_functions`],
//! [`domain_devices`]) are views of it. Used on the XML libvirt returns, on the XML a libvirt
//! hook gets on stdin, and on libvirt's status XML (`<domstatus>` around the `<domain>`).
//!
//! The rule: XML libvirt accepts is read the way libvirt reads it (numbers like `strtoul`,
//! defaults, which element wins); what libvirt would refuse in the parts read here is an error
//! that names the element, attribute and value. Nothing here panics on any input, which
//! `fuzz/` checks. Elements of libvirt's schema are matched with no namespace, as libvirt's
//! XPath matches them; vfiod's metadata by its namespace URI.
//!
//! - `devices.rs`: `<hostdev>` and `<interface>`, the host and guest addresses.
//! - `metadata.rs`: vfiod's `<metadata>` element, read and written.
//! - `number.rs`: libvirt's reading of numbers.
//! - `limits.rs`: the bounds that keep any input's parse linear ([`MAX_WORK`]).

mod device;
mod limits;
mod metadata;
mod number;
mod retarget;

pub use limits::{MAX_ATTRIBUTES, MAX_ATTRIBUTES_PER_ELEMENT, MAX_NODES, MAX_WORK};
pub use metadata::{
    metadata_element, metadata_element_with, metadata_xml, metadata_xml_with, parse_metadata,
    parse_metadata_pooled, parse_pooled, MetadataDevice, MetadataPooled, METADATA_KEY, VFIOD_NS,
};
pub use retarget::retarget_hostdevs;

use super::DomainDevices;
use crate::model::pci::PciAddress;
use roxmltree::Node;

/// A domain definition, as vfiod needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DomainXml {
    /// `<name>`, without surrounding white space.
    pub name: String,
    /// `<uuid>`, in libvirt's canonical form (lower case, 8-4-4-4-12); `None` when absent or
    /// empty (libvirt then makes one up).
    pub uuid: Option<String>,
    /// The PCI host functions, in document order.
    pub hostdevs: Vec<Hostdev>,
    /// USB, SCSI, mdev and capabilities hostdevs (as `<hostdev>` or as a hostdev interface):
    /// counted, never returned as PCI functions.
    pub other_hostdevs: usize,
    /// vfiod's record in `<metadata>` ([`METADATA_KEY`], [`VFIOD_NS`]); empty when absent.
    pub metadata: Vec<MetadataDevice>,
}

/// How a domain definition gives a host PCI function to its guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Origin {
    /// `<hostdev mode='subsystem' type='pci'>`.
    Hostdev,
    /// `<interface type='hostdev'>`: an SR-IOV VF given as a NIC; also how the live XML of a
    /// running domain shows a VF its network chose.
    Interface,
    /// `<interface type='network'>` whose `<actual type='hostdev'>` (status XML) carries the
    /// function a `<forward mode='hostdev'>` network chose from its pool.
    Network,
}

/// A PCI hostdev of a domain definition, as the claims need it: which host function, the
/// device's alias (`<alias name=.../>`: libvirt's own, or a `ua-` alias the attacher chose), and
/// where the guest sees it (`<address type='pci'>` beside `<source>`, in the live XML).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hostdev {
    pub source: PciAddress,
    pub alias: Option<String>,
    /// "0000:07:00.0"; `None` when the definition does not say (an inactive definition may not,
    /// and libvirt's `<address type='pci'/>` means "to be assigned").
    pub guest_address: Option<String>,
    /// `managed='yes'`: libvirt binds the function to vfio-pci itself at start and gives it back
    /// to its host driver at stop. vfiod's own attachments are `managed='no'`.
    pub managed: bool,
    pub origin: Origin,
}

/// The whole of what vfiod reads in a domain definition: `<domain>`, or libvirt's status XML
/// (`<domstatus>` with the `<domain>` inside). Pure.
pub fn parse_domain(xml: &str) -> Result<DomainXml, String> {
    with_domain(xml, |domain| {
        let name = name(domain).ok_or("the domain has no <name>")?;
        let uuid = uuid(domain)?;
        let devices = device::read(domain)?;
        let metadata = metadata::read(domain)?;
        Ok(DomainXml {
            name,
            uuid,
            hostdevs: devices.hostdevs,
            other_hostdevs: devices.others,
            metadata,
        })
    })
}

/// The host PCI functions a domain definition assigns: `<hostdev mode='subsystem' type='pci'>`,
/// `<interface type='hostdev'>` (an SR-IOV VF given as a NIC) and, in status XML, a network's
/// `<actual type='hostdev'>`, by their `<source><address>`. Pure. A running domain's live XML
/// shows a VF its network chose as an `<interface type='hostdev'>`.
pub fn assigned_functions(xml: &str) -> Result<Vec<PciAddress>, String> {
    Ok(hostdevs(xml)?.into_iter().map(|h| h.source).collect())
}

/// The PCI hostdevs of a domain definition ([`DomainXml::hostdevs`]), without requiring a
/// `<name>` or reading the metadata. Pure.
pub fn hostdevs(xml: &str) -> Result<Vec<Hostdev>, String> {
    with_domain(xml, |domain| Ok(device::read(domain)?.hostdevs))
}

/// A domain's name and the host PCI functions its definition assigns. Pure.
pub fn domain_devices(xml: &str) -> Result<DomainDevices, String> {
    with_domain(xml, |domain| {
        let functions = device::read(domain)?
            .hostdevs
            .into_iter()
            .map(|h| h.source)
            .collect();
        let name = name(domain).ok_or("the domain has no <name>")?;
        Ok(DomainDevices {
            domain: name,
            functions,
        })
    })
}

/// The `<hostdev>` that gives a domain host function `source`, with `managed='no'`: vfiod binds
/// the function to vfio-pci itself, and libvirt must never rebind it behind vfiod's back. The
/// alias (`ua-` prefix, libvirt's rule for user aliases) names it in libvirt's events and XML;
/// it is escaped (an alias read from a domain's XML may hold any character).
pub fn hostdev_xml(source: PciAddress, alias: &str) -> String {
    format!(
        "<hostdev mode='subsystem' type='pci' managed='no'>\
         <source><address domain='0x{:04x}' bus='0x{:02x}' slot='0x{:02x}' function='0x{:x}'/></source>\
         <alias name='{}'/></hostdev>",
        source.domain,
        source.bus,
        source.slot,
        source.function,
        escape(alias)
    )
}

/// Parses `xml` and hands `f` the `<domain>` element: the root, or the `<domain>` child of a
/// `<domstatus>` root. roxmltree refuses a DTD, so entity expansion bombs never expand; the
/// bounds of [`limits`] keep the parse linear in the input.
fn with_domain<T>(
    xml: &str,
    f: impl FnOnce(Node<'_, '_>) -> Result<T, String>,
) -> Result<T, String> {
    let doc = limits::parse(xml)?;
    let root = doc.root_element();
    if is(root, "domain") {
        f(root)
    } else if is(root, "domstatus") {
        f(child(root, "domain").ok_or("the status XML <domstatus> has no <domain>")?)
    } else {
        Err(format!(
            "the root element is <{}>, not <domain> (or libvirt's status <domstatus>)",
            element_name(root)
        ))
    }
}

/// roxmltree's message, which may quote a name from the input (an unknown entity, an unbound
/// prefix, a mismatched tag) at any length: cut.
fn invalid_xml(e: roxmltree::Error) -> String {
    let message = e.to_string();
    match message.char_indices().nth(240) {
        None => format!("invalid XML: {message}"),
        Some((end, _)) => format!("invalid XML: {}...", &message[..end]),
    }
}

/// `text` as an attribute value between quotes of either kind. Tab, newline and carriage return
/// are written as references: a parser turns them into spaces when written as they are.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '\'' => out.push_str("&apos;"),
            '"' => out.push_str("&quot;"),
            '\t' => out.push_str("&#9;"),
            '\n' => out.push_str("&#10;"),
            '\r' => out.push_str("&#13;"),
            // XML 1.0 Char: no other C0 control, no U+FFFE or U+FFFF, even as a reference.
            '\0'..='\x1f' | '\u{fffe}' | '\u{ffff}' => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// An element of libvirt's schema: this name and no namespace.
fn is(node: Node<'_, '_>, name: &str) -> bool {
    node.is_element() && node.tag_name().name() == name && node.tag_name().namespace().is_none()
}

/// The child elements of libvirt's schema called `name`.
fn children<'a, 'input: 'a>(
    node: Node<'a, 'input>,
    name: &'a str,
) -> impl Iterator<Item = Node<'a, 'input>> + 'a {
    node.children().filter(move |n| is(*n, name))
}

/// The first child element of libvirt's schema called `name` (libvirt's XPath `./name[1]`).
fn child<'a, 'input>(node: Node<'a, 'input>, name: &str) -> Option<Node<'a, 'input>> {
    node.children().find(|n| is(*n, name))
}

/// An element's name for an error: `name`, or `name` with its namespace URI.
fn element_name(node: Node<'_, '_>) -> String {
    let name = cut(node.tag_name().name());
    match node.tag_name().namespace() {
        Some(ns) => format!("{name} xmlns={}", quote(ns)),
        None => name,
    }
}

/// A value from the XML, quoted for an error message and cut to its first 64 characters: a
/// 1 MB attribute is not echoed back whole.
fn quote(text: &str) -> String {
    format!("{:?}", cut(text))
}

fn cut(text: &str) -> String {
    const MAX: usize = 64;
    match text.char_indices().nth(MAX) {
        None => text.to_string(),
        Some((end, _)) => format!("{}...", &text[..end]),
    }
}

/// `<name>`: the text of the first one (XPath `string()`, so comments and CDATA split nothing),
/// without surrounding white space; `None` when empty.
fn name(domain: Node<'_, '_>) -> Option<String> {
    let text = string_value(child(domain, "name")?);
    let name = text.trim();
    (!name.is_empty()).then(|| name.to_string())
}

fn string_value(node: Node<'_, '_>) -> String {
    node.descendants()
        .filter(|n| n.is_text())
        .filter_map(|n| n.text())
        .collect()
}

/// `<uuid>` as libvirt reads it (`virUUIDParse`): 32 hex digits, with `-` or spaces anywhere
/// between pairs, white space around; written back in the canonical form.
fn uuid(domain: Node<'_, '_>) -> Result<Option<String>, String> {
    let Some(node) = child(domain, "uuid") else {
        return Ok(None);
    };
    let text = string_value(node);
    if text.is_empty() {
        return Ok(None);
    }
    let bad = || format!("the domain's <uuid> {} is not a UUID", quote(&text));
    let mut rest = text.trim_start_matches(number::is_c_space).as_bytes();
    let mut bytes = Vec::with_capacity(16);
    while bytes.len() < 16 {
        match rest {
            [b'-' | b' ', tail @ ..] => rest = tail,
            [h, l, tail @ ..] if h.is_ascii_hexdigit() && l.is_ascii_hexdigit() => {
                let digit = |c: u8| (c as char).to_digit(16).unwrap_or(0) as u8;
                bytes.push(digit(*h) << 4 | digit(*l));
                rest = tail;
            }
            _ => return Err(bad()),
        }
    }
    if !rest.iter().all(|&c| number::is_c_space(c as char)) {
        return Err(bad());
    }
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(Some(format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )))
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
                    managed: false,
                    origin: Origin::Hostdev,
                },
                Hostdev {
                    source: a("0000:01:00.2"),
                    alias: None,
                    guest_address: None,
                    managed: false,
                    origin: Origin::Hostdev,
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

    #[test]
    fn a_uuid_is_read_as_libvirt_reads_it_and_written_canonically() {
        let canonical = "1f0f3a2e-6c8d-4e0b-9a55-0b5d2c7e4a01";
        for text in [
            "1f0f3a2e-6c8d-4e0b-9a55-0b5d2c7e4a01",
            "1F0F3A2E-6C8D-4E0B-9A55-0B5D2C7E4A01",
            "1f0f3a2e6c8d4e0b9a550b5d2c7e4a01",
            " \n 1f 0f 3a 2e-6c8d-4e0b-9a55-0b5d2c7e4a01 \t",
            "-1f0f3a2e--6c8d4e0b9a550b5d2c7e4a01",
        ] {
            let xml = format!("<domain><name>n</name><uuid>{text}</uuid></domain>");
            assert_eq!(
                parse_domain(&xml).unwrap().uuid.as_deref(),
                Some(canonical),
                "{text:?}"
            );
        }
        for text in [
            "1f0f3a2e-6c8d-4e0b-9a55-0b5d2c7e4a0",
            "1f0f3a2e-6c8d-4e0b-9a55-0b5d2c7e4a011",
            "1f0f3a2e-6c8d-4e0b-9a55-0b5d2c7e4a0g",
            "1f0f3a2e-6c8d-4e0b-9a55-0b5d2c7e4a01 x",
            "1-f0f3a2e-6c8d-4e0b-9a55-0b5d2c7e4a01",
            " ",
        ] {
            let xml = format!("<domain><name>n</name><uuid>{text}</uuid></domain>");
            let err = parse_domain(&xml).unwrap_err();
            assert!(err.contains("is not a UUID"), "{text:?}: {err}");
        }
        let none = parse_domain("<domain><name>n</name><uuid/></domain>").unwrap();
        assert_eq!(none.uuid, None);
    }

    /// Checked against libvirt 9.0's reading (`virsh define`, `dumpxml`) where libvirt takes
    /// the XML as a definition: it refuses the ccw-first guest address, and reads `<actual>`
    /// only in status XML.
    #[test]
    fn devices_are_read_as_libvirt_reads_them() {
        let parse = |devices: &str| {
            parse_domain(&format!(
                "<domain><name>n</name><devices>{devices}</devices></domain>"
            ))
            .map(|d| (d.hostdevs, d.other_hostdevs))
        };
        let one = |h: &[Hostdev]| (h[0].source.to_string(), h[0].managed, h[0].origin);
        // Only managed='yes' is managed.
        for (managed, expect) in [("yes", true), ("no", false), ("YES", false), ("1", false)] {
            let (h, _) = parse(&format!(
                "<hostdev type='pci' managed='{managed}'><source><address bus='3'/></source>\
                 </hostdev>"
            ))
            .unwrap();
            assert_eq!(h[0].managed, expect, "{managed}");
        }
        // The type of a PCI hostdev's source address is ignored; a missing address is 0.
        let (h, _) = parse(
            "<hostdev type='pci'><source><address type='usb' bus='3' slot='1'/></source></hostdev>\
             <hostdev type='pci'><source/></hostdev>",
        )
        .unwrap();
        assert_eq!(h[0].source, a("0000:03:01.0"));
        assert_eq!(h[1].source, a("0000:00:00.0"));
        // A hostdev interface with a USB source is not PCI; a USB vendor means USB.
        let (h, others) = parse(
            "<interface type='hostdev'><source><address type='usb' bus='1' device='4'/></source>\
             </interface><interface type='hostdev'><source><vendor id='0x1'/>\
             <product id='0x2'/></source></interface>",
        )
        .unwrap();
        assert_eq!((h.len(), others), (0, 2));
        // A network interface is a hostdev only through its <actual type='hostdev'>.
        let (h, others) = parse(
            "<interface type='network'><source network='pool'/></interface>\
             <interface type='network'><actual type='direct'><source dev='eth0'/></actual>\
             </interface>\
             <interface type='network'><actual type='hostdev'><source>\
             <address type='pci' bus='0x3b' slot='2' function='3'/></source></actual>\
             <alias name='hostdev0'/><address type='pci' bus='2'/></interface>\
             <interface type='bridge'><actual type='hostdev'><source>\
             <address type='pci' bus='0x3c'/></source></actual></interface>",
        )
        .unwrap();
        assert_eq!(
            h,
            vec![Hostdev {
                source: a("0000:3b:02.3"),
                alias: Some("hostdev0".into()),
                guest_address: Some("0000:02:00.0".into()),
                managed: false,
                origin: Origin::Network,
            }]
        );
        assert_eq!(others, 0);
        // The first direct <address> is the guest's, and only when it is PCI and assigned.
        for (guest, expect) in [
            ("<address type='pci' bus='7'/>", Some("0000:07:00.0")),
            ("<address type='pci'/>", None),
            ("<address type='pci' function='3'/>", None),
            (
                "<address type='ccw' cssid='0xfe'/><address type='pci' bus='7'/>",
                None,
            ),
            (
                "<address type='pci' domain='0x10000'/>",
                Some("10000:00:00.0"),
            ),
        ] {
            let (h, _) = parse(&format!(
                "<hostdev type='pci'><source><address bus='3'/></source>{guest}</hostdev>"
            ))
            .unwrap();
            assert_eq!(h[0].guest_address.as_deref(), expect, "{guest}");
        }
        let (h, _) = parse(
            "<interface type='hostdev' managed='yes'><source><address type='pci' bus='0xaf'/>\
             </source></interface>",
        )
        .unwrap();
        assert_eq!(one(&h), ("0000:af:00.0".into(), true, Origin::Interface));
    }

    #[test]
    fn the_domain_is_found_in_status_xml_only_inside_domstatus() {
        let status = "<domstatus state='running'><devices><device alias='hostdev0'/></devices>\
                      <domain type='kvm'><name>s</name><devices><hostdev type='pci'><source>\
                      <address bus='1'/></source></hostdev></devices></domain></domstatus>";
        let d = parse_domain(status).unwrap();
        assert_eq!((d.name.as_str(), d.hostdevs.len()), ("s", 1));
        for (xml, expect) in [
            (
                "<domain xmlns='urn:x'><name>n</name></domain>",
                "the root element is <domain xmlns=\"urn:x\">, not <domain>",
            ),
            (
                "<domstatus><x:domain xmlns:x='urn:x'/></domstatus>",
                "<domstatus> has no <domain>",
            ),
            (
                &format!("<{}/>", "n".repeat(1000)),
                "the root element is <nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn...>",
            ),
        ] {
            let err = parse_domain(xml).unwrap_err();
            assert!(err.contains(expect), "{xml}: {err}");
        }
    }

    #[test]
    fn the_name_is_the_text_of_the_first_name() {
        let name = |xml: &str| parse_domain(xml).map(|d| d.name);
        assert_eq!(
            name("<domain><name> a<!-- c -->b <![CDATA[c]]>\n</name><name>x</name></domain>"),
            Ok("ab c".into())
        );
        assert!(name("<domain><name/><name>x</name></domain>").is_err());
    }
}
