//! Stage 2: one file parsed into its raw form, a [`Fragment`].
//!
//! Serde reads the text into `Raw*` mirror structs whose fields keep their byte span
//! ([`Spanned`]) and which reject unknown keys, so that a typo is an error rather than a
//! silently ignored setting. Nothing is judged here beyond the shape (types, known keys) and
//! the size of each value: every string is a [`Text`] with a bound, so no later stage (nor any
//! error message) ever holds a value of unbounded length.
//!
//! The file's own keys are the fields of [`RawFile`]; a section's raw struct lives in the
//! section's module, next to its validator.

use super::error::{bound_message, ConfigError, Key};
use super::position::{key_path_at, line_column, Origin, Segment};
use super::select::RawRule;
use super::selector::RawSelector;
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use std::fmt;
use std::path::PathBuf;
use toml::Spanned;

/// Longest keyword or selector value (`scenario`, `kind`, `mode`, `address`, `id`, `class`);
/// every valid one is far shorter, so this only bounds what an error may quote.
pub const MAX_KEYWORD_BYTES: usize = 64;
/// A driver name is a kernel module name: `MODULE_NAME_LEN` is 64 - sizeof(long) = 56 bytes
/// with the terminating NUL.
pub const MAX_DRIVER_BYTES: usize = 55;
/// Paths and URIs: `PATH_MAX` (4096) without the terminating NUL.
pub const MAX_PATH_BYTES: usize = 4095;

pub(crate) type Keyword = Text<MAX_KEYWORD_BYTES>;
pub(crate) type DriverText = Text<MAX_DRIVER_BYTES>;
pub(crate) type PathText = Text<MAX_PATH_BYTES>;

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
    // One field per section.
    #[serde(default)]
    pub select: Vec<Spanned<RawRule>>,
    #[serde(default)]
    pub protect: Vec<Spanned<RawSelector>>,
}

/// One file: its name, its text (for positions in errors) and what it says.
#[derive(Debug)]
pub(crate) struct Fragment {
    pub origin: PathBuf,
    pub text: String,
    pub raw: RawFile,
}

impl Fragment {
    pub fn parse(bytes: Vec<u8>, origin: PathBuf) -> Result<Fragment, ConfigError> {
        let text = String::from_utf8(bytes).map_err(|e| {
            let (line, column) = line_column(e.as_bytes(), e.utf8_error().valid_up_to());
            ConfigError::Invalid {
                file: origin.clone(),
                line,
                column,
                message: "file is not valid UTF-8".to_string(),
            }
        })?;
        Fragment::parse_text(text, origin)
    }

    pub fn parse_text(text: String, origin: PathBuf) -> Result<Fragment, ConfigError> {
        let mut fragment = Fragment {
            origin,
            text,
            raw: RawFile::default(),
        };
        let table =
            toml::de::DeTable::parse(&fragment.text).map_err(|e| fragment.syntax_error(&e))?;
        fragment.raw = RawFile::deserialize(toml::de::Deserializer::from(table))
            .map_err(|e| fragment.shape_error(&e))?;
        Ok(fragment)
    }

    pub fn origin_at(&self, offset: usize) -> Origin {
        let (line, column) = line_column(self.text.as_bytes(), offset);
        Origin {
            file: self.origin.clone(),
            line,
            column,
        }
    }

    pub fn error_at(&self, offset: usize, message: String) -> ConfigError {
        let Origin { file, line, column } = self.origin_at(offset);
        ConfigError::Invalid {
            file,
            line,
            column,
            message,
        }
    }

    fn syntax_error(&self, e: &toml::de::Error) -> ConfigError {
        let span = e.span().unwrap_or(0..0);
        let mut message = format!("invalid TOML: {}", e.message());
        // The parser's "duplicate key" does not say which; its span covers the key.
        if let Some(text) = self.text.get(span.clone()).filter(|t| !t.is_empty()) {
            if e.message() == "duplicate key" {
                message = format!("invalid TOML: duplicate key `{}`", text.trim());
            }
        }
        self.error_at(span.start, bound_message(&message))
    }

