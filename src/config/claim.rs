//! The `[claims]` table: how claims behave.
//!
//! ```toml
//! [claims]
//! default_lease_seconds = 600   # an unattached claim is released after this; 0 = no lease
//! detach_timeout = 30            # seconds a detach waits for the guest to let go
//! ```

use super::bounded::Int;
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

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawClaims {
    pub default_lease_seconds: Option<Spanned<Int>>,
    pub detach_timeout: Option<Spanned<Int>>,
}

/// Validated `[claims]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimSettings {
    /// The lease of a claim whose request gives none; 0 = no lease.
    pub default_lease_seconds: u32,
    /// How long a detach waits for libvirt's device-removed event, in seconds.
    pub detach_timeout_seconds: u32,
}

impl Default for ClaimSettings {
    fn default() -> ClaimSettings {
        ClaimSettings {
            default_lease_seconds: 0,
            detach_timeout_seconds: DEFAULT_DETACH_TIMEOUT_SECONDS,
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
