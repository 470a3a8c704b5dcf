//! The `[metrics]` table: where vfiod writes its Prometheus metrics for node_exporter's
//! textfile collector (`vfioctl metrics` prints them whatever this says).
//!
//! ```toml
//! [metrics]
//! textfile = "/var/lib/prometheus/node-exporter/vfiod.prom"   # "" or absent: no file
//! ```

use super::bounded::PathText;
use super::error::{ConfigError, Key, Quoted};
use super::located::{last_valid, Located};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use toml::Spanned;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawMetrics {
    pub textfile: Option<Spanned<PathText>>,
}

/// Validated `[metrics]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetricsSettings {
    /// The file vfiod keeps its metrics in (replaced whole, by a rename in its directory);
    /// `None`: off, the default.
    pub textfile: Option<PathBuf>,
}

/// Every `[metrics]` table of every file; each key's last value wins (a drop-in's
/// `textfile = ""` turns off what the main file turned on).
pub(crate) fn validate<'a>(
    tables: impl Iterator<Item = Located<'a, RawMetrics>> + Clone,
) -> Result<MetricsSettings, ConfigError> {
    let textfile = last_valid(
        tables.filter_map(|t| t.field(|m| m.textfile.as_ref())),
        |v| v.check(Key::top("metrics.textfile"), textfile(v.value.as_str())),
    )?;
    Ok(MetricsSettings {
        textfile: textfile.flatten(),
    })
}

/// The textfile as written: "" is off; otherwise an absolute path to a `*.prom` file, the
/// only names node_exporter's textfile collector reads (a file named otherwise would be
/// written and never exported, which an operator learns only from an empty dashboard).
fn textfile(text: &str) -> Result<Option<PathBuf>, String> {
    if text.is_empty() {
        return Ok(None);
    }
    let path = Path::new(text);
    if !path.is_absolute() {
        return Err(format!("{} is not an absolute path", Quoted(text)));
    }
    if text.ends_with('/') {
        return Err(format!("{} names a directory, not a file", Quoted(text)));
    }
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    match name.strip_suffix(".prom") {
        Some(stem) if !stem.is_empty() && !stem.starts_with('.') => Ok(Some(path.to_path_buf())),
        _ => Err(format!(
            "{} must name a visible file ending in .prom (node_exporter's textfile collector \
             reads only those)",
            Quoted(text)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::textfile;
    use std::path::PathBuf;

    #[test]
    fn textfile_values() {
        for (text, wanted) in [
            ("", Ok(None)),
            (
                "/var/lib/prometheus/node-exporter/vfiod.prom",
                Ok(Some("/var/lib/prometheus/node-exporter/vfiod.prom")),
            ),
            ("/run/vfiod.prom", Ok(Some("/run/vfiod.prom"))),
            ("vfiod.prom", Err("is not an absolute path")),
            ("/var/lib/node-exporter/", Err("names a directory")),
            ("/var/lib/node-exporter/vfiod.txt", Err("ending in .prom")),
            ("/var/lib/node-exporter/.prom", Err("ending in .prom")),
            ("/var/lib/node-exporter/.vfiod.prom", Err("ending in .prom")),
            ("/", Err("names a directory")),
        ] {
            match (textfile(text), wanted) {
                (Ok(got), Ok(w)) => assert_eq!(got, w.map(PathBuf::from), "{text:?}"),
                (Err(e), Err(w)) => assert!(e.contains(w), "{text:?}: {e}"),
                (got, w) => panic!("{text:?}: got {got:?}, wanted {w:?}"),
            }
        }
    }
}
