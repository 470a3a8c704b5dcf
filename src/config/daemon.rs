//! The daemon's own keys, at the top level of a file: `scenario`, `poll_interval`, `state_dir`,
//! `sysfs_root`, `libvirt_uri`.
//!
//! Unlike a section, these have no raw struct of their own: they are fields of
//! [`RawFile`](super::raw::RawFile) itself (serde does not deny unknown keys through a
//! flattened struct). So this module reads them from [`Inputs`] and sits above `merge`, where
//! the sections sit below `raw`.

use super::bounded::PathText;
use super::error::{ConfigError, Key, Quoted};
use super::located::{last_valid, Located};
use super::merge::Inputs;
use serde::Serialize;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

/// The local system QEMU driver, where libvirt keeps the domains of a host like this one.
pub const DEFAULT_LIBVIRT_URI: &str = "qemu:///system";
/// Default seconds between safety-net rescans (uevents drive normal operation).
const DEFAULT_POLL_SECS: u64 = 30;
/// Longest accepted rescan interval: one day. A longer one would leave missed events unnoticed
/// for so long that it is more likely a unit mistake (milliseconds?) than an intent.
const MAX_POLL_SECS: i64 = 86_400;

/// The deployment scenario, which decides the default mode of a separable (SR-IOV) device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scenario {
    /// Shared hosts: separable devices are split into VFs so several VMs can each get a slice.
    Public,
    /// Dedicated hosts: devices stay whole (PF mode) and go to one VM each.
    Private,
}

impl Scenario {
    pub fn as_str(self) -> &'static str {
        match self {
            Scenario::Public => "public",
            Scenario::Private => "private",
        }
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Scenario {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "public" => Ok(Scenario::Public),
            "private" => Ok(Scenario::Private),
            other => Err(format!(
                "invalid scenario {}: expected \"public\" or \"private\"",
                Quoted(other)
            )),
        }
    }
}

/// The daemon's settings after every file: the last value each key was given, or its default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Daemon {
    pub scenario: Scenario,
    pub poll_interval: Duration,
    pub state_dir: PathBuf,
    pub sysfs_root: PathBuf,
    pub libvirt_uri: Option<String>,
    pub host_name: String,
}

impl Default for Daemon {
    /// A host without any configuration: private scenario, the system libvirt.
    fn default() -> Self {
        Daemon {
            scenario: Scenario::Private,
            poll_interval: Duration::from_secs(DEFAULT_POLL_SECS),
            state_dir: PathBuf::from("/var/lib/vfiod"),
            sysfs_root: PathBuf::from("/"),
            libvirt_uri: Some(DEFAULT_LIBVIRT_URI.to_string()),
            host_name: machine_host_name(),
        }
    }
}

/// Every top-level key checked, even after one is wrong, so that `--check-config` names each.
pub(crate) fn validate(inputs: &Inputs) -> Result<Daemon, Vec<ConfigError>> {
    let mut daemon = Daemon::default();
    let mut errors = Vec::new();
    let scenario = inputs.values(|f| f.scenario.as_ref());
    if let Some(value) = kept(
        &mut errors,
        last_valid(scenario, |v| {
            v.check(Key::top("scenario"), v.value.as_str().parse())
        }),
    ) {
        daemon.scenario = value;
    }
    let poll = inputs.values(|f| f.poll_interval.as_ref());
    if let Some(secs) = kept(
        &mut errors,
        last_valid(poll, |v| {
            let secs = v.value.in_range(1, MAX_POLL_SECS, " seconds");
            v.check(Key::top("poll_interval"), secs)
        }),
    ) {
        daemon.poll_interval = Duration::from_secs(secs as u64);
    }
    let state_dir = inputs.values(|f| f.state_dir.as_ref());
    if let Some(path) = kept(
        &mut errors,
        last_valid(state_dir, |v| absolute_path(v, "state_dir")),
    ) {
        daemon.state_dir = path;
    }
    let sysfs_root = inputs.values(|f| f.sysfs_root.as_ref());
    if let Some(path) = kept(
        &mut errors,
        last_valid(sysfs_root, |v| absolute_path(v, "sysfs_root")),
    ) {
        daemon.sysfs_root = path;
    }
    let uri = inputs.values(|f| f.libvirt_uri.as_ref());
    if let Some(uri) = kept(
        &mut errors,
        last_valid(uri, |v| {
            v.check(Key::top("libvirt_uri"), libvirt_uri(v.value.as_str()))
        }),
    ) {
        daemon.libvirt_uri = (!uri.is_empty()).then_some(uri);
    }
    let host = inputs.values(|f| f.host_name.as_ref());
    if let Some(name) = kept(
        &mut errors,
        last_valid(host, |v| {
            v.check(Key::top("host_name"), host_name(v.value.as_str()))
        }),
    ) {
        daemon.host_name = name;
    }
    if errors.is_empty() {
        Ok(daemon)
    } else {
        Err(errors)
    }
}

/// A key's value in force, or `None` with its error added to `errors`.
fn kept<T>(errors: &mut Vec<ConfigError>, found: Result<Option<T>, ConfigError>) -> Option<T> {
    found.unwrap_or_else(|e| {
        errors.push(e);
        None
    })
}

/// The machine's host name, what a pool knows this host as unless `host_name` says otherwise.
/// "localhost" when it cannot be read (a pool then refuses to move sessions between two such
/// hosts, which is what an operator must fix anyway).
pub fn machine_host_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .and_then(|h| host_name(&h).ok())
        .unwrap_or_else(|| "localhost".to_string())
}

/// A host name as pools see it: letters, digits, '-', '_', '.', ':' (no spaces, not empty).
fn host_name(name: &str) -> Result<String, String> {
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
    {
        return Err(format!(
            "{} is not a host name (letters, digits, '-', '_', '.', ':')",
            Quoted(name)
        ));
    }
    Ok(name.to_string())
}

fn absolute_path(value: Located<'_, PathText>, key: &str) -> Result<PathBuf, ConfigError> {
    let path = Path::new(value.value.as_str());
    let result = if path.is_absolute() {
        Ok(path.to_path_buf())
    } else {
        Err(format!(
            "{} is not an absolute path",
            Quoted(value.value.as_str())
        ))
    };
    value.check(Key::top(key), result)
}

/// "" (no libvirt check) or a libvirt URI: `driver[+transport]://[host]/path[?query]`.
fn libvirt_uri(uri: &str) -> Result<String, String> {
    if uri.is_empty() {
        return Ok(String::new());
    }
    let scheme_ok = uri.split_once("://").is_some_and(|(scheme, _)| {
        !scheme.is_empty()
            && scheme
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'-')
    });
    if !scheme_ok || uri.chars().any(char::is_whitespace) {
        return Err(format!(
            "invalid libvirt_uri {}: expected a libvirt URI such as \"qemu:///system\", \
             or \"\" to skip the libvirt check",
            Quoted(uri)
        ));
    }
    Ok(uri.to_string())
}
