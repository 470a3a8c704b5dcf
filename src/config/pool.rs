//! The `[[pool]]` section: the remote device pools vfiod leases pooled accelerators from, and
//! how a pooled session is carried through a live migration.
//!
//! ```toml
//! [[pool]]
//! name = "gpus"                              # how claims, metadata and vfioctl name the pool
//! url = "https://pool.example:8443"          # http:// only on a loopback host (tests, demo)
//! ca_file = "/etc/vfiod/pool-ca.pem"         # the pool's CA (else the system roots)
//! cert_file = "/etc/vfiod/pool-client.pem"   # this host's client certificate, with
//! key_file = "/etc/vfiod/pool-client.key"    #   its key (both or neither)
//! connect_timeout_ms = 2000
//! request_timeout_ms = 5000
//! quiesce_at = "switchover"                  # or "begin": quiesce at the destination's migrate begin
//! ```
//!
//! Names are unique over every file. Files are checked to be absolute paths here, and read when
//! the pool is first called (a missing file is that call's error, with the pool's name).

use super::bounded::{Int, Keyword, PathText};
use super::error::{ConfigError, Key};
use super::located::Entry;
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;
use toml::Spanned;

/// A pool call may wait this long at most: the `migrate begin` hook waits for prepare-move, and
/// libvirt waits for the hook.
pub const MAX_POOL_TIMEOUT_MS: i64 = 60_000;

/// When the session's work stops during a live migration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuiesceAt {
    /// When the source pauses the VM for the final phase (libvirt's suspended-for-migration
    /// event): the work pauses about as long as the VM itself.
    Switchover,
    /// At the destination's `migrate begin` hook, for pools whose drain is slow: the work
    /// pauses for the whole migration.
    Begin,
}

impl QuiesceAt {
    pub fn as_str(self) -> &'static str {
        match self {
            QuiesceAt::Switchover => "switchover",
            QuiesceAt::Begin => "begin",
        }
    }
}

/// One validated `[[pool]]` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolSettings {
    pub name: String,
    /// `http://` (loopback hosts only) or `https://`, without a trailing slash.
    pub url: String,
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    pub quiesce_at: QuiesceAt,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPool {
    name: Option<Spanned<Keyword>>,
    url: Option<Spanned<PathText>>,
    ca_file: Option<Spanned<PathText>>,
    cert_file: Option<Spanned<PathText>>,
    key_file: Option<Spanned<PathText>>,
    connect_timeout_ms: Option<Spanned<Int>>,
    request_timeout_ms: Option<Spanned<Int>>,
    quiesce_at: Option<Spanned<Keyword>>,
}

/// Every `[[pool]]` entry of every file, in order; a name given twice is refused at its second
/// entry.
pub(crate) fn validate<'a>(
    entries: impl Iterator<Item = Entry<'a, RawPool>>,
) -> Result<Vec<PoolSettings>, ConfigError> {
    let mut out: Vec<PoolSettings> = Vec::new();
    for entry in entries {
        let index = entry.index;
        let name_at = entry.item.field(|r| r.name.as_ref());
        let pool = pool(entry)?;
        if out.iter().any(|p| p.name == pool.name) {
            let at = name_at.expect("a validated pool has a name");
            return Err(at.error(format!(
                "{}: a pool named {:?} is already configured",
                Key::in_entry("pool", index, "name"),
                pool.name
            )));
        }
        out.push(pool);
    }
    Ok(out)
}

