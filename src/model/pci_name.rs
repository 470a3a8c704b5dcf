//! Vendor and device names from the pci.ids database, compiled in (see `build.rs` for the form
//! of the tables and why): what `lspci` and `vfioctl list` show beside the ids.

mod tables {
    include!(concat!(env!("OUT_DIR"), "/pci_names.rs"));
}

/// The compiled-in database's identity: `2445 vendors, 19836 devices, sha256 0123456789abcdef`
/// (the database keeps no version line of its own).
pub const VERSION: &str = tables::VERSION;

fn name(at: u32, len: u16) -> &'static str {
    let at = at as usize;
    tables::NAMES
        .get(at..at + usize::from(len))
        .unwrap_or_default()
}

/// The vendor's name; `None` when the database does not know the id.
pub fn vendor(id: u16) -> Option<&'static str> {
    let i = tables::VENDORS
        .binary_search_by_key(&id, |&(v, _, _)| v)
        .ok()?;
    let (_, at, len) = tables::VENDORS[i];
    Some(name(at, len))
}

/// The device's name; `None` when the database does not know the pair.
pub fn device(vendor: u16, device: u16) -> Option<&'static str> {
    let i = tables::DEVICES
        .binary_search_by_key(&(vendor, device), |&(v, d, _, _)| (v, d))
        .ok()?;
    let (_, _, at, len) = tables::DEVICES[i];
    Some(name(at, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_found_by_id_and_unknown_ids_are_none() {
        assert_eq!(vendor(0x8086), Some("Intel Corporation"));
        assert_eq!(vendor(0x1b36), Some("Red Hat, Inc."));
        assert_eq!(device(0x1b36, 0x0010), Some("QEMU NVM Express Controller"));
        assert_eq!(device(0x8086, 0xffff), None);
        assert_eq!(vendor(0x0002), None);
        // Sorted tables, or the binary search is wrong.
        assert!(tables::VENDORS.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(tables::DEVICES
            .windows(2)
            .all(|w| (w[0].0, w[0].1) < (w[1].0, w[1].1)));
        assert!(VERSION.contains(" vendors, ") && VERSION.contains(" sha256 "));
    }
}
