//! Selectors: which PCI functions a `[[select]]` or `[[protect]]` entry means (`address`, `id`,
//! `class`), their raw form and their validation, shared by both sections.

use super::bounded::Keyword;
use super::error::{ConfigError, Key, Quoted};
use super::located::Located;
use crate::model::pci::{ClassCode, PciAddress};
use serde::Deserialize;
use std::fmt;
use std::str::FromStr;
use toml::Spanned;

/// A prefix of a 24-bit class code: the base class (2 hex digits), base and subclass (4), or the
/// full code with programming interface (6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClassPrefix {
    /// The prefix itself, right-aligned: `0x12` for "0x12", `0x1200` for "0x1200".
    pub value: u32,
    /// 2, 4 or 6.
    pub digits: u8,
}

impl ClassPrefix {
    pub fn matches(&self, class: ClassCode) -> bool {
        let shift = 4 * (6 - u32::from(self.digits.min(6)));
        (class.0 & 0x00ff_ffff) >> shift == self.value
    }
}

impl FromStr for ClassPrefix {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let err = || {
            format!(
                "invalid class {}: expected \"0x\" and 2, 4 or 6 hex digits \
                 (base class, +subclass, +programming interface), e.g. \"0x12\" or \"0x0108\"",
                Quoted(s)
            )
        };
        let hex = s.strip_prefix("0x").ok_or_else(err)?;
        if !matches!(hex.len(), 2 | 4 | 6) || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(err());
        }
        let value = u32::from_str_radix(hex, 16).map_err(|_| err())?;
        Ok(ClassPrefix {
            value,
            digits: hex.len() as u8,
        })
    }
}

impl fmt::Display for ClassPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "0x{:0width$x}",
            self.value,
            width = usize::from(self.digits)
        )
    }
}

/// Which devices a `[[select]]` or `[[protect]]` entry means. Every part that is set must match;
/// a selector with no part set matches nothing (config loading never produces one), so that an
/// accidentally empty selector cannot grab every device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selector {
    pub address: Option<PciAddress>,
    /// Vendor and device id; `None` for the device means any device of that vendor.
    pub id: Option<(u16, Option<u16>)>,
    pub class: Option<ClassPrefix>,
}

impl Selector {
    pub fn matches(&self, address: PciAddress, vendor: u16, device: u16, class: ClassCode) -> bool {
        if self.is_empty() {
            return false;
        }
        let address_ok = self.address.is_none_or(|a| a == address);
        let id_ok = self
            .id
            .is_none_or(|(v, d)| v == vendor && d.is_none_or(|d| d == device));
        let class_ok = self.class.is_none_or(|c| c.matches(class));
        address_ok && id_ok && class_ok
    }

    fn is_empty(&self) -> bool {
        self.address.is_none() && self.id.is_none() && self.class.is_none()
    }

    /// Whether every function `other` matches is certainly matched by `self` too, from the
    /// selectors alone: each key `self` sets is implied by one `other` sets (the same address;
    /// the same vendor, and device if `self` names one; a class at least as long with `self`'s
    /// as its prefix). An earlier `[[select]]` that covers a later one leaves it no device, since
    /// the first match applies. Not knowing which ids sit at which address, it can miss a
    /// cover (`address=` before `id=` of the device there), never claim a wrong one.
    pub fn covers(&self, other: &Selector) -> bool {
        if self.is_empty() || other.is_empty() {
            return false;
        }
        let address = self.address.is_none_or(|a| other.address == Some(a));
        let id = match self.id {
            None => true,
            Some((vendor, None)) => other.id.is_some_and(|(v, _)| v == vendor),
            Some((vendor, Some(device))) => other.id == Some((vendor, Some(device))),
        };
        let class = self.class.is_none_or(|c| {
            other.class.is_some_and(|o| {
                o.digits >= c.digits && o.value >> (4 * u32::from(o.digits - c.digits)) == c.value
            })
        });
        address && id && class
    }
}

