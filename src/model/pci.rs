//! PCI identities: the `PciAddress` newtype, class-code helpers, and what a config-space
//! header that reads all-ones means.
//!
//! Addresses are the kernel's `DDDD:BB:SS.F` form. The D-Bus object name uses libvirt's nodedev
//! spelling (`pci_DDDD_BB_SS_F`) so that an operator can match vfiod's objects to `virsh nodedev-*`.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// A PCI function address: domain, bus, slot (device) and function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct PciAddress {
    pub domain: u32,
    pub bus: u8,
    pub slot: u8,
    pub function: u8,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid PCI address {input}: expected DDDD:BB:SS.F (e.g. 0000:3b:00.0)")]
pub struct AddressError {
    /// The text, quoted, and cut to its first 64 characters when longer (an address comes from
    /// callers: a 1 MB one is not echoed back whole).
    pub input: String,
}

impl AddressError {
    fn of(text: &str) -> AddressError {
        const MAX: usize = 64;
        let n = text.chars().count();
        let input = if n <= MAX {
            format!("{text:?}")
        } else {
            let head: String = text.chars().take(MAX).collect();
            format!("{head:?}... ({n} characters)")
        };
        AddressError { input }
    }
}

impl PciAddress {
    pub const fn new(domain: u32, bus: u8, slot: u8, function: u8) -> Self {
        PciAddress {
            domain,
            bus,
            slot,
            function,
        }
    }

    /// libvirt's node-device name, also the last element of vfiod's device object path.
    pub fn nodedev_name(&self) -> String {
        format!(
            "pci_{:04x}_{:02x}_{:02x}_{:x}",
            self.domain, self.bus, self.slot, self.function
        )
    }

    /// Inverse of [`PciAddress::nodedev_name`].
    pub fn from_nodedev_name(name: &str) -> Result<Self, AddressError> {
        let err = || AddressError::of(name);
        let rest = name.strip_prefix("pci_").ok_or_else(err)?;
        let parts: Vec<&str> = rest.split('_').collect();
        if parts.len() != 4 {
            return Err(err());
        }
        format!("{}:{}:{}.{}", parts[0], parts[1], parts[2], parts[3])
            .parse()
            .map_err(|_| err())
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.slot, self.function
        )
    }
}

impl FromStr for PciAddress {
    type Err = AddressError;

    /// Accepts `DDDD:BB:SS.F` and the short `BB:SS.F` (domain 0), as lspci prints them.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || AddressError::of(s);
        let (head, func) = s.rsplit_once('.').ok_or_else(err)?;
        let parts: Vec<&str> = head.split(':').collect();
        let (dom, bus, slot) = match parts.as_slice() {
            [d, b, s] => (*d, *b, *s),
            [b, s] => ("0000", *b, *s),
            _ => return Err(err()),
        };
        let hex = |v: &str, max_len: usize| -> Result<u32, AddressError> {
            if v.is_empty() || v.len() > max_len || !v.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(err());
            }
            u32::from_str_radix(v, 16).map_err(|_| err())
        };
        let domain = hex(dom, 8)?;
        let bus = hex(bus, 2)? as u8;
        let slot = hex(slot, 2)?;
        let function = hex(func, 1)?;
        if slot > 0x1f || function > 7 {
            return Err(err());
        }
        Ok(PciAddress::new(domain, bus, slot as u8, function as u8))
    }
}

impl TryFrom<String> for PciAddress {
    type Error = AddressError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<PciAddress> for String {
    fn from(a: PciAddress) -> String {
        a.to_string()
    }
}

/// 24-bit PCI class code (base class, sub class, programming interface), as in sysfs `class`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ClassCode(pub u32);

impl ClassCode {
    pub fn base(self) -> u8 {
        (self.0 >> 16) as u8
    }
    pub fn sub(self) -> u8 {
        (self.0 >> 8) as u8
    }
    pub fn prog_if(self) -> u8 {
        self.0 as u8
    }
    /// Base class 0x06: host, PCI-PCI and other bridges. Bridges never move with an IOMMU group.
    pub fn is_bridge(self) -> bool {
        self.base() == 0x06
    }
}

impl fmt::Display for ClassCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "0x{:06x}", self.0)
    }
}

/// True when a config-space header reads all-ones: the device is gone or its link is down.
/// Only the first 64 bytes matter; a VF legitimately reads 0xffff as its vendor/device ids, so
/// checking just the ids would misreport every VF.
pub fn config_is_all_ones(header: &[u8]) -> bool {
    let n = header.len().min(64);
    n >= 16 && header[..n].iter().all(|&b| b == 0xff)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_ones_header() {
        assert!(config_is_all_ones(&[0xff; 256]));
        let mut vf = [0xffu8; 64];
        vf[8] = 0x02; // a VF: ids read 0xffff but class/revision are real
        assert!(!config_is_all_ones(&vf));
        assert!(!config_is_all_ones(&[0xff; 4]));
    }

    #[test]
    fn parses_and_prints_addresses() {
        let a: PciAddress = "0000:3b:00.1".parse().unwrap();
        assert_eq!(a, PciAddress::new(0, 0x3b, 0, 1));
        assert_eq!(a.to_string(), "0000:3b:00.1");
        assert_eq!(a.nodedev_name(), "pci_0000_3b_00_1");
        assert_eq!(
            PciAddress::from_nodedev_name("pci_0000_3b_00_1").unwrap(),
            a
        );
        let short: PciAddress = "3b:00.1".parse().unwrap();
        assert_eq!(short, a);
        let big: PciAddress = "10000:ff:1f.7".parse().unwrap();
        assert_eq!(big.to_string(), "10000:ff:1f.7");
    }

    #[test]
    fn rejects_bad_addresses() {
        for bad in [
            "",
            "0000:3b:00",
            "0000:3b:20.0",
            "0000:3b:00.8",
            "zz:00.0",
            "0000:3b:00.0 ",
            "0000:3b::00.0",
            "0000:123:00.0",
            "pci_0000_3b_00_0",
        ] {
            assert!(bad.parse::<PciAddress>().is_err(), "{bad:?} accepted");
        }
        assert!(PciAddress::from_nodedev_name("pci_0000_3b_00").is_err());
    }

    #[test]
    fn class_code_parts() {
        let c = ClassCode(0x010802);
        assert_eq!((c.base(), c.sub(), c.prog_if()), (1, 8, 2));
        assert_eq!(c.to_string(), "0x010802");
        assert!(ClassCode(0x060400).is_bridge());
    }
}
