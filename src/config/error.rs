//! How configuration errors are told: [`ConfigError`], the names of keys in messages, and
//! quoting that never echoes a huge value back.
//!
//! Every stage reports through these, so messages look the same whichever stage found the
//! problem: `file:line:column: <key>: <reason>`.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// Why configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A file was read but its content is wrong; `line` and `column` are 1-based, the column
    /// counts characters.
    #[error("{file}:{line}:{column}: {message}")]
    Invalid {
        file: PathBuf,
        line: usize,
        column: usize,
        message: String,
    },
    /// A file or directory could not be read at all, or was refused before its content was
    /// looked at (not a regular file, too large: see [`FileRefusal`] in the source).
    #[error("{file}: {message}")]
    File {
        file: PathBuf,
        message: String,
        #[source]
        source: Option<io::Error>,
    },
}

/// Why a file was refused although the system could have read it. Carried as the source of
/// [`ConfigError::File`] (inside the `io::Error`), so the chain reads
/// "x.toml: cannot read drop-in file: is a FIFO (named pipe), not a regular file".
#[derive(Debug, thiserror::Error)]
pub enum FileRefusal {
    /// A FIFO blocks its reader until someone writes; a device or socket is not a file at all.
    #[error("is {what}, not a regular file")]
    NotRegular { what: &'static str },
    #[error("is larger than {limit} bytes")]
    TooLarge { limit: u64 },
    #[error("the configuration files together are larger than {limit} bytes")]
    TotalTooLarge { limit: u64 },
}

impl FileRefusal {
    pub(crate) fn into_io(self) -> io::Error {
        let kind = match self {
            FileRefusal::NotRegular { .. } => io::ErrorKind::InvalidInput,
            FileRefusal::TooLarge { .. } | FileRefusal::TotalTooLarge { .. } => {
                io::ErrorKind::FileTooLarge
            }
        };
        io::Error::new(kind, self)
    }
}

pub(crate) fn file_error(file: &Path, message: &str, source: io::Error) -> ConfigError {
    ConfigError::File {
        file: file.to_path_buf(),
        message: message.to_string(),
        source: Some(source),
    }
}

/// Names a key for messages: "`poll_interval`" or "`id` in \[\[select\]\] #3" (entries count from 1
/// within the file, as a reader counts headers).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Key<'a> {
    pub entry: Option<(&'a str, usize)>,
    pub name: Option<&'a str>,
}

impl<'a> Key<'a> {
    /// A top-level key.
    pub fn top(name: &'a str) -> Self {
        Key {
            entry: None,
            name: Some(name),
        }
    }

    /// A key of the `index`th (0-based) entry of `[[array]]` in its file.
    pub fn in_entry(array: &'a str, index: usize, name: &'a str) -> Self {
        Key {
            entry: Some((array, index)),
            name: Some(name),
        }
    }

    /// The entry itself (its `[[array]]` header).
    pub fn entry(array: &'a str, index: usize) -> Self {
        Key {
            entry: Some((array, index)),
            name: None,
        }
    }
}

impl fmt::Display for Key<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.name, self.entry) {
            (Some(name), Some((array, index))) => {
                write!(f, "`{name}` in [[{array}]] #{}", index + 1)
            }
            (None, Some((array, index))) => write!(f, "[[{array}]] #{}", index + 1),
            (Some(name), None) => write!(f, "`{name}`"),
            (None, None) => f.write_str("document"),
        }
    }
}

/// Characters of a value quoted in a message; a longer value is cut and its length given.
pub(crate) const QUOTE_CHARS: usize = 64;

/// A value as a message quotes it: `"vfio-pci"`, or for a long one its first
/// [`QUOTE_CHARS`] characters and its length: `"aaaa…"… (1000000 bytes)`. An error must stay a
/// line in a log, whatever the operator (or an attacker with write access to one drop-in) put
/// in the file.
pub(crate) struct Quoted<'a>(pub &'a str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self.0;
        match text.char_indices().nth(QUOTE_CHARS) {
            None => write!(f, "{text:?}"),
            Some((cut, _)) => write!(f, "{:?}… ({} bytes)", &text[..cut], text.len()),
        }
    }
}

/// Longest message taken from the TOML parser or serde, after quoted parts are shortened.
const MAX_FOREIGN_MESSAGE: usize = 320;

