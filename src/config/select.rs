//! The `[[select]]` section: which devices vfiod manages and how ([`DeviceRule`]), its raw
//! form and its validation.

use super::bounded::{DriverText, Int, Keyword};
use super::error::{ConfigError, Key, Quoted};
use super::located::{Entry, Located};
use super::position::Origin;
use super::selector::{self, Selector};
use crate::model::device::{Kind, Mode};
use serde::Deserialize;
use toml::Spanned;

/// The SR-IOV capability's TotalVFs register is 16 bits wide: no device can have more VFs.
const MAX_NUM_VFS: i64 = u16::MAX as i64;

/// One `[[select]]` entry: which devices vfiod manages and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceRule {
    pub selector: Selector,
    /// Overrides the kind derived from the class code.
    pub kind: Option<Kind>,
    /// Overrides the scenario's default mode; only `Mode::Pf` or `Mode::Vf`.
    pub mode: Option<Mode>,
    /// VFs to create when split; at least 1, and never set together with `mode = "pf"`.
    pub num_vfs: Option<u32>,
    /// Driver for the VFs (vfio-pci when unset).
    pub vf_driver: Option<String>,
    /// Driver for the PF in PF mode.
    pub pf_driver: Option<String>,
}

/// Where a `[[select]]` entry and its driver names were written, for messages about them
/// after loading (e.g. a driver no module provides). Kept beside [`DeviceRule`] rather than in
/// it, so that rules compare by what they say, not by where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleOrigin {
    /// The entry's `[[select]]` header.
    pub entry: Origin,
    pub vf_driver: Option<Origin>,
    pub pf_driver: Option<Origin>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRule {
    // Not `#[serde(flatten)]` of RawSelector: serde ignores deny_unknown_fields with flatten.
    address: Option<Spanned<Keyword>>,
    id: Option<Spanned<Keyword>>,
    class: Option<Spanned<Keyword>>,
    kind: Option<Spanned<Keyword>>,
    mode: Option<Spanned<Keyword>>,
    num_vfs: Option<Spanned<Int>>,
    vf_driver: Option<Spanned<DriverText>>,
    pf_driver: Option<Spanned<DriverText>>,
}

/// Every `[[select]]` entry of every file, in order (the first match applies).
pub(crate) fn validate<'a>(
    entries: impl Iterator<Item = Entry<'a, RawRule>>,
) -> Result<Vec<(DeviceRule, RuleOrigin)>, ConfigError> {
    entries.map(rule).collect()
}

fn rule(
    Entry { index, item }: Entry<'_, RawRule>,
) -> Result<(DeviceRule, RuleOrigin), ConfigError> {
    let key = |name| Key::in_entry("select", index, name);
    let selector = selector::validate(
        item,
        "select",
        index,
        [
            item.field(|r| r.address.as_ref()),
            item.field(|r| r.id.as_ref()),
            item.field(|r| r.class.as_ref()),
        ],
    )?;
    let kind = match item.field(|r| r.kind.as_ref()) {
        Some(value) => Some(value.check(key("kind"), value.value.as_str().parse::<Kind>())?),
        None => None,
    };
    let mode = match item.field(|r| r.mode.as_ref()) {
        Some(value) => Some(value.check(key("mode"), config_mode(value.value.as_str()))?),
        None => None,
    };
    let num_vfs = match item.field(|r| r.num_vfs.as_ref()) {
        Some(value) => {
            let count = value.check(key("num_vfs"), value.value.in_range(1, MAX_NUM_VFS, ""))?;
            if mode == Some(Mode::Pf) {
                return Err(value.error(format!(
                    "{}: num_vfs = {count} conflicts with mode = \"pf\" \
                     (only valid with mode = \"vf\" or no mode)",
                    key("num_vfs")
                )));
            }
            Some(count as u32)
        }
        None => None,
    };
    let vf_driver = item.field(|r| r.vf_driver.as_ref());
    let pf_driver = item.field(|r| r.pf_driver.as_ref());
    let driver = |value: Option<Located<'_, DriverText>>, name| match value {
        Some(value) => value
            .check(key(name), driver_name(value.value.as_str()))
            .map(Some),
        None => Ok(None),
    };
    let rule = DeviceRule {
        selector,
        kind,
        mode,
        num_vfs,
        vf_driver: driver(vf_driver, "vf_driver")?,
        pf_driver: driver(pf_driver, "pf_driver")?,
    };
    let origin = RuleOrigin {
        entry: item.origin(),
        vf_driver: vf_driver.map(|v| v.origin()),
        pf_driver: pf_driver.map(|v| v.origin()),
    };
    Ok((rule, origin))
}

/// Only the two modes a device can be put in; `none` is what a VF reports, not a choice.
fn config_mode(text: &str) -> Result<Mode, String> {
    match text {
        "pf" => Ok(Mode::Pf),
        "vf" => Ok(Mode::Vf),
        other => Err(format!(
            "invalid mode {}: expected \"pf\" or \"vf\"",
            Quoted(other)
        )),
    }
}

/// A driver name ends up as a path component under /sys/bus/pci/drivers and is written to
/// `driver_override`; it is the name of a kernel module's driver, so it is made of what module
/// names are made of (its length is bounded when parsed, see `raw::MAX_DRIVER_BYTES`).
fn driver_name(name: &str) -> Result<String, String> {
    let ok = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(name.to_string())
    } else {
        Err(format!(
            "invalid driver name {}: expected a non-empty name without '/' or whitespace, \
             made of letters, digits, '_' and '-' as kernel module names are",
            Quoted(name)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_names_are_module_names() {
        for good in ["vfio-pci", "qat_4xxx", "mlx5_core", "i915", "nvme"] {
            assert_eq!(driver_name(good).as_deref(), Ok(good));
        }
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "a/b",
            "vfio pci",
            "vfio\tpci",
            "é",
            "a.b",
            "a:b",
        ] {
            assert!(driver_name(bad).is_err(), "{bad:?} accepted");
        }
    }
}