fn pool(Entry { index, item }: Entry<'_, RawPool>) -> Result<PoolSettings, ConfigError> {
    let key = |name| Key::in_entry("pool", index, name);
    let Some(name) = item.field(|r| r.name.as_ref()) else {
        return Err(item.error(format!("{}: a pool needs a name", key("name"))));
    };
    let name = name.check(key("name"), pool_name(name.value.as_str()))?;
    let Some(url) = item.field(|r| r.url.as_ref()) else {
        return Err(item.error(format!("{}: pool {name:?} needs a url", key("url"))));
    };
    let url = url.check(key("url"), pool_url(url.value.as_str()))?;
    let file = |field: Option<super::located::Located<'_, PathText>>, k| {
        field
            .map(|f| {
                let p = std::path::Path::new(f.value.as_str());
                f.check(
                    key(k),
                    if p.is_absolute() {
                        Ok(p.to_path_buf())
                    } else {
                        Err(format!("{:?} is not an absolute path", f.value.as_str()))
                    },
                )
            })
            .transpose()
    };
    let ca_file = file(item.field(|r| r.ca_file.as_ref()), "ca_file")?;
    let cert_at = item.field(|r| r.cert_file.as_ref());
    let key_at = item.field(|r| r.key_file.as_ref());
    let cert_file = file(cert_at, "cert_file")?;
    let key_file = file(key_at, "key_file")?;
    match (&cert_file, &key_file) {
        (Some(_), None) => {
            return Err(item.error(format!(
                "{}: a client certificate needs its key_file",
                key("cert_file")
            )))
        }
        (None, Some(_)) => {
            return Err(item.error(format!(
                "{}: a key_file needs its cert_file",
                key("key_file")
            )))
        }
        _ => {}
    }
    if url.starts_with("http://") && (ca_file.is_some() || cert_file.is_some()) {
        return Err(item.error(format!("{}: TLS files are for an https:// url", key("url"))));
    }
    let timeout = |field: Option<super::located::Located<'_, Int>>, k, default| {
        field
            .map(|t| {
                t.check(
                    key(k),
                    t.value.in_range(100, MAX_POOL_TIMEOUT_MS, " milliseconds"),
                )
                .map(|ms| Duration::from_millis(ms as u64))
            })
            .transpose()
            .map(|d| d.unwrap_or(Duration::from_millis(default)))
    };
    let connect_timeout = timeout(
        item.field(|r| r.connect_timeout_ms.as_ref()),
        "connect_timeout_ms",
        2_000,
    )?;
    let request_timeout = timeout(
        item.field(|r| r.request_timeout_ms.as_ref()),
        "request_timeout_ms",
        5_000,
    )?;
    let quiesce_at = match item.field(|r| r.quiesce_at.as_ref()) {
        None => QuiesceAt::Switchover,
        Some(q) => q.check(
            key("quiesce_at"),
            match q.value.as_str() {
                "switchover" => Ok(QuiesceAt::Switchover),
                "begin" => Ok(QuiesceAt::Begin),
                other => Err(format!(
                    "unknown value {other:?} (\"switchover\", \"begin\")"
                )),
            },
        )?,
    };
    Ok(PoolSettings {
        name,
        url,
        ca_file,
        cert_file,
        key_file,
        connect_timeout,
        request_timeout,
        quiesce_at,
    })
}

/// A pool's name goes into domain metadata and command lines: letters, digits, `-`, `_`, `.`.
fn pool_name(name: &str) -> Result<String, String> {
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(format!(
            "{name:?} is not a pool name (letters, digits, '-', '_', '.')"
        ));
    }
    Ok(name.to_string())
}

/// `https://host[:port][/path]`, or `http://` to a loopback host: plain HTTP would carry the
/// session's fencing epochs in the clear between hosts.
fn pool_url(url: &str) -> Result<String, String> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| format!("{url:?} is not a URL (https://host:port)"))?;
    let authority = rest.split('/').next().unwrap_or_default();
    let host = match authority.strip_prefix('[') {
        // [::1]:8080
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    if host.is_empty() || url.chars().any(char::is_whitespace) {
        return Err(format!("{url:?} is not a URL (https://host:port)"));
    }
    match scheme {
        "https" => {}
        "http" => {
            let loopback = host == "localhost"
                || host
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback());
            if !loopback {
                return Err(format!(
                    "{url:?}: plain http:// is allowed on a loopback host only; use https://"
                ));
            }
        }
        other => return Err(format!("{url:?}: unknown scheme {other:?} (https, http)")),
    }
    Ok(url.trim_end_matches('/').to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(pool_url("https://pool:8443/").unwrap(), "https://pool:8443");
        assert!(pool_url("http://127.0.0.1:9000").is_ok());
        assert!(pool_url("http://[::1]:9000").is_ok());
        assert!(pool_url("http://localhost:9000").is_ok());
        assert!(pool_url("http://10.0.0.2:9000")
            .unwrap_err()
            .contains("loopback"));
        assert!(pool_url("ftp://x").unwrap_err().contains("scheme"));
        assert!(pool_url("pool:8443").is_err());
        assert!(pool_url("https://").is_err());
        assert!(pool_name("gpus-1").is_ok());
        assert!(pool_name("a b").is_err());
        assert!(pool_name("").is_err());
    }
}
