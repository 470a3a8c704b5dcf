//! The `[claims]` table: how claims behave.
//!
//! ```toml
//! [claims]
//! default_lease_seconds = 600   # an unattached claim is released after this; 0 = no lease
//! detach_timeout = 30            # seconds a detach waits for the guest to let go
//! clean = "reset"                # at a claim's end: reset and health-check ("none": hand back as is)
//! reset_timeout = 75             # seconds a reset may take before it is abandoned as hung
//! ```

use super::bounded::{Int, Keyword};
use super::error::{ConfigError, Key};
use super::located::{last_valid, Located};
use serde::Deserialize;
use toml::Spanned;

/// The longest lease: a year. A longer one is a unit mistake, not a lease.
pub const MAX_LEASE_SECONDS: u32 = 366 * 24 * 3600;

/// How long a detach waits for the guest by default: a guest's PCI hot-unplug usually takes
/// about a second (pciehp waits 5 s for an attention button that may cancel it).
pub const DEFAULT_DETACH_TIMEOUT_SECONDS: u32 = 30;
/// The longest wait for a guest: a caller waits on the D-Bus call that long.
pub const MAX_DETACH_TIMEOUT_SECONDS: u32 = 600;

/// How long a reset may take by default: the kernel itself waits up to 60 s for a function to
/// answer again after a function-level reset (`PCIE_RESET_READY_POLL_MS`), so a reset that has
/// not returned after that and a margin is hung.
pub const DEFAULT_RESET_TIMEOUT_SECONDS: u32 = 75;
/// The longest a reset may be given.
pub const MAX_RESET_TIMEOUT_SECONDS: u32 = 600;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawClaims {
    pub default_lease_seconds: Option<Spanned<Int>>,
    pub detach_timeout: Option<Spanned<Int>>,
    pub clean: Option<Spanned<Keyword>>,
    pub reset_timeout: Option<Spanned<Int>>,
}

/// What the end of a claim does to its functions before they return to the pool.
///
/// `Reset` is the default, and safe: the functions were just given up by their VM, so nothing
/// uses them; the reset is the one the kernel offers for that function (what vfio-pci itself
/// does when a VM opens or closes a device), bounded by a timeout; and the health check after it
/// keeps a device that the reset broke out of the pool instead of handing it to the next tenant.
/// A device that cannot be reset is quarantined for an operator rather than handed on dirty.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CleanMode {
    /// Reset each function and check its health; quarantine it when that fails.
    #[default]
    Reset,
    /// Hand the functions back as they are (only `[[clean]]` entries still clean theirs).
    None,
}

/// Validated `[claims]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimSettings {
    /// The lease of a claim whose request gives none; 0 = no lease.
    pub default_lease_seconds: u32,
    /// How long a detach waits for libvirt's device-removed event, in seconds.
    pub detach_timeout_seconds: u32,
    /// What a claim's end does to its functions.
    pub clean: CleanMode,
    /// How long one reset may take before it is abandoned as hung, in seconds.
    pub reset_timeout_seconds: u32,
}

impl Default for ClaimSettings {
    fn default() -> ClaimSettings {
        ClaimSettings {
            default_lease_seconds: 0,
            detach_timeout_seconds: DEFAULT_DETACH_TIMEOUT_SECONDS,
            clean: CleanMode::Reset,
            reset_timeout_seconds: DEFAULT_RESET_TIMEOUT_SECONDS,
        }
    }
}

/// Every `[claims]` table of every file; each key's last value wins.
pub(crate) fn validate<'a>(
    tables: impl Iterator<Item = Located<'a, RawClaims>> + Clone,
) -> Result<ClaimSettings, ConfigError> {
    let mut out = ClaimSettings::default();
    let leases = tables
        .clone()
        .filter_map(|t| t.field(|c| c.default_lease_seconds.as_ref()));
    if let Some(secs) = last_valid(leases, |v| {
        let secs = v
            .value
            .in_range(0, i64::from(MAX_LEASE_SECONDS), " seconds (0: no lease)");
        v.check(Key::top("claims.default_lease_seconds"), secs)
    })? {
        out.default_lease_seconds = secs as u32;
    }
    let cleans = tables.clone().filter_map(|t| t.field(|c| c.clean.as_ref()));
    if let Some(mode) = last_valid(cleans, |v| {
        let mode = match v.value.as_str() {
            "reset" => Ok(CleanMode::Reset),
            "none" => Ok(CleanMode::None),
            other => Err(format!("unknown value {other:?} (reset, none)")),
        };
        v.check(Key::top("claims.clean"), mode)
    })? {
        out.clean = mode;
    }
    let resets = tables
        .clone()
        .filter_map(|t| t.field(|c| c.reset_timeout.as_ref()));
    if let Some(secs) = last_valid(resets, |v| {
        let secs = v
            .value
            .in_range(1, i64::from(MAX_RESET_TIMEOUT_SECONDS), " seconds");
        v.check(Key::top("claims.reset_timeout"), secs)
    })? {
        out.reset_timeout_seconds = secs as u32;
    }
    let timeouts = tables.filter_map(|t| t.field(|c| c.detach_timeout.as_ref()));
    if let Some(secs) = last_valid(timeouts, |v| {
        let secs = v
            .value
            .in_range(1, i64::from(MAX_DETACH_TIMEOUT_SECONDS), " seconds");
        v.check(Key::top("claims.detach_timeout"), secs)
    })? {
        out.detach_timeout_seconds = secs as u32;
    }
    Ok(out)
}
