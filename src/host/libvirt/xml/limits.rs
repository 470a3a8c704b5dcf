//! Bounds on the work of parsing a domain XML (issue 24): roxmltree checks an element's
//! attributes for duplicates pairwise and resolves namespaces by scanning every one in scope,
//! so a few MiB of XML crafted for it (100,000 attributes on one `<hostdev>`, reachable through
//! `<metadata>`, which libvirt keeps verbatim) cost it minutes. [`parse`] first reads the XML
//! once, linearly, counting what those quadratic steps will cost, and refuses a document over
//! the bounds before roxmltree sees it; roxmltree's own node limit caps the tree's memory.
//!
//! The pre-scan is not a validator: where it cannot follow the XML (a tag cut off, a missing
//! quote) it stops and lets roxmltree give the real error, which roxmltree reaches after at
//! most the work counted so far. The bounds are far above any domain libvirt writes (a dozen
//! attributes per element, a handful of namespaces, a few thousand nodes).

use roxmltree::{Document, ParsingOptions};

/// The most attributes one element may have. libvirt's elements have at most a few dozen.
pub const MAX_ATTRIBUTES_PER_ELEMENT: u64 = 1024;
/// The most attributes in a whole document (each costs roxmltree some 50 bytes).
pub const MAX_ATTRIBUTES: u64 = 1_000_000;
/// The most nodes (elements, texts, comments, processing instructions) in a document: each
/// costs roxmltree some 60 bytes, so this keeps the tree under about 64 MB.
pub const MAX_NODES: u32 = 1_000_000;
/// The most steps of roxmltree's quadratic checks (attribute pairs, namespace look-ups and
/// copies) a document may need: some 50 ms of parsing.
pub const MAX_WORK: u64 = 1 << 25;

/// `xml` parsed by roxmltree (no DTD), after the pre-scan found it within the bounds above.
pub(super) fn parse(xml: &str) -> Result<Document<'_>, String> {
    prescan(xml.as_bytes())?;
    let options = ParsingOptions {
        nodes_limit: MAX_NODES,
        ..ParsingOptions::default()
    };
    Document::parse_with_options(xml, options).map_err(|e| match e {
        roxmltree::Error::NodesLimitReached => {
            format!("the XML has more than {MAX_NODES} nodes (elements, texts, comments): refused")
        }
        e => super::invalid_xml(e),
    })
}

/// What a start tag holds, as the pre-scan counts it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Tag {
    /// Attributes other than namespace declarations.
    attributes: u64,
    /// Of those, the ones with a prefix (each a look-up among the namespaces in scope).
    prefixed: u64,
    /// `xmlns` and `xmlns:p` declarations.
    declarations: u64,
}

