//! vfiod's record in a domain's `<metadata>`: per device vfiod manages for the domain, what it
//! is. It lives in the domain definition, so it travels with the domain (migration, save,
//! `virsh dumpxml`). Elements are matched by vfiod's namespace URI, never by prefix.
//!
//! Three spellings of the same record:
//! - in the domain XML (what `virsh dumpxml` shows, [`metadata_element`]):
//!   `<metadata><vfiod:devices xmlns:vfiod="https://vfiod.org/xmlns/vfiod/1">
//!   <vfiod:device source="0000:01:00.1" kind="nvme" id="1b36:0010" role="vf" claim="7"/>
//!   </vfiod:devices></metadata>`;
//! - what `virDomainSetMetadata` takes with key [`METADATA_KEY`] and uri [`VFIOD_NS`]
//!   ([`metadata_xml`]): the same element with no namespace. libvirt puts every element of it
//!   in the namespace itself, and refuses an element that already binds the key's prefix
//!   ("failed to create a new XML namespace", libvirt 9.0);
//! - what `virDomainGetMetadata` returns: again the element with no namespace
//!   ([`parse_metadata`] reads it).

use super::{children, escape, quote};
use crate::model::pci::PciAddress;
use roxmltree::Node;

/// vfiod's XML namespace URI in domain metadata.
pub const VFIOD_NS: &str = "https://vfiod.org/xmlns/vfiod/1";

/// The prefix (libvirt's "key") vfiod's metadata element gets in a domain's XML.
pub const METADATA_KEY: &str = "vfiod";

/// One device vfiod manages for a domain, as recorded in the domain's metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetadataDevice {
    /// The host PCI function, on the host that wrote the record (after a migration it names a
    /// function of the source host).
    pub source: PciAddress,
    /// vfiod's kind of the device (`nvme`, `gpu`, ...); empty when the record has none.
    pub kind: String,
    /// `vendor:device`, hex (`1b36:0010`); empty when the record has none.
    pub id: String,
    /// `pf`, `vf` or `function`; empty when the record has none.
    pub role: String,
    /// The claim that holds the device.
    pub claim: Option<i64>,
}

/// A pooled session vfiod holds for the domain (a claim of kind `pooled`), as recorded in the
/// domain's metadata beside the devices:
/// `<vfiod:pooled pool="gpus" session="s-17" device="gpu-3" epoch="2" host="hosta"/>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetadataPooled {
    /// The `[[pool]]` name (the same on every host the VM may go to).
    pub pool: String,
    pub session: String,
    pub device: String,
    /// The session's epoch when the record was written: the fencing token a destination uses.
    pub epoch: u64,
    /// The host that owned the session when the record was written.
    pub host: String,
}

/// vfiod's pooled sessions in the `<metadata>` of a domain definition (`<domain>` or libvirt's
/// `<domstatus>`); none when there is no vfiod element. Pure.
pub fn parse_pooled(xml: &str) -> Result<Vec<MetadataPooled>, String> {
    super::with_domain(xml, |domain| match ours(domain) {
        Some(element) => pooled(element),
        None => Ok(Vec::new()),
    })
}

/// The pooled sessions of what `virDomainGetMetadata` returns for vfiod's namespace, or of
/// vfiod's element as it appears in a domain.
pub fn parse_metadata_pooled(xml: &str) -> Result<Vec<MetadataPooled>, String> {
    let doc = super::limits::parse(xml)?;
    let root = doc.root_element();
    if root.tag_name().name() != "devices" {
        return Err(format!(
            "the root element is <{}>, not vfiod's <devices>",
            super::element_name(root)
        ));
    }
    pooled(root)
}

/// vfiod's `<devices>` element in a domain's `<metadata>`, if it has one this version reads.
fn ours<'a, 'input>(domain: Node<'a, 'input>) -> Option<Node<'a, 'input>> {
    let metadata = children(domain, "metadata").next()?;
    metadata
        .children()
        .find(|n| n.is_element() && n.tag_name().namespace() == Some(VFIOD_NS))
        .filter(|n| n.tag_name().name() == "devices")
}

