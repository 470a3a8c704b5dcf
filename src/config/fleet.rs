//! The `[fleet]` table: whether and how this host reports to the fleet's accelerator database
//! (PostgreSQL). Off when the table is absent: nothing changes for a host without it.
//!
//! ```toml
//! [fleet]
//! credentials_file = "/etc/vfiod/fleet.conn"  # libpq connection string; mode 0600 or 0400
//! host = "rack4-node17"   # this host's name in the fleet (default: /etc/machine-id, else hostname)
//! report_interval = 30    # seconds between heartbeats (default: poll_interval)
//! down_after = 3          # a host silent for this many of its intervals is marked down
//! ca_file = "/etc/vfiod/fleet-ca.pem"  # CA certificates for TLS, beside the system's
//! ```
//!
//! The connection string (with its password) is never written in the configuration or on a
//! command line: it is read from `credentials_file`, whose permissions are checked when it is
//! read (see `crate::fleet::credentials`).

use super::bounded::{Int, Keyword, PathText};
use super::error::{ConfigError, Key, Quoted};
use super::located::{last_valid, Located};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;
use toml::Spanned;

/// The longest report interval: an hour. A host silent longer is not a fleet member.
pub const MAX_REPORT_INTERVAL_SECS: i64 = 3600;
/// How many intervals of silence may mark a host down, at most.
pub const MAX_DOWN_AFTER: i64 = 100;
/// The default number of intervals of silence before a host is marked down.
pub const DEFAULT_DOWN_AFTER: u32 = 3;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawFleet {
    pub credentials_file: Option<Spanned<PathText>>,
    pub host: Option<Spanned<Keyword>>,
    pub report_interval: Option<Spanned<Int>>,
    pub down_after: Option<Spanned<Int>>,
    pub ca_file: Option<Spanned<PathText>>,
}

/// Validated `[fleet]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetSettings {
    /// Absolute path of the file holding the libpq connection string.
    pub credentials_file: PathBuf,
    /// This host's name in the fleet; `None`: the machine id (see `crate::fleet::host_name`).
    pub host: Option<String>,
    /// Heartbeat interval; `None`: the poll interval.
    pub report_interval: Option<Duration>,
    /// Intervals of silence after which the host is marked down.
    pub down_after: u32,
    /// CA certificates (PEM) the database's TLS certificate may chain to, beside the system's.
    pub ca_file: Option<PathBuf>,
}

/// Every `[fleet]` table of every file; each key's last value wins. `None` when no file has
/// one (the fleet is off).
pub(crate) fn validate<'a>(
    tables: impl Iterator<Item = Located<'a, RawFleet>> + Clone,
) -> Result<Option<FleetSettings>, ConfigError> {
    let Some(first) = tables.clone().next() else {
        return Ok(None);
    };
    let files = tables
        .clone()
        .filter_map(|t| t.field(|f| f.credentials_file.as_ref()));
    let credentials_file = last_valid(files, |v| {
        v.check(
            Key::top("fleet.credentials_file"),
            absolute(v.value.as_str()),
        )
    })?
    .ok_or_else(|| {
        first.error(
            "`[fleet]` needs `credentials_file` (the file holding the database connection \
             string; credentials are never written in the configuration)"
                .to_string(),
        )
    })?;
    let hosts = tables.clone().filter_map(|t| t.field(|f| f.host.as_ref()));
    let host = last_valid(hosts, |v| {
        v.check(Key::top("fleet.host"), check_host_name(v.value.as_str()))
    })?;
    let intervals = tables
        .clone()
        .filter_map(|t| t.field(|f| f.report_interval.as_ref()));
    let report_interval = last_valid(intervals, |v| {
        let secs = v.value.in_range(1, MAX_REPORT_INTERVAL_SECS, " seconds");
        v.check(Key::top("fleet.report_interval"), secs)
    })?
    .map(|s| Duration::from_secs(s as u64));
    let downs = tables
        .clone()
        .filter_map(|t| t.field(|f| f.down_after.as_ref()));
    let down_after = last_valid(downs, |v| {
        let n = v.value.in_range(2, MAX_DOWN_AFTER, " intervals");
        v.check(Key::top("fleet.down_after"), n)
    })?
    .map_or(DEFAULT_DOWN_AFTER, |n| n as u32);
    let cas = tables
        .clone()
        .filter_map(|t| t.field(|f| f.ca_file.as_ref()));
    let ca_file = last_valid(cas, |v| {
        v.check(Key::top("fleet.ca_file"), absolute(v.value.as_str()))
    })?;
    // A vfiod built without the fleet cannot report: saying so beats a host that is silently
    // missing from the fleet's database.
    if !cfg!(feature = "fleet") {
        return Err(first.error(
            "`[fleet]` is configured, but this vfiod was built without the fleet (cargo \
             feature `fleet`, on by default)"
                .to_string(),
        ));
    }
    Ok(Some(FleetSettings {
        credentials_file,
        host,
        report_interval,
        down_after,
        ca_file,
    }))
}

