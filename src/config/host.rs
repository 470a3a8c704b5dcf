//! The `[host]` table: what vfiod may take from the host on purpose.
//!
//! ```toml
//! [host]
//! # The boot GPU drives the host console, and is passed to a VM anyway (a host with one GPU
//! # whose console is not needed): vfiod lets it be claimed, and libvirt take it.
//! allow_console_gpu = ["0000:17:00.0"]
//! ```

use super::bounded::Keyword;
use super::error::{ConfigError, Key};
use super::located::{last_valid, Located};
use crate::model::pci::PciAddress;
use serde::Deserialize;
use toml::Spanned;

/// The most addresses `allow_console_gpu` takes (a host has one boot VGA device).
pub const MAX_CONSOLE_GPUS: usize = 16;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawHost {
    pub allow_console_gpu: Option<Spanned<Vec<Spanned<Keyword>>>>,
}

/// Validated `[host]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostSettings {
    /// Boot VGA devices that may be taken although they drive the host's console: their
    /// console is not a host use (`host::sysfs::console`). Empty: every console GPU is the
    /// host's.
    pub allow_console_gpu: Vec<PciAddress>,
}

/// Every `[host]` table of every file; each key's last value wins (a list as a whole).
pub(crate) fn validate<'a>(
    tables: impl Iterator<Item = Located<'a, RawHost>> + Clone,
) -> Result<HostSettings, ConfigError> {
    let mut out = HostSettings::default();
    let key = Key::top("host.allow_console_gpu");
    if let Some(list) = last_valid(
        tables.filter_map(|t| t.field(|h| h.allow_console_gpu.as_ref())),
        |list| {
            if list.value.len() > MAX_CONSOLE_GPUS {
                return Err(list.error(format!(
                    "{key}: at most {MAX_CONSOLE_GPUS} addresses, not {}",
                    list.value.len()
                )));
            }
            let mut addresses = Vec::new();
            for item in list.items() {
                let parsed = item
                    .value
                    .as_str()
                    .parse::<PciAddress>()
                    .map_err(|e| e.to_string());
                let a = item.check(key, parsed)?;
                if !addresses.contains(&a) {
                    addresses.push(a);
                }
            }
            Ok(addresses)
        },
    )? {
        out.allow_console_gpu = list;
    }
    Ok(out)
}