    /// An unknown key or a value of the wrong type, found by serde. Serde's message does not say
    /// which key it is about, so find the key whose span the error points into.
    fn shape_error(&self, e: &toml::de::Error) -> ConfigError {
        let span = e.span().unwrap_or(0..0);
        let path = key_path_at(&self.text, &span);
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
            if (array == "select" || array == "protect")
                && e.message().starts_with("invalid type: map")
            {
                message.push_str(&format!(
                    " (entries are written [[{array}]], not [{array}])"
                ));
            }
        }
        // The key names and the message may quote the file's text at any length.
        self.error_at(span.start, bound_message(&message))
    }
}

/// A string of at most `MAX` bytes. Refused while parsing, before anything keeps or quotes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Text<const MAX: usize>(String);

impl<const MAX: usize> Text<MAX> {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de, const MAX: usize> Deserialize<'de> for Text<MAX> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TextVisitor<const MAX: usize>;
        impl<const MAX: usize> Visitor<'_> for TextVisitor<MAX> {
            type Value = Text<MAX>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<Text<MAX>, E> {
                if value.len() <= MAX {
                    return Ok(Text(value.to_string()));
                }
                // Quote only the start: the length says the rest.
                let cut = value
                    .char_indices()
                    .nth(super::error::QUOTE_CHARS)
                    .map_or(value.len(), |(i, _)| i);
                let more = if cut < value.len() { "…" } else { "" };
                Err(E::custom(format!(
                    "{} bytes is too long, at most {MAX} allowed: {:?}{more}",
                    value.len(),
                    &value[..cut]
                )))
            }
        }
        // Through a visitor, so that the parser attaches the value's span to the error.
        deserializer.deserialize_str(TextVisitor::<MAX>)
    }
}

/// An integer as written, or `None` when it does not fit in 64 bits. TOML integers are 64-bit;
/// the parser hands larger ones to serde as 128-bit ones (and fails beyond that), which serde
/// would report as "invalid value: integer `…` as i128, expected i64", without the key or
/// the range. Keeping the fact lets the validator say "too large" with the key's range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Int(pub Option<i64>);

/// What the TOML parser says about an integer beyond 128 bits.
const TOML_INTEGER_OVERFLOW: &str = "integer number overflowed";

impl Int {
    /// The value when within `min..=max`; otherwise why not, with the range (`unit` follows it).
    pub fn in_range(self, min: i64, max: i64, unit: &str) -> Result<i64, String> {
        match self.0 {
            Some(value) if (min..=max).contains(&value) => Ok(value),
            Some(value) => Err(format!(
                "{value} is out of range: expected {min}..={max}{unit}"
            )),
            None => Err(format!(
                "the number is too large (beyond 64 bits): expected {min}..={max}{unit}"
            )),
        }
    }
}

impl<'de> Deserialize<'de> for Int {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct IntVisitor;
        impl Visitor<'_> for IntVisitor {
            type Value = Int;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                // What serde's own i64 says, which the messages have always shown.
                f.write_str("i64")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Int, E> {
                Ok(Int(Some(v)))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Int, E> {
                Ok(Int(i64::try_from(v).ok()))
            }
            fn visit_i128<E: de::Error>(self, v: i128) -> Result<Int, E> {
                Ok(Int(i64::try_from(v).ok()))
            }
            fn visit_u128<E: de::Error>(self, v: u128) -> Result<Int, E> {
                Ok(Int(i64::try_from(v).ok()))
            }
        }
        match deserializer.deserialize_any(IntVisitor) {
            // Serde's error type offers only its text; toml's ends with a newline.
            Err(e) if e.to_string().lines().any(|l| l == TOML_INTEGER_OVERFLOW) => Ok(Int(None)),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
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