fn pooled(element: Node<'_, '_>) -> Result<Vec<MetadataPooled>, String> {
    element
        .children()
        .filter(|n| {
            n.is_element()
                && n.tag_name().name() == "pooled"
                && matches!(n.tag_name().namespace(), None | Some(VFIOD_NS))
        })
        .map(|n| {
            let need = |name: &str| {
                n.attribute(name)
                    .filter(|v| !v.is_empty())
                    .map(str::to_string)
                    .ok_or(format!("a vfiod metadata <pooled> has no {name}"))
            };
            let epoch = need("epoch")?;
            Ok(MetadataPooled {
                pool: need("pool")?,
                session: need("session")?,
                device: n.attribute("device").unwrap_or_default().to_string(),
                epoch: epoch.parse().map_err(|_| {
                    format!(
                        "vfiod metadata pooled epoch={} is not a number",
                        quote(&epoch)
                    )
                })?,
                host: n.attribute("host").unwrap_or_default().to_string(),
            })
        })
        .collect()
}

/// [`metadata_xml`] with the domain's pooled sessions too: what `virDomainSetMetadata` takes.
/// vfiod's element is one per domain, so whoever writes it writes both.
pub fn metadata_xml_with(devices: &[MetadataDevice], pooled: &[MetadataPooled]) -> String {
    format!(
        "<devices>{}{}</devices>",
        device_elements(devices, ""),
        pooled_elements(pooled, "")
    )
}

/// [`metadata_element`] with the domain's pooled sessions too.
pub fn metadata_element_with(devices: &[MetadataDevice], pooled: &[MetadataPooled]) -> String {
    format!(
        "<{METADATA_KEY}:devices xmlns:{METADATA_KEY}='{VFIOD_NS}'>{}{}</{METADATA_KEY}:devices>",
        device_elements(devices, "vfiod:"),
        pooled_elements(pooled, "vfiod:")
    )
}

fn pooled_elements(pooled: &[MetadataPooled], prefix: &str) -> String {
    pooled
        .iter()
        .map(|p| {
            format!(
                "<{prefix}pooled pool='{}' session='{}' device='{}' epoch='{}' host='{}'/>",
                escape(&p.pool),
                escape(&p.session),
                escape(&p.device),
                p.epoch,
                escape(&p.host)
            )
        })
        .collect()
}

/// vfiod's devices in the `<metadata>` of `domain`: libvirt keeps one element per namespace
/// there (the first), and so does this: the first element in vfiod's namespace. If it is not
/// `devices` (a later format), there are none this version can read.
pub(super) fn read(domain: Node<'_, '_>) -> Result<Vec<MetadataDevice>, String> {
    let Some(metadata) = children(domain, "metadata").next() else {
        return Ok(Vec::new());
    };
    match metadata
        .children()
        .find(|n| n.is_element() && n.tag_name().namespace() == Some(VFIOD_NS))
    {
        Some(ours) if ours.tag_name().name() == "devices" => devices(ours),
        _ => Ok(Vec::new()),
    }
}

/// The devices of what `virDomainGetMetadata` returns for vfiod's namespace (`<devices>` with
/// no namespace), or of vfiod's element as it appears in a domain (`<vfiod:devices>`).
pub fn parse_metadata(xml: &str) -> Result<Vec<MetadataDevice>, String> {
    let doc = super::limits::parse(xml)?;
    let root = doc.root_element();
    let ns = root.tag_name().namespace();
    if root.tag_name().name() != "devices" || !(ns.is_none() || ns == Some(VFIOD_NS)) {
        return Err(format!(
            "the root element is <{}>, not vfiod's <devices>",
            super::element_name(root)
        ));
    }
    devices(root)
}

/// The `<device>` children of vfiod's `<devices>`: in vfiod's namespace (as libvirt stores
/// them) or in none (as `virDomainGetMetadata` returns them, or as written by hand inside a
/// `<vfiod:devices>`). Elements of other namespaces are someone else's and skipped.
fn devices(element: Node<'_, '_>) -> Result<Vec<MetadataDevice>, String> {
    element
        .children()
        .filter(|n| {
            n.is_element()
                && n.tag_name().name() == "device"
                && matches!(n.tag_name().namespace(), None | Some(VFIOD_NS))
        })
        .map(device)
        .collect()
}

