//! Bounded raw values, the building blocks of every section's raw struct: strings with a
//! byte bound ([`Text`], named per use: [`Keyword`], [`DriverText`], [`PathText`]) and integers
//! that remember they overflowed ([`Int`]).
//!
//! A bound is enforced while serde parses, so no later stage (nor any error message) ever holds
//! a value of unbounded length, and the error points at the value.

use super::error::QUOTE_CHARS;
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use std::fmt;

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
                    .nth(QUOTE_CHARS)
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
