//! The `[images]` table: how vfiod downloads FPGA images from a URL (`Images.AddFromUrl`, and
//! the program task's download step for an image whose local copy is gone).
//!
//! ```toml
//! [images]
//! allow_http = false              # plain http only to loopback hosts (https everywhere)
//! ca_file = "/etc/vfiod/images-ca.pem"  # extra trusted CAs (PEM), on top of the system's
//! connect_timeout_seconds = 30    # to open the connection (TCP and TLS)
//! read_timeout_seconds = 60       # a server that sends nothing this long fails the download
//! timeout_seconds = 3600          # the whole download
//! ```

use super::bounded::{Int, PathText};
use super::error::{ConfigError, Key, Quoted};
use super::located::{last_valid, Located};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;
use toml::Spanned;

/// The longest download vfiod waits for: a day.
pub const MAX_DOWNLOAD_SECONDS: i64 = 86_400;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawImages {
    pub allow_http: Option<Spanned<bool>>,
    pub ca_file: Option<Spanned<PathText>>,
    pub connect_timeout_seconds: Option<Spanned<Int>>,
    pub read_timeout_seconds: Option<Spanned<Int>>,
    pub timeout_seconds: Option<Spanned<Int>>,
}

/// Validated `[images]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageSettings {
    /// Plain `http://` to any host. Off: only to loopback hosts (a mirror on this machine),
    /// because an image fetched in clear can be swapped on the way (the SHA-256 would refuse
    /// it, but the operator learns only after the download).
    pub allow_http: bool,
    /// Extra trusted CAs (PEM), for a private image server; the system's roots stay trusted.
    pub ca_file: Option<PathBuf>,
    pub connect_timeout: Duration,
    /// Between two reads of the body: a stalled server fails the download this soon.
    pub read_timeout: Duration,
    /// The whole download.
    pub timeout: Duration,
}

impl Default for ImageSettings {
    fn default() -> ImageSettings {
        ImageSettings {
            allow_http: false,
            ca_file: None,
            connect_timeout: Duration::from_secs(30),
            read_timeout: Duration::from_secs(60),
            timeout: Duration::from_secs(3600),
        }
    }
}

/// Every `[images]` table of every file; each key's last value wins.
pub(crate) fn validate<'a>(
    tables: impl Iterator<Item = Located<'a, RawImages>> + Clone,
) -> Result<ImageSettings, ConfigError> {
    let mut out = ImageSettings::default();
    if let Some(b) = last_valid(
        tables
            .clone()
            .filter_map(|t| t.field(|h| h.allow_http.as_ref())),
        |v| Ok(*v.value),
    )? {
        out.allow_http = b;
    }
    if let Some(p) = last_valid(
        tables
            .clone()
            .filter_map(|t| t.field(|h| h.ca_file.as_ref())),
        |v| {
            let path = Path::new(v.value.as_str());
            let r = if path.is_absolute() {
                Ok(path.to_path_buf())
            } else {
                Err(format!(
                    "{} is not an absolute path",
                    Quoted(v.value.as_str())
                ))
            };
            v.check(Key::top("images.ca_file"), r)
        },
    )? {
        out.ca_file = Some(p);
    }
    let seconds = |get: fn(&RawImages) -> Option<&Spanned<Int>>, key: &'static str| {
        last_valid(tables.clone().filter_map(move |t| t.field(get)), move |v| {
            let s = v.value.in_range(1, MAX_DOWNLOAD_SECONDS, " seconds");
            v.check(Key::top(key), s)
        })
        .map(|s| s.map(|s| Duration::from_secs(s as u64)))
    };
    if let Some(d) = seconds(
        |h| h.connect_timeout_seconds.as_ref(),
        "images.connect_timeout_seconds",
    )? {
        out.connect_timeout = d;
    }
    if let Some(d) = seconds(
        |h| h.read_timeout_seconds.as_ref(),
        "images.read_timeout_seconds",
    )? {
        out.read_timeout = d;
    }
    if let Some(d) = seconds(|h| h.timeout_seconds.as_ref(), "images.timeout_seconds")? {
        out.timeout = d;
    }
    Ok(out)
}
