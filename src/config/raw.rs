//! Stage 2: one file parsed into its raw form, a [`Fragment`].
//!
//! Serde reads the text into `Raw*` mirror structs whose fields keep their byte span
//! ([`Spanned`]) and which reject unknown keys, so that a typo is an error rather than a
//! silently ignored setting. Nothing is judged here beyond the shape (types, known keys) and
//! the size of each value: every string is a bounded `Text` (see `bounded`), so no later stage
//! (nor any error message) ever holds a value of unbounded length.
//!
//! The file's own keys are the fields of [`RawFile`]: the daemon's keys at the top level, and
//! one field per section whose raw struct lives in the section's module, next to its
//! validator. So this module depends on the sections, never the other way round.

use super::bounded::{Int, Keyword, PathText};
use super::claim::RawClaims;
use super::clean::RawClean;
use super::error::{bound_message, ConfigError, Key};
use super::fleet::RawFleet;
use super::fpga::RawFpga;
use super::history::RawHistory;
use super::hook::RawHooks;
use super::host::RawHost;
use super::image::RawImages;
use super::metrics::RawMetrics;
use super::pool::RawPool;
use super::position::{key_path_at, line_column, Segment, Source};
use super::select::RawRule;
use super::selector::RawSelector;
use serde::Deserialize;
use std::path::PathBuf;
use toml::Spanned;

/// The raw mirror of one file. Field names are the TOML keys.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawFile {
    // The daemon's own keys sit at the top level (validated by `daemon`). Not a flattened
    // struct: serde ignores deny_unknown_fields with flatten.
    pub scenario: Option<Spanned<Keyword>>,
    pub poll_interval: Option<Spanned<Int>>,
    pub state_dir: Option<Spanned<PathText>>,
    pub sysfs_root: Option<Spanned<PathText>>,
    pub libvirt_uri: Option<Spanned<PathText>>,
    pub host_name: Option<Spanned<Keyword>>,
    // One field per section.
    #[serde(default)]
    pub select: Vec<Spanned<RawRule>>,
    #[serde(default)]
    pub protect: Vec<Spanned<RawSelector>>,
    pub claims: Option<Spanned<RawClaims>>,
    pub hooks: Option<Spanned<RawHooks>>,
    pub host: Option<Spanned<RawHost>>,
    pub images: Option<Spanned<RawImages>>,
    #[serde(default)]
    pub fpga: Vec<Spanned<RawFpga>>,
    #[serde(default)]
    pub clean: Vec<Spanned<RawClean>>,
    #[serde(default)]
    pub pool: Vec<Spanned<RawPool>>,
    pub fleet: Option<Spanned<RawFleet>>,
    pub metrics: Option<Spanned<RawMetrics>>,
    pub history: Option<Spanned<RawHistory>>,
}

/// One file: where it came from and its text (for positions in errors), and what it says.
#[derive(Debug)]
pub(crate) struct Fragment {
    pub source: Source,
    pub raw: RawFile,
}

impl Fragment {
    /// The first error only (tests of one stage).
    #[cfg(test)]
    pub fn parse_text(text: String, origin: PathBuf) -> Result<Fragment, ConfigError> {
        Fragment::parse_text_all(text, origin).map_err(first)
    }

    /// One file: every syntax error of it (the parser recovers and goes on, at most
    /// [`MAX_ERRORS_PER_FILE`] of them). A shape error (unknown key, wrong type) is only the
    /// first: serde stops there, and the file's syntax errors come first anyway.
    pub fn parse_all(bytes: Vec<u8>, origin: PathBuf) -> Result<Fragment, Vec<ConfigError>> {
        let text = String::from_utf8(bytes).map_err(|e| {
            let (line, column) = line_column(e.as_bytes(), e.utf8_error().valid_up_to());
            vec![ConfigError::Invalid {
                file: origin.clone(),
                line,
                column,
                message: "file is not valid UTF-8".to_string(),
            }]
        })?;
        Fragment::parse_text_all(text, origin)
    }

    pub fn parse_text_all(text: String, origin: PathBuf) -> Result<Fragment, Vec<ConfigError>> {
        let source = Source::new(origin, text);
        let (table, mut errors) = toml::de::DeTable::parse_recoverable(&source.text);
        if !errors.is_empty() {
            // The parser reports some errors when it closes what they broke: in reading order.
            errors.sort_by_key(|e| e.span().map_or(0, |s| s.start));
            let mut out: Vec<ConfigError> = errors
                .iter()
                .take(MAX_ERRORS_PER_FILE)
                .map(|e| syntax_error(&source, e))
                .collect();
            if errors.len() > MAX_ERRORS_PER_FILE {
                out.push(ConfigError::Invalid {
                    file: source.file.clone(),
                    line: 1,
                    column: 1,
                    message: format!(
                        "{} more syntax errors in this file not shown",
                        errors.len() - MAX_ERRORS_PER_FILE
                    ),
                });
            }
            return Err(out);
        }
        let raw = RawFile::deserialize(toml::de::Deserializer::from(table))
            .map_err(|e| vec![shape_error(&source, &e)])?;
        Ok(Fragment { source, raw })
    }
}