fn absolute(text: &str) -> Result<PathBuf, String> {
    let path = Path::new(text);
    if path.is_absolute() {
        Ok(path.to_path_buf())
    } else {
        Err(format!("{} is not an absolute path", Quoted(text)))
    }
}

/// A host name in the fleet: 1 to 64 of `[A-Za-z0-9._-]`, starting with a letter or digit
/// (a machine id, a DNS label or a short FQDN all fit; it is a key and shows in tables).
pub fn check_host_name(name: &str) -> Result<String, String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(name.to_string())
    } else {
        Err(format!(
            "{} is not a fleet host name (1 to 64 of A-Z a-z 0-9 . _ -, starting with a letter \
             or digit)",
            Quoted(name)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    fn parse(text: &str) -> Result<Settings, String> {
        Settings::from_toml_str(text, Path::new("t.toml")).map_err(|e| e.to_string())
    }

    #[test]
    fn off_without_the_table_and_read_with_it() {
        assert_eq!(parse("").unwrap().fleet, None);
        let minimal = "[fleet]\ncredentials_file = \"/etc/vfiod/fleet.conn\"\n";
        if !cfg!(feature = "fleet") {
            let e = parse(minimal).unwrap_err();
            assert!(
                e.contains("t.toml:1:1: `[fleet]` is configured, but this vfiod was built without"),
                "{e}"
            );
            return;
        }
        let s = parse(minimal).unwrap();
        assert_eq!(
            s.fleet,
            Some(FleetSettings {
                credentials_file: "/etc/vfiod/fleet.conn".into(),
                host: None,
                report_interval: None,
                down_after: DEFAULT_DOWN_AFTER,
                ca_file: None,
            })
        );
        let s = parse(
            "[fleet]\ncredentials_file = \"/c\"\nhost = \"node-1.rack4\"\nreport_interval = 5\n\
             down_after = 4\nca_file = \"/etc/ssl/fleet-ca.pem\"\n",
        )
        .unwrap()
        .fleet
        .unwrap();
        assert_eq!(s.host.as_deref(), Some("node-1.rack4"));
        assert_eq!(s.report_interval, Some(Duration::from_secs(5)));
        assert_eq!(s.down_after, 4);
        assert_eq!(s.ca_file, Some("/etc/ssl/fleet-ca.pem".into()));
    }

    /// Refused with the reason, with or without the fleet built in.
    #[test]
    fn a_bad_table_is_refused_with_the_reason() {
        for (text, wanted) in [
            (
                "[fleet]\nhost = \"a\"\n",
                "t.toml:1:1: `[fleet]` needs `credentials_file`",
            ),
            (
                "[fleet]\ncredentials_file = \"fleet.conn\"\n",
                "not an absolute path",
            ),
            (
                "[fleet]\ncredentials_file = \"/c\"\nhost = \"-x\"\n",
                "not a fleet host name",
            ),
            (
                "[fleet]\ncredentials_file = \"/c\"\nhost = \"a b\"\n",
                "not a fleet host name",
            ),
            (
                "[fleet]\ncredentials_file = \"/c\"\nreport_interval = 0\n",
                "out of range",
            ),
            (
                "[fleet]\ncredentials_file = \"/c\"\ndown_after = 1\n",
                "out of range",
            ),
            (
                "[fleet]\ncredentials_file = \"/c\"\ndatabase_url = \"postgres://u:p@h/db\"\n",
                "unknown field `database_url`",
            ),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(wanted), "{text}: {e}");
        }
    }
}