fn device(node: Node<'_, '_>) -> Result<MetadataDevice, String> {
    let text = node
        .attribute("source")
        .ok_or("a vfiod metadata <device> has no source")?;
    let source = text.parse().map_err(|_| {
        format!(
            "vfiod metadata device source={} is not a PCI address",
            quote(text)
        )
    })?;
    let claim = match node.attribute("claim") {
        None => None,
        Some(text) => Some(text.parse().map_err(|_| {
            format!(
                "vfiod metadata device claim={} is not a claim id",
                quote(text)
            )
        })?),
    };
    let string = |name| node.attribute(name).unwrap_or_default().to_string();
    Ok(MetadataDevice {
        source,
        kind: string("kind"),
        id: string("id"),
        role: string("role"),
        claim,
    })
}

/// The element to give `virDomainSetMetadata` (type element, key [`METADATA_KEY`], uri
/// [`VFIOD_NS`]): `<devices><device source='0000:01:00.1' kind='nvme' id='1b36:0010'
/// role='vf' claim='7'/></devices>`, with no namespace: libvirt puts it and its children in
/// vfiod's namespace. Values are escaped; characters XML cannot carry at all (most control
/// characters) become U+FFFD.
pub fn metadata_xml(devices: &[MetadataDevice]) -> String {
    format!("<devices>{}</devices>", device_elements(devices, ""))
}

/// vfiod's metadata element as it appears inside a domain's `<metadata>`:
/// `<vfiod:devices xmlns:vfiod='https://vfiod.org/xmlns/vfiod/1'><vfiod:device .../>
/// </vfiod:devices>`. For writing a domain definition directly (a hook's migrate filter, a
/// `define`); for a defined domain use [`metadata_xml`] with `virDomainSetMetadata`.
pub fn metadata_element(devices: &[MetadataDevice]) -> String {
    format!(
        "<{METADATA_KEY}:devices xmlns:{METADATA_KEY}='{VFIOD_NS}'>{}</{METADATA_KEY}:devices>",
        device_elements(devices, "vfiod:")
    )
}

fn device_elements(devices: &[MetadataDevice], prefix: &str) -> String {
    let mut out = String::new();
    for d in devices {
        out.push_str(&format!(
            "<{prefix}device source='{}' kind='{}' id='{}' role='{}'",
            d.source,
            escape(&d.kind),
            escape(&d.id),
            escape(&d.role)
        ));
        if let Some(claim) = d.claim {
            out.push_str(&format!(" claim='{claim}'"));
        }
        out.push_str("/>");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooled_sessions_travel_beside_the_devices() {
        let devices = [MetadataDevice {
            source: "0000:01:00.1".parse().unwrap(),
            kind: "nvme".into(),
            id: "1b36:0010".into(),
            role: "vf".into(),
            claim: Some(7),
        }];
        let pooled = [MetadataPooled {
            pool: "gpus".into(),
            session: "s-1".into(),
            device: "gpu-'0".into(),
            epoch: 3,
            host: "hosta".into(),
        }];
        // As virDomainSetMetadata takes it and virDomainGetMetadata returns it.
        let x = metadata_xml_with(&devices, &pooled);
        assert_eq!(parse_metadata(&x).unwrap(), devices);
        assert_eq!(parse_metadata_pooled(&x).unwrap(), pooled);
        // Inside a domain, as a hook gets it.
        let domain = format!(
            "<domain><name>vm1</name><metadata><other xmlns='urn:x'/>{}</metadata></domain>",
            metadata_element_with(&devices, &pooled)
        );
        assert_eq!(parse_pooled(&domain).unwrap(), pooled);
        assert_eq!(
            super::super::parse_domain(&domain).unwrap().metadata,
            devices
        );
        assert_eq!(
            parse_pooled("<domain><name>x</name></domain>").unwrap(),
            vec![]
        );
        let bad =
            "<domain><name>x</name><metadata><v:devices xmlns:v='https://vfiod.org/xmlns/vfiod/1'>\
                   <v:pooled pool='p' session='s' epoch='x'/></v:devices></metadata></domain>";
        assert!(parse_pooled(bad).unwrap_err().contains("epoch"));
        let bad = bad.replace("session='s' ", "");
        assert!(parse_pooled(&bad).unwrap_err().contains("session"));
    }
}
