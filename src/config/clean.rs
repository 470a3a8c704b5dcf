//! The `[[clean]]` entries: what cleaning a device between tenants runs besides its reset.
//!
//! ```toml
//! [[clean]]
//! id = "144d:a824"              # a selector: address, id and/or class
//! command = "/usr/local/sbin/scrub-nvme {address} {group}"
//! timeout_seconds = 900         # 1 to 86400; default 600
//!
//! [[clean]]
//! address = "0000:3b:00.0"
//! reset = false                 # this device has no working reset: the command alone cleans it
//! command = "/usr/local/sbin/gpu-scrub {address}"
//! ```
//!
//! Whether a claim's end cleans at all is `[claims] clean` (`reset`, the default, or `none`); a
//! `[[clean]]` entry adds the operator's command for the devices it matches, and a device an
//! entry matches is cleaned at a claim's end even under `clean = "none"` (the operator asked
//! for it). The first entry that matches a device applies. The command is split on whitespace
//! (no shell); in each word `{address}` becomes the device's address and `{group}` its IOMMU
//! group's number. Its exit status is the verdict and its output goes into the task's result.

use super::bounded::{Int, Keyword, PathText};
use super::error::{ConfigError, Key};
use super::located::Entry;
use super::selector::{self, Selector};
use serde::Deserialize;
use toml::Spanned;

/// A command may run this long at most.
pub const MAX_TIMEOUT_SECONDS: i64 = 24 * 3600;
/// How long a command runs when its entry says nothing.
pub const DEFAULT_TIMEOUT_SECONDS: u32 = 600;

/// One `[[clean]]` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CleanRule {
    pub selector: Selector,
    /// Whether the device is reset first (false: it has no reset that works, the command
    /// cleans it alone).
    pub reset: bool,
    /// The operator's command, split into words, placeholders not yet replaced.
    pub argv: Option<Vec<String>>,
    pub timeout_seconds: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawClean {
    address: Option<Spanned<Keyword>>,
    id: Option<Spanned<Keyword>>,
    class: Option<Spanned<Keyword>>,
    reset: Option<Spanned<bool>>,
    command: Option<Spanned<PathText>>,
    timeout_seconds: Option<Spanned<Int>>,
}

/// Every `[[clean]]` entry of every file, in order (the first match applies).
pub(crate) fn validate<'a>(
    entries: impl Iterator<Item = Entry<'a, RawClean>>,
) -> Result<Vec<CleanRule>, ConfigError> {
    entries.map(rule).collect()
}

/// The words of a command, or why they cannot be run.
fn words(command: &str) -> Result<Vec<String>, String> {
    let argv: Vec<String> = command.split_whitespace().map(str::to_owned).collect();
    match argv.first() {
        None => Err("the command is empty".into()),
        Some(p) if !p.starts_with('/') => {
            Err("the command's program must be an absolute path".into())
        }
        Some(_) => Ok(argv),
    }
}

fn rule(Entry { index, item }: Entry<'_, RawClean>) -> Result<CleanRule, ConfigError> {
    let key = |name| Key::in_entry("clean", index, name);
    let selector = selector::validate(
        item,
        "clean",
        index,
        [
            item.field(|r| r.address.as_ref()),
            item.field(|r| r.id.as_ref()),
            item.field(|r| r.class.as_ref()),
        ],
    )?;
    let reset = item.field(|r| r.reset.as_ref()).is_none_or(|r| *r.value);
    let argv = match item.field(|r| r.command.as_ref()) {
        Some(c) => Some(c.check(key("command"), words(c.value.as_str()))?),
        None => None,
    };
    if !reset && argv.is_none() {
        return Err(item.error(format!(
            "{}: reset = false needs a command (else nothing would clean the device)",
            key("command")
        )));
    }
    let timeout_seconds = match item.field(|r| r.timeout_seconds.as_ref()) {
        Some(t) => t.check(
            key("timeout_seconds"),
            t.value.in_range(1, MAX_TIMEOUT_SECONDS, " seconds"),
        )? as u32,
        None => DEFAULT_TIMEOUT_SECONDS,
    };
    Ok(CleanRule {
        selector,
        reset,
        argv,
        timeout_seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::words;

    #[test]
    fn a_command_is_words_with_an_absolute_program() {
        assert_eq!(
            words(" /bin/scrub  {address}\t{group} "),
            Ok(vec![
                "/bin/scrub".into(),
                "{address}".into(),
                "{group}".into()
            ])
        );
        assert!(words("   ").unwrap_err().contains("empty"));
        assert!(words("scrub {address}").unwrap_err().contains("absolute"));
    }
}
