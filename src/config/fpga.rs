//! The `[[fpga]]` section: how the FPGA devices a selector matches are programmed.
//!
//! ```toml
//! [[fpga]]
//! id = "8086:0b2b"          # a selector: address, id and/or class
//! backend = "dfl"           # partial reconfiguration through the Linux DFL FME (the default)
//!
//! [[fpga]]
//! address = "0000:3b:00.0"
//! backend = "exec"          # an operator's command: a vendor tool
//! command = "/usr/bin/xbmgmt program --device {address} --base --image {image}"
//! timeout_seconds = 600
//! ```
//!
//! The first entry that matches a device applies; a device no entry matches uses `dfl`. The
//! command is split on whitespace (no shell); `{address}` and `{image}` are replaced in each
//! word by the device's address and the image file's path.

use super::bounded::{Int, Keyword, PathText};
use super::error::{ConfigError, Key};
use super::located::Entry;
use super::selector::{self, Selector};
use serde::Deserialize;
use toml::Spanned;

/// An exec backend may run this long at most.
pub const MAX_TIMEOUT_SECONDS: i64 = 24 * 3600;

/// How a device is programmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FpgaBackend {
    /// `DFL_FPGA_FME_PORT_PR` through `/dev/dfl-fme.N`, then the port's `afu_id` read back.
    Dfl,
    /// The operator's command, with its words' placeholders replaced.
    Exec {
        argv: Vec<String>,
        timeout_seconds: u32,
    },
}

impl FpgaBackend {
    pub fn name(&self) -> &'static str {
        match self {
            FpgaBackend::Dfl => "dfl",
            FpgaBackend::Exec { .. } => "exec",
        }
    }
}

/// One `[[fpga]]` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FpgaRule {
    pub selector: Selector,
    pub backend: FpgaBackend,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawFpga {
    address: Option<Spanned<Keyword>>,
    id: Option<Spanned<Keyword>>,
    class: Option<Spanned<Keyword>>,
    backend: Option<Spanned<Keyword>>,
    command: Option<Spanned<PathText>>,
    timeout_seconds: Option<Spanned<Int>>,
}

/// Every `[[fpga]]` entry of every file, in order (the first match applies).
pub(crate) fn validate<'a>(
    entries: impl Iterator<Item = Entry<'a, RawFpga>>,
) -> Result<Vec<FpgaRule>, ConfigError> {
    entries.map(rule).collect()
}

fn rule(Entry { index, item }: Entry<'_, RawFpga>) -> Result<FpgaRule, ConfigError> {
    let key = |name| Key::in_entry("fpga", index, name);
    let selector = selector::validate(
        item,
        "fpga",
        index,
        [
            item.field(|r| r.address.as_ref()),
            item.field(|r| r.id.as_ref()),
            item.field(|r| r.class.as_ref()),
        ],
    )?;
    let name = item.field(|r| r.backend.as_ref());
    let command = item.field(|r| r.command.as_ref());
    let timeout = item.field(|r| r.timeout_seconds.as_ref());
    let backend = match name.as_ref().map(|n| n.value.as_str()).unwrap_or("dfl") {
        "dfl" => {
            if let Some(c) = command {
                return Err(c.error(format!(
                    "{}: a command is for backend = \"exec\"",
                    key("command")
                )));
            }
            FpgaBackend::Dfl
        }
        "exec" => {
            let Some(c) = command else {
                return Err(item.error(format!(
                    "{}: backend = \"exec\" needs a command",
                    key("command")
                )));
            };
            let argv: Vec<String> = c
                .value
                .as_str()
                .split_whitespace()
                .map(str::to_owned)
                .collect();
            let checked = if argv.is_empty() {
                Err("the command is empty".to_string())
            } else if !argv[0].starts_with('/') {
                Err("the command's program must be an absolute path".to_string())
            } else if !argv.iter().any(|w| w.contains("{image}")) {
                Err("the command must pass the image: put {image} in it".to_string())
            } else {
                Ok(argv)
            };
            let argv = c.check(key("command"), checked)?;
            let timeout_seconds = match timeout {
                Some(t) => t.check(
                    key("timeout_seconds"),
                    t.value.in_range(1, MAX_TIMEOUT_SECONDS, " seconds"),
                )? as u32,
                None => 600,
            };
            FpgaBackend::Exec {
                argv,
                timeout_seconds,
            }
        }
        other => {
            let n = name.expect("a backend was named");
            return Err(n.error(format!(
                "{}: unknown backend {other:?} (dfl, exec)",
                key("backend")
            )));
        }
    };
    Ok(FpgaRule { selector, backend })
}