/// Syntax errors told per file: a parser that recovers from a broken line can meet many more
/// after it, and past a screenful they only repeat the first.
pub(crate) const MAX_ERRORS_PER_FILE: usize = 20;

/// The first of a non-empty list of errors (a stage that collects them all, asked for one).
pub(crate) fn first(errors: Vec<ConfigError>) -> ConfigError {
    errors
        .into_iter()
        .next()
        .expect("a failed stage reports at least one error")
}

fn syntax_error(source: &Source, e: &toml::de::Error) -> ConfigError {
    let span = e.span().unwrap_or(0..0);
    let mut message = format!("invalid TOML: {}", e.message());
    // The parser's "duplicate key" does not say which; its span covers the key.
    if let Some(text) = source.text.get(span.clone()).filter(|t| !t.is_empty()) {
        if e.message() == "duplicate key" {
            message = format!("invalid TOML: duplicate key `{}`", text.trim());
        }
    }
    source.error_at(span.start, bound_message(&message))
}

/// An unknown key or a value of the wrong type, found by serde. Serde's message does not say
/// which key it is about, so find the key whose span the error points into.
fn shape_error(source: &Source, e: &toml::de::Error) -> ConfigError {
    let span = e.span().unwrap_or(0..0);
    let path = key_path_at(&source.text, &span);
    let (entry, inner) = match path.as_slice() {
        [Segment::Key(array), Segment::Index(index), inner @ ..] => {
            (Some((array.as_str(), *index)), inner)
        }
        whole => (None, whole),
    };
    let name = inner
        .iter()
        .rev()
        .find_map(|segment| match segment {
            Segment::Key(name) => Some(name.as_str()),
            Segment::Index(_) => None,
        })
        // "unknown field `x`, expected one of ..." names the key itself.
        .filter(|_| !e.message().starts_with("unknown field"));
    let mut message = match (entry, name) {
        (None, None) => e.message().to_string(),
        _ => format!("{}: {}", Key { entry, name }, e.message()),
    };
    if let [Segment::Key(array)] = path.as_slice() {
        // Any array of tables (a section's entries), so a new section gets the hint too.
        if e.message()
            .starts_with("invalid type: map, expected a sequence")
        {
            message.push_str(&format!(
                " (entries are written [[{array}]], not [{array}])"
            ));
        }
    }
    // The key names and the message may quote the file's text at any length.
    source.error_at(span.start, bound_message(&message))
}

#[cfg(test)]
mod tests {
    use super::super::bounded::MAX_DRIVER_BYTES;
    use super::*;

    #[test]
    fn integers_beyond_64_bits_are_kept_as_too_large() {
        let parse = |value: &str| {
            let text = format!("poll_interval = {value}\n");
            Fragment::parse_text(text, "t.toml".into())
                .unwrap()
                .raw
                .poll_interval
                .unwrap()
                .into_inner()
        };
        assert_eq!(parse("86400"), Int(Some(86400)));
        assert_eq!(parse("-9223372036854775808"), Int(Some(i64::MIN)));
        // Beyond i64, beyond u64, beyond i128/u128 (the parser's own overflow).
        for value in [
            "9223372036854775808",
            "99999999999999999999",
            "-99999999999999999999",
            "340282366920938463463374607431768211456",
            &"9".repeat(100),
        ] {
            assert_eq!(parse(value), Int(None), "{value}");
        }
        assert_eq!(
            Int(None).in_range(1, 86_400, " seconds").unwrap_err(),
            "the number is too large (beyond 64 bits): expected 1..=86400 seconds"
        );
    }

    #[test]
    fn a_string_over_its_bound_is_refused_where_it_is_written() {
        let text = format!(
            "[[select]]\nid = \"8086:*\"\nvf_driver = \"{}\"\n",
            "a".repeat(MAX_DRIVER_BYTES + 1)
        );
        let err = Fragment::parse_text(text, "t.toml".into())
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!(
                "t.toml:3:13: `vf_driver` in [[select]] #1: 56 bytes is too long, at most 55 \
                 allowed: \"{}\"",
                "a".repeat(56)
            )
        );
        let at_bound = format!("vf_driver = \"{}\"", "a".repeat(MAX_DRIVER_BYTES));
        let text = format!("[[select]]\nid = \"8086:*\"\n{at_bound}\n");
        assert!(Fragment::parse_text(text, "t.toml".into()).is_ok());
    }
}
