//! The `[host]` table: what vfiod may take from the host on purpose.
//!
//! ```toml
//! [host]
//! # The boot GPU drives the host console, and is passed to a VM anyway (a host with one GPU
//! # whose console is not needed): vfiod lets it be claimed, and libvirt take it.
//! allow_console_gpu = ["0000:17:00.0"]
//! # How often every process's open descriptors are read again for the holder index
//! # (milliseconds, 500..=600000; default 5000). A process that was already running at the last
//! # read and opens a function's node since is seen by the hook's guard and the inventory at
//! # the next one: this is that window.
//! holder_refresh_ms = 5000
//! ```

use super::bounded::{Int, Keyword};
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
    pub holder_refresh_ms: Option<Spanned<Int>>,
}

/// The default of `holder_refresh_ms`.
pub const DEFAULT_HOLDER_REFRESH_MS: u32 = 5_000;

/// Validated `[host]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostSettings {
    /// Boot VGA devices that may be taken although they drive the host's console: their
    /// console is not a host use (`host::sysfs::console`). Empty: every console GPU is the
    /// host's.
    pub allow_console_gpu: Vec<PciAddress>,
    /// How often the holder index (every process's open descriptors) is read again in the
    /// background: the window in which a running process that opens a function's node is not
    /// yet seen by the hook's guard nor the inventory (`host::sysfs::hostuse`).
    pub holder_refresh_ms: u32,
}

impl Default for HostSettings {
    fn default() -> HostSettings {
        HostSettings {
            allow_console_gpu: Vec::new(),
            holder_refresh_ms: DEFAULT_HOLDER_REFRESH_MS,
        }
    }
}

/// Every `[host]` table of every file; each key's last value wins (a list as a whole).
pub(crate) fn validate<'a>(
    tables: impl Iterator<Item = Located<'a, RawHost>> + Clone,
) -> Result<HostSettings, ConfigError> {
    let mut out = HostSettings::default();
    if let Some(ms) = last_valid(
        tables
            .clone()
            .filter_map(|t| t.field(|h| h.holder_refresh_ms.as_ref())),
        |v| {
            let ms = v.value.in_range(500, 600_000, " milliseconds");
            v.check(Key::top("host.holder_refresh_ms"), ms)
        },
    )? {
        out.holder_refresh_ms = ms as u32;
    }
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

#[cfg(test)]
mod tests {
    use crate::config::Settings;
    use std::path::Path;

    #[test]
    fn the_holder_refresh_interval_has_a_safe_default_and_a_range() {
        let parse = |text: &str| Settings::from_toml_str(text, Path::new("test.toml"));
        assert_eq!(
            Settings::default().host.holder_refresh_ms,
            super::DEFAULT_HOLDER_REFRESH_MS
        );
        let s = parse("[host]\nholder_refresh_ms = 1000\n").unwrap();
        assert_eq!(s.host.holder_refresh_ms, 1000);
        for bad in ["0", "499", "600001", "-5"] {
            let e = parse(&format!("[host]\nholder_refresh_ms = {bad}\n")).unwrap_err();
            let e = crate::error_chain(&e);
            assert!(
                e.contains("`host.holder_refresh_ms`") && e.contains("500..=600000"),
                "{bad}: {e}"
            );
        }
    }
}
