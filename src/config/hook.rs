//! The `[hooks]` table: how vfiod answers libvirt's qemu hook.
//!
//! ```toml
//! [hooks]
//! auto_claim = true        # a managed hostdev written in a domain's XML is claimed at prepare
//! deadline_ms = 10000      # how long prepare and migrate may take before the hook fails closed
//! notify_deadline_ms = 2000  # how long a notification (started, stopped, ...) waits for vfiod
//! guard_host_devices = true  # refuse a domain that assigns a function the host uses (false: dangerous)
//! ```

use super::bounded::Int;
use super::error::{ConfigError, Key};
use super::located::{last_valid, Located};
use serde::Deserialize;
use toml::Spanned;

/// libvirt waits for a hook with no timeout of its own: a hook must never take long.
pub const MAX_DEADLINE_MS: u32 = 60_000;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawHooks {
    pub auto_claim: Option<Spanned<bool>>,
    pub deadline_ms: Option<Spanned<Int>>,
    pub notify_deadline_ms: Option<Spanned<Int>>,
    pub guard_host_devices: Option<Spanned<bool>>,
}

/// Validated `[hooks]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HookSettings {
    /// A managed function written directly in a domain's XML is claimed for it at `prepare`
    /// (otherwise the domain must hold a claim on it already).
    pub auto_claim: bool,
    /// The bound of `prepare`, `migrate` and `restore`, which may fail the domain's start.
    pub deadline_ms: u32,
    /// The bound of the notifications, which never fail.
    pub notify_deadline_ms: u32,
    /// A domain whose XML assigns a PCI function the host uses (selected or not) does not
    /// start, nor arrive by migration. Off, libvirt may take the host's own NIC or boot disk
    /// controller from it: dangerous, for a host whose operator checks every domain by hand.
    pub guard_host_devices: bool,
}

impl Default for HookSettings {
    fn default() -> HookSettings {
        HookSettings {
            auto_claim: true,
            deadline_ms: 10_000,
            notify_deadline_ms: 2_000,
            guard_host_devices: true,
        }
    }
}

/// Every `[hooks]` table of every file; each key's last value wins.
pub(crate) fn validate<'a>(
    tables: impl Iterator<Item = Located<'a, RawHooks>> + Clone,
) -> Result<HookSettings, ConfigError> {
    let mut out = HookSettings::default();
    if let Some(b) = last_valid(
        tables
            .clone()
            .filter_map(|t| t.field(|h| h.auto_claim.as_ref())),
        |v| Ok(*v.value),
    )? {
        out.auto_claim = b;
    }
    if let Some(b) = last_valid(
        tables
            .clone()
            .filter_map(|t| t.field(|h| h.guard_host_devices.as_ref())),
        |v| Ok(*v.value),
    )? {
        out.guard_host_devices = b;
    }
    if let Some(ms) = deadline(
        tables
            .clone()
            .filter_map(|t| t.field(|h| h.deadline_ms.as_ref())),
        "hooks.deadline_ms",
    )? {
        out.deadline_ms = ms;
    }
    if let Some(ms) = deadline(
        tables.filter_map(|t| t.field(|h| h.notify_deadline_ms.as_ref())),
        "hooks.notify_deadline_ms",
    )? {
        out.notify_deadline_ms = ms;
    }
    Ok(out)
}

fn deadline<'a>(
    values: impl Iterator<Item = Located<'a, Int>>,
    key: &'static str,
) -> Result<Option<u32>, ConfigError> {
    last_valid(values, |v| {
        let ms = v
            .value
            .in_range(100, i64::from(MAX_DEADLINE_MS), " milliseconds");
        v.check(Key::top(key), ms)
    })
    .map(|ms| ms.map(|ms| ms as u32))
}