/// roxmltree's steps for one start tag with `tag`, under `in_scope` namespaces declared by its
/// ancestors, with `declared` declarations in the document before it. An upper bound, from its
/// `parse.rs` (0.21): the pairwise duplicate check of the attributes and of the declarations,
/// the copy of the parent's namespaces (each checked against the new ones) when the tag
/// declares any, one look-up in its scope for the element's name and one per prefixed
/// attribute, and a sorted insert per declaration into the document's namespace list.
fn work(tag: Tag, in_scope: u64, declared: u64) -> u64 {
    let pairs = |n: u64| n * n.saturating_sub(1) / 2;
    let scope = in_scope + tag.declarations;
    let inherit = if tag.declarations > 0 {
        in_scope * (tag.declarations + 1)
    } else {
        0
    };
    pairs(tag.attributes)
        + pairs(tag.declarations)
        + inherit
        + scope * (1 + tag.prefixed)
        + tag.declarations * (declared + tag.declarations)
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// The index just past the first `end` at or after `from`.
fn past(b: &[u8], from: usize, end: &[u8]) -> Option<usize> {
    b.get(from..)?
        .windows(end.len())
        .position(|w| w == end)
        .map(|i| from + i + end.len())
}

/// A refusal naming where: the line of the tag and its name (cut, as everything quoted).
fn refuse(b: &[u8], start: usize, name: &[u8], why: String) -> String {
    let line = b[..start].iter().filter(|&&c| c == b'\n').count() + 1;
    format!(
        "the XML is too costly to parse: <{}> on line {line} {why}; refused unparsed",
        super::cut(&String::from_utf8_lossy(name))
    )
}

/// One linear pass over `b`: counts each start tag's attributes and namespace declarations
/// and the namespaces in scope, and refuses past the bounds. Stops quietly where the XML stops
/// being XML (roxmltree then says why).
fn prescan(b: &[u8]) -> Result<(), String> {
    // The declarations of each open element, and their sum.
    let mut open: Vec<u64> = Vec::new();
    let mut in_scope = 0u64;
    let mut declared = 0u64;
    let mut attributes = 0u64;
    let mut total = 0u64;
    let mut i = 0;
    while let Some(off) = b[i..].iter().position(|&c| c == b'<') {
        let start = i + off;
        let rest = &b[start + 1..];
        let next = if rest.starts_with(b"!--") {
            past(b, start + 4, b"-->")
        } else if rest.starts_with(b"![CDATA[") {
            past(b, start + 9, b"]]>")
        } else if rest.starts_with(b"?") {
            past(b, start + 2, b"?>")
        } else if rest.starts_with(b"!") {
            // A DTD: roxmltree refuses it (no `allow_dtd`).
            None
        } else if rest.starts_with(b"/") {
            if let Some(d) = open.pop() {
                in_scope -= d;
            }
            past(b, start + 2, b">")
        } else {
            let Some((tag, name, end, is_open)) = start_tag(b, start) else {
                return Ok(());
            };
            if tag.attributes > MAX_ATTRIBUTES_PER_ELEMENT {
                return Err(refuse(
                    b,
                    start,
                    name,
                    format!(
                        "has more than {MAX_ATTRIBUTES_PER_ELEMENT} attributes (libvirt's \
                         elements have a few dozen at most)"
                    ),
                ));
            }
            attributes += tag.attributes;
            if attributes > MAX_ATTRIBUTES {
                return Err(refuse(
                    b,
                    start,
                    name,
                    format!("takes the document past {MAX_ATTRIBUTES} attributes"),
                ));
            }
            total += work(tag, in_scope, declared);
            if total > MAX_WORK {
                return Err(refuse(
                    b,
                    start,
                    name,
                    format!(
                        "(with {} attributes, {} namespace declarations and {in_scope} \
                         namespaces in scope) takes the document past {MAX_WORK} steps of \
                         attribute and namespace checks",
                        tag.attributes, tag.declarations
                    ),
                ));
            }
            declared += tag.declarations;
            if is_open {
                open.push(tag.declarations);
                in_scope += tag.declarations;
            }
            Some(end)
        };
        match next {
            Some(n) => i = n,
            None => return Ok(()),
        }
    }
    Ok(())
}

/// The start tag at `b[start] == b'<'`: its counts, its name, the index past its `>`, and
/// whether it is open (not `/>`). `None` where it is not well formed.
fn start_tag(b: &[u8], start: usize) -> Option<(Tag, &[u8], usize, bool)> {
    let mut j = start + 1;
    while j < b.len() && !is_space(b[j]) && b[j] != b'>' && b[j] != b'/' {
        j += 1;
    }
    let name = &b[start + 1..j];
    let mut tag = Tag::default();
    loop {
        while j < b.len() && is_space(b[j]) {
            j += 1;
        }
        match *b.get(j)? {
            b'>' => return Some((tag, name, j + 1, true)),
            b'/' => return (b.get(j + 1) == Some(&b'>')).then_some((tag, name, j + 2, false)),
            _ => {}
        }
        let attr_start = j;
        while j < b.len() && !is_space(b[j]) && !matches!(b[j], b'=' | b'>' | b'/') {
            j += 1;
        }
        let attr = &b[attr_start..j];
        while j < b.len() && is_space(b[j]) {
            j += 1;
        }
        if b.get(j) != Some(&b'=') {
            return None;
        }
        j += 1;
        while j < b.len() && is_space(b[j]) {
            j += 1;
        }
        let quote = *b.get(j)?;
        if quote != b'\'' && quote != b'"' {
            return None;
        }
        j = past(b, j + 1, &[quote])?;
        if attr == b"xmlns" || attr.starts_with(b"xmlns:") {
            tag.declarations += 1;
        } else {
            tag.attributes += 1;
            if attr.contains(&b':') {
                tag.prefixed += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_tags_are_counted() {
        // (tag, attributes, prefixed, declarations, open)
        let cases: &[(&str, u64, u64, u64, bool)] = &[
            ("<a>", 0, 0, 0, true),
            ("<a/>", 0, 0, 0, false),
            ("<a b='1' c=\"2\">", 2, 0, 0, true),
            ("<a  b = '>' c='/>' />", 2, 0, 0, false),
            ("<p:a xmlns:p='u' xmlns='v' p:b='1' c='2'>", 2, 1, 2, true),
            ("<a\tb='1'\nc='2'\r/>", 2, 0, 0, false),
        ];
        for &(text, attributes, prefixed, declarations, open) in cases {
            let (tag, _, end, is_open) = start_tag(text.as_bytes(), 0).expect(text);
            assert_eq!(
                tag,
                Tag {
                    attributes,
                    prefixed,
                    declarations
                },
                "{text}"
            );
            assert_eq!(end, text.len(), "{text}");
            assert_eq!(is_open, open, "{text}");
        }
        for broken in ["<a b>", "<a b=1>", "<a b='1>", "<a", "<a /", "<a b='1'"] {
            assert!(start_tag(broken.as_bytes(), 0).is_none(), "{broken}");
        }
    }

    #[test]
    fn the_work_of_a_tag() {
        let t = |attributes, prefixed, declarations| Tag {
            attributes,
            prefixed,
            declarations,
        };
        // (tag, in scope, declared before, work)
        let cases = [
            (t(0, 0, 0), 0, 0, 0),
            (t(3, 0, 0), 0, 0, 3),
            (t(3, 0, 0), 2, 0, 3 + 2),
            (t(2, 2, 0), 2, 0, 1 + 2 * 3),
            // one declaration under 5: copy and check 5, look up in 6, insert after 7 others.
            (t(0, 0, 1), 5, 7, 5 * 2 + 6 + 8),
            (t(100_000, 0, 0), 0, 0, 4_999_950_000),
        ];
        for (tag, in_scope, declared, want) in cases {
            assert_eq!(work(tag, in_scope, declared), want, "{tag:?} {in_scope}");
        }
    }

    #[test]
    fn comments_cdata_and_instructions_hide_their_tags() {
        let many: String = (0..2000).map(|i| format!(" a{i}='x'")).collect();
        for wrapped in [
            format!("<d><!-- <e{many}/> --></d>"),
            format!("<d><![CDATA[ <e{many}/> ]]></d>"),
            format!("<?x <e{many}/> ?><d/>"),
            format!("<d a='<e{many}/>'/>"),
        ] {
            assert_eq!(prescan(wrapped.as_bytes()), Ok(()), "{}", &wrapped[..20]);
        }
        let bare = format!("<d>\n<e{many}/></d>");
        let e = prescan(bare.as_bytes()).unwrap_err();
        assert!(
            e.contains("<e> on line 2 has more than 1024 attributes"),
            "{e}"
        );
    }

    #[test]
    fn namespaces_in_scope_end_with_their_element() {
        // 3000 siblings each declaring a namespace: no scope grows; nested: each copies all.
        let siblings: String = (0..3000)
            .map(|i| format!("<e xmlns:p{i}='u{i}'/>"))
            .collect();
        assert_eq!(prescan(format!("<d>{siblings}</d>").as_bytes()), Ok(()));
        let nested: String = (0..9000).map(|i| format!("<e xmlns:p{i}='u'>")).collect();
        let e = prescan(nested.as_bytes()).unwrap_err();
        assert!(e.contains("namespaces in scope"), "{e}");
    }
}