/// Messages from the TOML parser and serde may quote a value or key of any length
/// (`invalid type: string "…"`, ``unknown field `…` ``). Shorten every quoted part to
/// [`QUOTE_CHARS`] characters and its length; should the message still be long (a value made of
/// quotes), keep its head (what went wrong) and tail (what was expected).
pub(crate) fn bound_message(message: &str) -> String {
    let mut out = String::with_capacity(message.len().min(4 * MAX_FOREIGN_MESSAGE));
    // Inside a quoted part: its delimiter, and its text so far.
    let mut open: Option<char> = None;
    let mut quoted = String::new();
    let mut escaped = false;
    for c in message.chars() {
        match open {
            None => {
                out.push(c);
                if c == '`' || c == '"' {
                    open = Some(c);
                }
            }
            // Serde quotes strings as Rust does: `\"` inside "…" does not close it.
            Some('"') if escaped => {
                quoted.push(c);
                escaped = false;
            }
            Some('"') if c == '\\' => {
                quoted.push(c);
                escaped = true;
            }
            Some(d) if c == d => {
                push_shortened(&mut out, &quoted);
                quoted.clear();
                out.push(c);
                open = None;
            }
            Some(_) => quoted.push(c),
        }
    }
    push_shortened(&mut out, &quoted);
    let chars = out.chars().count();
    if chars <= MAX_FOREIGN_MESSAGE {
        return out;
    }
    let head_chars = QUOTE_CHARS + 32;
    let tail_chars = MAX_FOREIGN_MESSAGE - head_chars;
    let head: String = out.chars().take(head_chars).collect();
    let tail: String = out.chars().skip(chars - tail_chars).collect();
    let left_out = chars - head_chars - tail_chars;
    format!("{head}…({left_out} characters left out)…{tail}")
}

/// A quoted part, cut to [`QUOTE_CHARS`] characters and its length when longer.
fn push_shortened(out: &mut String, quoted: &str) {
    match quoted.char_indices().nth(QUOTE_CHARS) {
        Some((cut, _)) => {
            out.push_str(&quoted[..cut]);
            out.push_str(&format!("…({} characters)", quoted.chars().count()));
        }
        None => out.push_str(quoted),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_values_are_quoted_whole_and_long_ones_cut_with_their_length() {
        assert_eq!(Quoted("vfio-pci").to_string(), "\"vfio-pci\"");
        let exactly = "é".repeat(QUOTE_CHARS);
        assert_eq!(Quoted(&exactly).to_string(), format!("{exactly:?}"));
        let long = "a".repeat(1_000_000);
        let shown = Quoted(&long).to_string();
        assert_eq!(
            shown,
            format!("\"{}\"… (1000000 bytes)", "a".repeat(QUOTE_CHARS))
        );
        // Cut on a character boundary, length in bytes.
        let wide = "é".repeat(100);
        assert!(Quoted(&wide).to_string().ends_with("… (200 bytes)"));
    }

    #[test]
    fn foreign_messages_keep_head_and_tail() {
        let short = "invalid type: integer `5`, expected a string";
        assert_eq!(bound_message(short), short);
        let long = format!(
            "invalid type: string \"{}\", expected i64",
            "x".repeat(1_000_000)
        );
        assert_eq!(
            bound_message(&long),
            format!(
                "invalid type: string \"{}…(1000000 characters)\", expected i64",
                "x".repeat(QUOTE_CHARS)
            )
        );
        let key = format!("unknown field `{}`, expected `a`, `b`", "k".repeat(500));
        assert_eq!(
            bound_message(&key),
            format!(
                "unknown field `{}…(500 characters)`, expected `a`, `b`",
                "k".repeat(QUOTE_CHARS)
            )
        );
        // An escaped quote does not end a quoted string.
        let quotes = format!(
            "invalid type: string \"{}\", expected i64",
            "\\\"".repeat(100)
        );
        assert_eq!(
            bound_message(&quotes),
            format!(
                "invalid type: string \"{}…(200 characters)\", expected i64",
                "\\\"".repeat(QUOTE_CHARS / 2)
            )
        );
        // Many short quoted parts: the head and the tail are kept.
        let many = format!("expected one of {}or `z`", "`a`, ".repeat(100_000));
        let bounded = bound_message(&many);
        assert!(bounded.chars().count() < 400, "{bounded}");
        assert!(bounded.starts_with("expected one of `a`, `a`"), "{bounded}");
        assert!(bounded.ends_with("`a`, or `z`"), "{bounded}");
        assert!(bounded.contains("characters left out"), "{bounded}");
        // Text outside quotes is left alone.
        let plain = format!("invalid type: map, expected a sequence {}", "x".repeat(100));
        assert_eq!(bound_message(&plain), plain);
    }

    #[test]
    fn keys_are_named_as_a_reader_counts_entries() {
        assert_eq!(Key::top("scenario").to_string(), "`scenario`");
        assert_eq!(
            Key::in_entry("select", 2, "id").to_string(),
            "`id` in [[select]] #3"
        );
        assert_eq!(Key::entry("protect", 0).to_string(), "[[protect]] #1");
    }
}
