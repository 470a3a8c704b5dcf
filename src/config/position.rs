//! Where in a file a byte offset is: its line and column, and the key it belongs to. Used to
//! turn the parser's byte spans into `file:line:column: <key>: ...` messages.

use super::error::ConfigError;
use std::fmt;
use std::ops::Range;
use std::path::PathBuf;

/// Where a value was written: `file:line:column`, 1-based, the column in characters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    pub file: PathBuf,
    pub line: usize,
    pub column: usize,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.file.display(), self.line, self.column)
    }
}

/// One file as read: its name and its text, which turn a byte offset into an [`Origin`].
#[derive(Debug)]
pub(crate) struct Source {
    pub file: PathBuf,
    pub text: String,
    /// Byte offset of the start of each line, found once: every rule records where it was
    /// written, and counting newlines from the top for each made a large file quadratic.
    line_starts: std::sync::OnceLock<Vec<usize>>,
}

impl Source {
    pub fn new(file: PathBuf, text: String) -> Source {
        Source {
            file,
            text,
            line_starts: std::sync::OnceLock::new(),
        }
    }

    pub fn origin_at(&self, offset: usize) -> Origin {
        let bytes = self.text.as_bytes();
        let offset = offset.min(bytes.len());
        let starts = self.line_starts.get_or_init(|| {
            std::iter::once(0)
                .chain(
                    bytes
                        .iter()
                        .enumerate()
                        .filter(|(_, &b)| b == b'\n')
                        .map(|(i, _)| i + 1),
                )
                .collect()
        });
        // The last line start at or before the offset.
        let index = starts.partition_point(|&start| start <= offset) - 1;
        let line = index + 1;
        // Count characters, not bytes: UTF-8 continuation bytes (0b10xx_xxxx) do not start one.
        let column = bytes[starts[index]..offset]
            .iter()
            .filter(|&&b| b & 0xc0 != 0x80)
            .count()
            + 1;
        Origin {
            file: self.file.clone(),
            line,
            column,
        }
    }

    /// An error at `offset`: `file:line:column: message`.
    pub fn error_at(&self, offset: usize, message: String) -> ConfigError {
        let Origin { file, line, column } = self.origin_at(offset);
        ConfigError::Invalid {
            file,
            line,
            column,
            message,
        }
    }
}

/// 1-based line and character column of a byte offset.
pub(crate) fn line_column(bytes: &[u8], offset: usize) -> (usize, usize) {
    let before = &bytes[..offset.min(bytes.len())];
    let line_start = before
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |i| i + 1);
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    // Count characters, not bytes: UTF-8 continuation bytes (0b10xx_xxxx) do not start one.
    let column = before[line_start..]
        .iter()
        .filter(|&&b| b & 0xc0 != 0x80)
        .count()
        + 1;
    (line, column)
}

#[derive(Clone, Debug)]
pub(crate) enum Segment {
    Key(String),
    Index(usize),
}

/// The deepest key whose key or value span overlaps `span`, as a path from the document root.
/// Used only on the error path, so it re-parses the (syntactically valid) text.
pub(crate) fn key_path_at(text: &str, span: &Range<usize>) -> Vec<Segment> {
    let mut best = Vec::new();
    if let Ok(table) = toml::de::DeTable::parse(text) {
        walk_table(table.get_ref(), span, &mut Vec::new(), &mut best);
    }
    best
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    if b.is_empty() {
        a.start <= b.start && b.start <= a.end
    } else {
        a.start < b.end && b.start < a.end
    }
}

fn walk_table(
    table: &toml::de::DeTable<'_>,
    span: &Range<usize>,
    path: &mut Vec<Segment>,
    best: &mut Vec<Segment>,
) {
    for (key, value) in table {
        path.push(Segment::Key(key.get_ref().to_string()));
        if overlaps(&key.span(), span) || overlaps(&value.span(), span) {
            remember(path, best);
        }
        walk_value(value.get_ref(), span, path, best);
        path.pop();
    }
}

fn walk_value(
    value: &toml::de::DeValue<'_>,
    span: &Range<usize>,
    path: &mut Vec<Segment>,
    best: &mut Vec<Segment>,
) {
    match value {
        toml::de::DeValue::Table(table) => walk_table(table, span, path, best),
        toml::de::DeValue::Array(items) => {
            for (index, item) in items.iter().enumerate() {
                path.push(Segment::Index(index));
                if overlaps(&item.span(), span) {
                    remember(path, best);
                }
                walk_value(item.get_ref(), span, path, best);
                path.pop();
            }
        }
        _ => {}
    }
}

fn remember(path: &[Segment], best: &mut Vec<Segment>) {
    // Deeper wins: a leaf value is more precise than the table holding it.
    if path.len() >= best.len() {
        *best = path.to_vec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_count_characters_not_bytes() {
        assert_eq!(line_column("ab\ncdé".as_bytes(), 0), (1, 1));
        assert_eq!(line_column("ab\ncdé".as_bytes(), 3), (2, 1));
        assert_eq!(line_column("ab\n# é = x".as_bytes(), 8), (2, 5));
        assert_eq!(line_column(b"ab", 99), (1, 3));
    }

    #[test]
    fn the_deepest_key_at_a_span_is_found() {
        let text = "a = 1\n[[s]]\nx = 2\n[[s]]\ny = 3\n";
        let path = key_path_at(text, &(text.find("3").unwrap()..text.len() - 1));
        let names: Vec<String> = path
            .iter()
            .map(|s| match s {
                Segment::Key(k) => k.clone(),
                Segment::Index(i) => i.to_string(),
            })
            .collect();
        assert_eq!(names, ["s", "1", "y"]);
    }
}

#[cfg(test)]
mod origin_tests {
    use super::*;

    #[test]
    fn origin_at_agrees_with_counting_from_the_top() {
        let text = "a = 1\n\nb = \"\u{e9}t\u{e9}\"\n  [[select]]\nx\n";
        let source = Source::new(PathBuf::from("f.toml"), text.to_string());
        for offset in 0..=text.len() + 3 {
            let o = source.origin_at(offset);
            assert_eq!(
                (o.line, o.column),
                line_column(text.as_bytes(), offset),
                "offset {offset}"
            );
        }
    }
}