/// For each selector that an earlier one covers ([`Selector::covers`]), its index and the first
/// earlier one's: the `[[select]]` rules that can never apply.
pub fn shadowed(selectors: &[Selector]) -> Vec<(usize, usize)> {
    (0..selectors.len())
        .filter_map(|later| {
            (0..later)
                .find(|&earlier| selectors[earlier].covers(&selectors[later]))
                .map(|earlier| (later, earlier))
        })
        .collect()
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::with_capacity(3);
        if let Some(address) = self.address {
            parts.push(format!("address={address}"));
        }
        match self.id {
            Some((vendor, Some(device))) => parts.push(format!("id={vendor:04x}:{device:04x}")),
            Some((vendor, None)) => parts.push(format!("id={vendor:04x}:*")),
            None => {}
        }
        if let Some(class) = self.class {
            parts.push(format!("class={class}"));
        }
        if parts.is_empty() {
            f.write_str("(empty selector)")
        } else {
            f.write_str(&parts.join(" "))
        }
    }
}

/// The raw selector keys; also the whole of a `[[protect]]` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawSelector {
    pub address: Option<Spanned<Keyword>>,
    pub id: Option<Spanned<Keyword>>,
    pub class: Option<Spanned<Keyword>>,
}

/// The selector keys of the `index`th `[[array]]` entry of its file; `entry` is the entry
/// itself, where a missing selector is reported (its header).
pub(crate) fn validate<T>(
    entry: Located<'_, T>,
    array: &str,
    index: usize,
    [address, id, class]: [Option<Located<'_, Keyword>>; 3],
) -> Result<Selector, ConfigError> {
    let key = |name| Key::in_entry(array, index, name);
    let address = match address {
        Some(value) => {
            let parsed = value
                .value
                .as_str()
                .parse::<PciAddress>()
                .map_err(|e| e.to_string());
            Some(value.check(key("address"), parsed)?)
        }
        None => None,
    };
    let id = match id {
        Some(value) => Some(value.check(key("id"), parse_id(value.value.as_str()))?),
        None => None,
    };
    let class = match class {
        Some(value) => Some(value.check(key("class"), value.value.as_str().parse())?),
        None => None,
    };
    let selector = Selector { address, id, class };
    if selector.is_empty() {
        return Err(entry.error(format!(
            "{}: a selector needs at least one of `address`, `id`, `class` \
             (an entry without one would match every device)",
            Key::entry(array, index)
        )));
    }
    Ok(selector)
}

/// `VVVV:DDDD` or `VVVV:*`, 4 hex digits each, as lspci -n prints them.
pub(crate) fn parse_id(text: &str) -> Result<(u16, Option<u16>), String> {
    let err = || {
        format!(
            "invalid id {}: expected vendor:device as 4 hex digits each \
             (e.g. \"8086:4940\"); the device may be \"*\" for any device of the vendor",
            Quoted(text)
        )
    };
    let hex4 = |part: &str| {
        if part.len() == 4 && part.bytes().all(|b| b.is_ascii_hexdigit()) {
            u16::from_str_radix(part, 16).map_err(|_| err())
        } else {
            Err(err())
        }
    };
    let (vendor, device) = text.split_once(':').ok_or_else(err)?;
    let vendor = hex4(vendor)?;
    let device = if device == "*" {
        None
    } else {
        Some(hex4(device)?)
    };
    Ok((vendor, device))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) const QAT: PciAddress = PciAddress::new(0, 0x3b, 0, 0);
    pub(crate) const OTHER: PciAddress = PciAddress::new(0, 0x5e, 0, 1);

    pub(crate) fn selector(
        address: Option<&str>,
        id: Option<&str>,
        class: Option<&str>,
    ) -> Selector {
        Selector {
            address: address.map(|a| a.parse().unwrap()),
            id: id.map(|i| parse_id(i).unwrap()),
            class: class.map(|c| c.parse().unwrap()),
        }
    }

    #[test]
    fn selector_by_address() {
        let s = selector(Some("0000:3b:00.0"), None, None);
        assert!(s.matches(QAT, 0x8086, 0x4940, ClassCode(0x120000)));
        assert!(!s.matches(OTHER, 0x8086, 0x4940, ClassCode(0x120000)));
        // The short form means domain 0.
        assert_eq!(selector(Some("3b:00.0"), None, None), s);
    }

    #[test]
    fn selector_by_id_with_and_without_device_wildcard() {
        let exact = selector(None, Some("8086:4940"), None);
        assert!(exact.matches(QAT, 0x8086, 0x4940, ClassCode(0)));
        assert!(!exact.matches(QAT, 0x8086, 0x4941, ClassCode(0)));
        assert!(!exact.matches(QAT, 0x10de, 0x4940, ClassCode(0)));

        let vendor = selector(None, Some("8086:*"), None);
        assert!(vendor.matches(QAT, 0x8086, 0x4940, ClassCode(0)));
        assert!(vendor.matches(OTHER, 0x8086, 0x0001, ClassCode(0)));
        assert!(!vendor.matches(QAT, 0x10de, 0x4940, ClassCode(0)));
        // Hex digits in either case.
        assert_eq!(
            selector(None, Some("10DE:20B5"), None).id,
            Some((0x10de, Some(0x20b5)))
        );
    }

    #[test]
    fn selector_by_class_prefix_of_2_4_6_digits() {
        let nvme = ClassCode(0x010802);
        let sata = ClassCode(0x010601);
        let base = selector(None, None, Some("0x01"));
        assert!(base.matches(QAT, 0, 0, nvme) && base.matches(QAT, 0, 0, sata));
        assert!(!base.matches(QAT, 0, 0, ClassCode(0x020000)));

        let sub = selector(None, None, Some("0x0108"));
        assert!(sub.matches(QAT, 0, 0, nvme));
        assert!(!sub.matches(QAT, 0, 0, sata));
        assert!(!sub.matches(QAT, 0, 0, ClassCode(0x080100)));

        let full = selector(None, None, Some("0x010802"));
        assert!(full.matches(QAT, 0, 0, nvme));
        assert!(!full.matches(QAT, 0, 0, ClassCode(0x010803)));

        // 0x12 as a base class is not 0x0012xx: the prefix is left-aligned in the code.
        let accel = selector(None, None, Some("0x12"));
        assert!(accel.matches(QAT, 0, 0, ClassCode(0x120000)));
        assert!(!accel.matches(QAT, 0, 0, ClassCode(0x001200)));
    }

    #[test]
    fn selector_parts_must_all_match() {
        let s = selector(Some("0000:3b:00.0"), Some("8086:*"), Some("0x12"));
        assert!(s.matches(QAT, 0x8086, 0x4940, ClassCode(0x120000)));
        assert!(!s.matches(OTHER, 0x8086, 0x4940, ClassCode(0x120000)));
        assert!(!s.matches(QAT, 0x1022, 0x4940, ClassCode(0x120000)));
        assert!(!s.matches(QAT, 0x8086, 0x4940, ClassCode(0x0b4000)));
    }

    #[test]
    fn empty_selector_matches_nothing() {
        let s = Selector {
            address: None,
            id: None,
            class: None,
        };
        assert!(!s.matches(QAT, 0x8086, 0x4940, ClassCode(0x120000)));
        assert_eq!(s.to_string(), "(empty selector)");
    }

    #[test]
    fn selector_display() {
        let s = selector(Some("0000:3b:00.0"), Some("8086:*"), Some("0x12"));
        assert_eq!(s.to_string(), "address=0000:3b:00.0 id=8086:* class=0x12");
        let s = selector(None, Some("10DE:20b5"), Some("0x030000"));
        assert_eq!(s.to_string(), "id=10de:20b5 class=0x030000");
        assert_eq!(
            selector(None, None, Some("0x0108")).to_string(),
            "class=0x0108"
        );
    }

    #[test]
    fn class_prefix_parsing() {
        assert_eq!(
            "0x0108".parse(),
            Ok(ClassPrefix {
                value: 0x0108,
                digits: 4
            })
        );
        assert_eq!(
            "0x00".parse(),
            Ok(ClassPrefix {
                value: 0,
                digits: 2
            })
        );
        for bad in [
            "",
            "0x",
            "0x1",
            "0x123",
            "0x1234567",
            "12",
            "0X12",
            "0x1g",
            "0x+1",
            " 0x12",
        ] {
            assert!(bad.parse::<ClassPrefix>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn id_parsing() {
        assert_eq!(parse_id("8086:4940"), Ok((0x8086, Some(0x4940))));
        assert_eq!(parse_id("8086:*"), Ok((0x8086, None)));
        for bad in [
            "",
            "8086",
            "8086:",
            "8086:494",
            "*:4940",
            "*:*",
            "8086:49400",
            "808g:4940",
            "8086-4940",
            "+086:4940",
        ] {
            assert!(parse_id(bad).is_err(), "{bad:?} accepted");
        }
    }
}

#[cfg(test)]
mod covers_tests {
    use super::*;

    /// A selector from `--check-config`'s spelling of it (`id=8086:* class=0x02`).
    fn sel(text: &str) -> Selector {
        let mut s = Selector {
            address: None,
            id: None,
            class: None,
        };
        for part in text.split_whitespace() {
            let (k, v) = part.split_once('=').unwrap();
            match k {
                "address" => s.address = Some(v.parse().unwrap()),
                "id" => {
                    let (vendor, device) = v.split_once(':').unwrap();
                    let vendor = u16::from_str_radix(vendor, 16).unwrap();
                    let device = (device != "*").then(|| u16::from_str_radix(device, 16).unwrap());
                    s.id = Some((vendor, device));
                }
                "class" => s.class = Some(v.parse().unwrap()),
                _ => panic!("{k}"),
            }
        }
        assert_eq!(s.to_string(), text, "the spelling round-trips");
        s
    }

    #[test]
    fn an_earlier_selector_covers_a_later_one_only_when_it_certainly_matches_all_it_does() {
        let table: &[(&str, &str, bool)] = &[
            // The case: a vendor wildcard before one of its devices.
            ("id=8086:*", "id=8086:1572", true),
            ("id=8086:1572", "id=8086:*", false),
            ("id=8086:1572", "id=8086:1572", true),
            ("id=8086:1572", "id=8086:1573", false),
            ("id=8086:*", "id=10de:*", false),
            ("class=0x03", "class=0x0302", true),
            ("class=0x03", "class=0x030000", true),
            ("class=0x0302", "class=0x03", false),
            ("class=0x03", "class=0x12", false),
            ("class=0x0300", "class=0x030200", false),
            // One key covers a selector with more keys, not the reverse.
            ("id=8086:*", "id=8086:1572 class=0x02", true),
            ("id=8086:* class=0x02", "id=8086:1572", false),
            (
                "address=0000:3b:00.0",
                "address=0000:3b:00.0 id=8086:1572",
                true,
            ),
            ("address=0000:3b:00.0", "address=0000:3b:00.1", false),
            // Not known from the selectors: which device sits at an address.
            ("address=0000:3b:00.0", "id=8086:1572", false),
            ("id=8086:1572", "address=0000:3b:00.0", false),
            ("class=0x02", "id=8086:1572", false),
        ];
        for (earlier, later, covers) in table {
            assert_eq!(
                sel(earlier).covers(&sel(later)),
                *covers,
                "{earlier} before {later}"
            );
        }
    }

    #[test]
    fn shadowed_names_each_dead_rule_and_the_first_earlier_one_that_takes_its_devices() {
        let rules: Vec<Selector> = [
            "id=8086:*",
            "class=0x03",
            "id=8086:1572",
            "class=0x0302",
            "id=10de:*",
        ]
        .iter()
        .map(|t| sel(t))
        .collect();
        assert_eq!(shadowed(&rules), vec![(2, 0), (3, 1)]);
        assert!(shadowed(&rules[..2]).is_empty());
    }
}
