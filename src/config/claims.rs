//! The `[claims]` table: how claims behave.
//!
//! ```toml
//! [claims]
//! default_lease_seconds = 600   # an unattached claim is released after this; 0 = no lease
//! ```

use super::bounded::Int;
use super::error::{ConfigError, Key};
use super::located::{last_valid, Located};
use serde::Deserialize;
use toml::Spanned;

/// The longest lease: a year. A longer one is a unit mistake, not a lease.
pub const MAX_LEASE_SECONDS: u32 = 366 * 24 * 3600;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawClaims {
    pub default_lease_seconds: Option<Spanned<Int>>,
}

/// Validated `[claims]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimSettings {
    /// The lease of a claim whose request gives none; 0 = no lease.
    pub default_lease_seconds: u32,
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
    Ok(out)
}
