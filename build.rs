//! Writes the PCI vendor and device names vfiod shows (from the `pci-ids` crate's copy of the
//! pci.ids database) as plain sorted tables of integers and one string, into
//! `$OUT_DIR/pci_names.rs` (included by `src/model/pci_name.rs`).
//!
//! Why not link `pci-ids` itself: its tables are structs of `&'static str` and slices (with
//! every subsystem), about 66,000 pointers that the dynamic loader relocates at every start,
//! dirtying 1.6 MB of each process's memory, and 3 MB of the binary. These tables hold no
//! pointer (names are offsets into one string), so they stay in the read-only, shared, paged-
//! on-demand part of the binary: a lookup touches a page or two.

use sha2::Digest;
use std::fmt::Write as _;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    let mut vendors: Vec<&pci_ids::Vendor> = pci_ids::Vendors::iter().collect();
    vendors.sort_by_key(|v| v.id());
    let mut names = String::new();
    let mut vendor_rows = String::new();
    let mut device_rows = String::new();
    let mut device_count = 0usize;
    // The database's identity, as `vfioctl record` writes it in a manifest: ids and names in
    // id order, devices in the database's order within their vendor.
    let mut digest = sha2::Sha256::new();
    let add = |name: &str, names: &mut String| -> (u32, u16) {
        let at = names.len() as u32;
        names.push_str(name);
        (at, name.len() as u16)
    };
    for v in &vendors {
        digest.update(v.id().to_le_bytes());
        digest.update(v.name().as_bytes());
        let (at, len) = add(v.name(), &mut names);
        writeln!(vendor_rows, "    ({:#06x}, {at}, {len}),", v.id()).unwrap();
        let mut devices: Vec<&pci_ids::Device> = v.devices().collect();
        for d in &devices {
            digest.update(d.id().to_le_bytes());
            digest.update(d.name().as_bytes());
        }
        devices.sort_by_key(|d| d.id());
        for d in devices {
            device_count += 1;
            let (at, len) = add(d.name(), &mut names);
            writeln!(
                device_rows,
                "    ({:#06x}, {:#06x}, {at}, {len}),",
                v.id(),
                d.id()
            )
            .unwrap();
        }
    }
    let hex: String = digest.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let out = format!(
        "/// The database's identity: its counts and a digest of its ids and names.\n\
         pub const VERSION: &str = \"{} vendors, {device_count} devices, sha256 {hex}\";\n\
         /// (vendor id, name offset, name length), sorted by id.\n\
         pub static VENDORS: [(u16, u32, u16); {}] = [\n{vendor_rows}];\n\
         /// (vendor id, device id, name offset, name length), sorted.\n\
         pub static DEVICES: [(u16, u16, u32, u16); {device_count}] = [\n{device_rows}];\n\
         /// Every name, one after the other.\n\
         pub static NAMES: &str = {names:?};\n",
        vendors.len(),
        vendors.len(),
    );
    let path = std::path::Path::new(&std::env::var("OUT_DIR").unwrap()).join("pci_names.rs");
    std::fs::write(path, out).unwrap();
}
