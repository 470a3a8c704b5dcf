//! Every public entry point of `host::libvirt::xml` on arbitrary UTF-8: none panics, they agree
//! with each other, errors stay short, and what vfiod writes (`hostdev_xml`, `metadata_xml`,
//! `metadata_element`) reads back to what it was made from.

#![no_main]

use libfuzzer_sys::fuzz_target;
use vfiod::host::libvirt::xml::{
    assigned_functions, domain_devices, hostdev_xml, hostdevs, metadata_element, metadata_xml,
    parse_domain, parse_metadata, MetadataDevice,
};
use vfiod::host::libvirt::DomainDevices;
use vfiod::model::pci::PciAddress;

fuzz_target!(|data: &[u8]| {
    if let Ok(xml) = std::str::from_utf8(data) {
        check_domain(xml);
        check_metadata(xml);
        check_escaping(xml);
    }
});

/// An error names what failed and quotes at most a short piece of the input.
fn short<T>(result: &Result<T, String>) {
    if let Err(e) = result {
        assert!(e.len() < 600, "error of {} bytes: {e}", e.len());
    }
}

fn check_domain(xml: &str) {
    let parsed = parse_domain(xml);
    let found = hostdevs(xml);
    let functions = assigned_functions(xml);
    let named = domain_devices(xml);
    short(&parsed);
    short(&found);
    short(&functions);
    short(&named);

    // The views agree with each other whatever the input.
    match &found {
        Ok(h) => {
            let sources: Vec<PciAddress> = h.iter().map(|h| h.source).collect();
            assert_eq!(functions.as_ref(), Ok(&sources));
            if let Ok(n) = &named {
                assert_eq!(n.functions, sources);
            }
        }
        Err(e) => {
            assert_eq!(functions.as_ref(), Err(e));
            assert!(named.is_err());
            assert!(parsed.is_err());
        }
    }

    let Ok(d) = parsed else {
        return;
    };
    assert_eq!(found.as_ref(), Ok(&d.hostdevs));
    assert_eq!(
        named,
        Ok(DomainDevices {
            domain: d.name.clone(),
            functions: d.hostdevs.iter().map(|h| h.source).collect(),
        })
    );
    assert!(
        !d.name.is_empty() && d.name.trim() == d.name,
        "{:?}",
        d.name
    );
    if let Some(uuid) = &d.uuid {
        assert_eq!(uuid.len(), 36, "{uuid}");
        assert!(
            uuid.chars()
                .enumerate()
                .all(|(i, c)| if [8, 13, 18, 23].contains(&i) {
                    c == '-'
                } else {
                    c.is_ascii_digit() || ('a'..='f').contains(&c)
                }),
            "{uuid}"
        );
    }
    for h in &d.hostdevs {
        if let Some(g) = &h.guest_address {
            g.parse::<PciAddress>()
                .unwrap_or_else(|e| panic!("guest address {g}: {e}"));
        }
        // What vfiod would attach or detach for this hostdev reads back to it.
        let alias = h.alias.clone().unwrap_or_default();
        let mine = format!(
            "<domain><devices>{}</devices></domain>",
            hostdev_xml(h.source, &alias)
        );
        let back = hostdevs(&mine).unwrap_or_else(|e| panic!("{mine}: {e}"));
        assert_eq!(back.len(), 1, "{mine}");
        assert_eq!(back[0].source, h.source, "{mine}");
        assert_eq!(back[0].alias.as_deref(), Some(alias.as_str()), "{mine}");
        assert!(!back[0].managed);
    }

    // The metadata, written back both ways, reads back the same.
    round_trip(&d.metadata);
}

fn round_trip(devices: &[MetadataDevice]) {
    let set = metadata_xml(devices);
    assert_eq!(
        parse_metadata(&set).as_deref(),
        Ok(devices),
        "metadata_xml: {set}"
    );
    let element = metadata_element(devices);
    assert_eq!(
        parse_metadata(&element).as_deref(),
        Ok(devices),
        "metadata_element: {element}"
    );
    let domain = format!("<domain><name>n</name><metadata>{element}</metadata></domain>");
    let back = parse_domain(&domain).unwrap_or_else(|e| panic!("{domain}: {e}"));
    assert_eq!(back.metadata, devices, "{domain}");
}

fn check_metadata(xml: &str) {
    let parsed = parse_metadata(xml);
    short(&parsed);
    if let Ok(devices) = parsed {
        round_trip(&devices);
    }
}

/// Any text as a metadata value or an alias is written so that it reads back, but for the
/// characters XML cannot carry at all, which become U+FFFD.
fn check_escaping(text: &str) {
    let carried: String = text
        .chars()
        .map(|c| match c {
            '\t' | '\n' | '\r' => c,
            '\0'..='\x1f' | '\u{fffe}' | '\u{ffff}' => '\u{fffd}',
            c => c,
        })
        .collect();
    let device = MetadataDevice {
        source: PciAddress::new(0x10000, 0xff, 0x1f, 7),
        kind: text.to_string(),
        id: text.chars().rev().collect(),
        role: String::new(),
        claim: Some(i64::MIN),
    };
    let back = parse_metadata(&metadata_xml(std::slice::from_ref(&device)))
        .unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].kind, carried);
    assert_eq!(back[0].id, carried.chars().rev().collect::<String>());
    assert_eq!(back[0].claim, Some(i64::MIN));

    let mine = format!(
        "<domain><devices>{}</devices></domain>",
        hostdev_xml(device.source, text)
    );
    let back = hostdevs(&mine).unwrap_or_else(|e| panic!("{mine}: {e}"));
    assert_eq!(back[0].alias.as_deref(), Some(carried.as_str()));
}
