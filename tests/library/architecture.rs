//! The module map holds: no dependency cycle between modules under `src/` (not `src/bin/`), and
//! `src/lib.rs` lists the top-level modules from the bottom of the dependency graph up. The
//! longer map, docs/architecture.md, names only files that exist, and its `unsafe` table lists
//! exactly the files with `unsafe` code. That the daemon does not use the reference pool service
//! needs no check here: the service is another crate (crates/vfiod-pool), which the `vfiod`
//! library does not depend on, so such a use does not compile.
//!
//! A module depends on another when its file names it through a `crate::` or `super::` path, in
//! a `use` or in code. For every folder module (the crate root included) the children form a
//! graph: a reference from inside child `a` to inside child `b` is an edge `a -> b`. References
//! to a module's own ancestors (a child using its parent's `mod.rs` items, `crate::error_chain`)
//! are not edges, and neither is test code (`#[cfg(test)] mod`): fixtures may use higher layers.
//! Comments (doc comments too) and string literals are blanked before matching.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

/// A module path below the crate root: `["engine", "tasks"]`; the root is empty.
type ModPath = Vec<String>;

/// One source file: its path as reported (`src/engine/task.rs`) and its text.
struct SourceFile {
    path: String,
    text: String,
}

/// A place in the source, printed as `path:line`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Location {
    path: String,
    line: usize,
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.path, self.line)
    }
}

/// `from` (a file's module) names `to` (the deepest file module on the path it wrote).
#[derive(Debug)]
struct Reference {
    from: ModPath,
    to: ModPath,
    at: Location,
}

/// The children of one folder module and the edges between them, each with where it is made.
type Graph = BTreeMap<String, BTreeMap<String, Vec<Location>>>;

/// The module a file under `src/` defines: `engine/task.rs` -> `engine::task`,
/// `engine/mod.rs` -> `engine`, `lib.rs` -> the root. `None` for binaries and non-Rust files.
fn module_of(relative: &str) -> Option<ModPath> {
    let stem = relative.strip_suffix(".rs")?;
    if stem.starts_with("bin/") || stem == "main" {
        return None;
    }
    let mut parts: ModPath = stem.split('/').map(str::to_owned).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    Some(parts)
}

/// The text with comments, string literals and char literals replaced by spaces (line breaks
/// kept, so lines still count), so that `crate::` in a doc comment or a string is not a path.
fn strip(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |out: &mut String, s: &[char]| {
        out.extend(s.iter().map(|&ch| if ch == '\n' { '\n' } else { ' ' }))
    };
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut i = 0;
    while i < c.len() {
        let rest = &c[i..];
        let start = i;
        if rest.starts_with(&['/', '/']) {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if rest.starts_with(&['/', '*']) {
            // Block comments nest in Rust.
            let mut depth = 0;
            while i < c.len() {
                if c[i..].starts_with(&['/', '*']) {
                    depth += 1;
                    i += 2;
                } else if c[i..].starts_with(&['*', '/']) {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if (c[i] == 'r' || ((c[i] == 'b' || c[i] == 'c') && rest.get(1) == Some(&'r')))
            && (i == 0 || !ident(c[i - 1]))
            && {
                let r = if c[i] == 'r' { i } else { i + 1 };
                let hashes = c[r + 1..].iter().take_while(|&&h| h == '#').count();
                c.get(r + 1 + hashes) == Some(&'"')
            }
        {
            // Raw string: r"..." or r#"..."# (b and c prefixes too), no escapes inside.
            let r = if c[i] == 'r' { i } else { i + 1 };
            let hashes = c[r + 1..].iter().take_while(|&&h| h == '#').count();
            i = r + 1 + hashes + 1;
            loop {
                if i >= c.len() {
                    break;
                }
                if c[i] == '"' && c[i + 1..].iter().take_while(|&&h| h == '#').count() >= hashes {
                    i += 1 + hashes;
                    break;
                }
                i += 1;
            }
        } else if c[i] == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c[i] == '\'' && rest.get(1) == Some(&'\\') {
            // An escaped char literal: '\n', '\'', '\u{1F600}'.
            i += 3;
            while i < c.len() && c[i] != '\'' {
                i += 1;
            }
            i += 1;
        } else if c[i] == '\'' && rest.get(2) == Some(&'\'') {
            i += 3;
        } else {
            // Code, lifetimes included.
            out.push(c[i]);
            i += 1;
            continue;
        }
        let end = i.min(c.len());
        blank(&mut out, &c[start..end]);
        i = end;
    }
    out
}

#[derive(Debug, Clone, PartialEq)]
struct Token {
    text: String,
    line: usize,
}

/// Identifiers (`r#` dropped), `::`, and single punctuation characters, with their lines.
fn tokens(stripped: &str) -> Vec<Token> {
    let c: Vec<char> = stripped.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < c.len() {
        if c[i] == '\n' {
            line += 1;
            i += 1;
        } else if c[i].is_whitespace() {
            i += 1;
        } else if c[i].is_alphanumeric() || c[i] == '_' {
            if c[i] == 'r' && c.get(i + 1) == Some(&'#') {
                i += 2;
            }
            let s = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push(Token {
                text: c[s..i].iter().collect(),
                line,
            });
        } else if c[i] == ':' && c.get(i + 1) == Some(&':') {
            out.push(Token {
                text: "::".into(),
                line,
            });
            i += 2;
        } else {
            out.push(Token {
                text: c[i].to_string(),
                line,
            });
            i += 1;
        }
    }
    out
}

fn is_ident(t: &str) -> bool {
    t.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
}

/// The paths of a path or a use tree starting at `toks[i]`: `a::b::{c, d::{e, f}}` gives
/// `a::b::c`, `a::b::d::e`, `a::b::d::f`. A path stops at anything but `::` plus a segment, so
/// `a::b::<T>`, `a::b(..)` and `a::b<T>` give `a::b`. Returns the index after the tree.
fn path_tree(toks: &[Token], mut i: usize) -> (Vec<Vec<String>>, usize) {
    let mut segs: Vec<String> = Vec::new();
    while i < toks.len() {
        let t = toks[i].text.as_str();
        if t == "{" {
            let mut paths = Vec::new();
            i += 1;
            while i < toks.len() && toks[i].text != "}" {
                let (sub, next) = path_tree(toks, i);
                i = next.max(i + 1);
                for p in sub {
                    let mut full = segs.clone();
                    full.extend(p.into_iter().filter(|s| s != "self"));
                    paths.push(full);
                }
                // Skip `as name` up to the next item of the group.
                let mut depth = 0;
                while i < toks.len() {
                    match toks[i].text.as_str() {
                        "{" => depth += 1,
                        "}" if depth == 0 => break,
                        "}" => depth -= 1,
                        "," if depth == 0 => {
                            i += 1;
                            break;
                        }
                        _ => {}
                    }
                    i += 1;
                }
            }
            return (paths, i + 1);
        } else if t == "*" {
            return (vec![segs], i + 1);
        } else if is_ident(t) {
            segs.push(t.to_owned());
            i += 1;
            let next_is_segment = toks.get(i).is_some_and(|t| t.text == "::")
                && toks.get(i + 1).is_some_and(|t| t.text != "<");
            if !next_is_segment {
                break;
            }
            i += 1;
        } else {
            break;
        }
    }
    (vec![segs], i)
}

/// Every `crate::`/`super::` path a file writes outside test modules, resolved against the
/// file's module and the inline modules around the path (`super` inside `mod tests` is the
/// file's module), as the deepest file module it names. Paths into the root's own items
/// (`crate::error_chain`) name no module and are dropped.
fn references(file: &SourceFile, module: &ModPath, modules: &BTreeSet<ModPath>) -> Vec<Reference> {
    let toks = tokens(&strip(&file.text));
    let mut out = Vec::new();
    // Inline modules we are in: (brace depth of their body, name, is test code).
    let mut inline: Vec<(usize, String, bool)> = Vec::new();
    let mut depth = 0usize;
    // Whether the attributes just before the current item include #[cfg(test)].
    let mut cfg_test = false;
    let mut i = 0;
    while i < toks.len() {
        let t = toks[i].text.as_str();
        match t {
            "#" if toks.get(i + 1).is_some_and(|t| t.text == "[") => {
                let mut j = i + 2;
                let mut level = 1;
                let mut words = Vec::new();
                while j < toks.len() && level > 0 {
                    match toks[j].text.as_str() {
                        "[" => level += 1,
                        "]" => level -= 1,
                        w => words.push(w.to_owned()),
                    }
                    j += 1;
                }
                // cfg(test), cfg(all(test, ..)); not cfg(not(test)), which is production code.
                if words.first().is_some_and(|w| w == "cfg")
                    && words.iter().any(|w| w == "test")
                    && !words.iter().any(|w| w == "not")
                {
                    cfg_test = true;
                }
                i = j;
                continue;
            }
            "{" => depth += 1,
            "}" => {
                depth = depth.saturating_sub(1);
                while inline.last().is_some_and(|(d, _, _)| *d > depth) {
                    inline.pop();
                }
            }
            "mod" if toks.get(i + 2).is_some_and(|t| t.text == "{") => {
                let in_test = cfg_test || inline.last().is_some_and(|m| m.2);
                depth += 1;
                inline.push((depth, toks[i + 1].text.clone(), in_test));
                cfg_test = false;
                i += 3;
                continue;
            }
            "crate" | "super"
                if toks.get(i + 1).is_some_and(|t| t.text == "::")
                    && !(i > 0 && toks[i - 1].text == "::") =>
            {
                let line = toks[i].line;
                let (paths, next) = path_tree(&toks, i);
                let in_test = inline.last().is_some_and(|m| m.2);
                let here: ModPath = module
                    .iter()
                    .cloned()
                    .chain(inline.iter().map(|m| m.1.clone()))
                    .collect();
                for path in paths.into_iter().filter(|_| !in_test) {
                    if let Some(to) =
                        resolve(&here, &path).and_then(|abs| deepest_module(&abs, modules))
                    {
                        out.push(Reference {
                            from: module.clone(),
                            to,
                            at: Location {
                                path: file.path.clone(),
                                line,
                            },
                        });
                    }
                }
                i = next.max(i + 1);
                continue;
            }
            "pub" | "(" | ")" | "in" | "self" | "crate" | "super" => {}
            _ => cfg_test = false,
        }
        i += 1;
    }
    out
}

/// The absolute path a `crate::...` or `super::...` path written in module `here` names.
fn resolve(here: &ModPath, path: &[String]) -> Option<ModPath> {
    match path.first().map(String::as_str) {
        Some("crate") => Some(path[1..].to_vec()),
        Some("super") => {
            let ups = path.iter().take_while(|s| *s == "super").count();
            let base = here.len().checked_sub(ups)?;
            Some(here[..base].iter().chain(&path[ups..]).cloned().collect())
        }
        _ => None,
    }
}

/// The longest prefix of `abs` that is a file module (an inline module counts as its file).
fn deepest_module(abs: &[String], modules: &BTreeSet<ModPath>) -> Option<ModPath> {
    (1..=abs.len())
        .rev()
        .map(|n| abs[..n].to_vec())
        .find(|p| modules.contains(p))
}

/// The sibling graphs: for each folder module, its children and the edges between them.
fn graphs(refs: &[Reference]) -> BTreeMap<ModPath, Graph> {
    let mut out: BTreeMap<ModPath, Graph> = BTreeMap::new();
    for r in refs {
        let common = r.from.iter().zip(&r.to).take_while(|(a, b)| a == b).count();
        // A module's own items or an ancestor's (to is a prefix of from), or a descendant of the
        // referring module: no edge between siblings.
        if common == r.to.len() || common == r.from.len() {
            continue;
        }
        let at = out
            .entry(r.from[..common].to_vec())
            .or_default()
            .entry(r.from[common].clone())
            .or_default()
            .entry(r.to[common].clone())
            .or_default();
        // A use group names several items on one line: one location is enough.
        if !at.contains(&r.at) {
            at.push(r.at.clone());
        }
    }
    out
}

/// Every elementary cycle of a graph, each starting at its smallest node, the first node
/// repeated at the end: `[a, b, a]`.
fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    fn walk(graph: &Graph, start: &str, path: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
        let last = path.last().expect("path starts with start").clone();
        for next in graph.get(&last).into_iter().flat_map(|e| e.keys()) {
            if next == start {
                let mut cycle = path.clone();
                cycle.push(start.to_owned());
                out.push(cycle);
            } else if next.as_str() > start && !path.contains(next) {
                path.push(next.clone());
                walk(graph, start, path, out);
                path.pop();
            }
        }
    }
    let mut out = Vec::new();
    for start in graph.keys() {
        walk(graph, start, &mut vec![start.clone()], &mut out);
    }
    out
}

fn display(module: &[String]) -> String {
    if module.is_empty() {
        "crate".into()
    } else {
        module.join("::")
    }
}

fn locations(at: &[Location]) -> String {
    let mut s = at
        .iter()
        .take(3)
        .map(Location::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if at.len() > 3 {
        let _ = write!(s, " and {} more", at.len() - 3);
    }
    s
}

fn all_references(files: &[SourceFile]) -> Vec<Reference> {
    let with_modules: Vec<(&SourceFile, ModPath)> = files
        .iter()
        .filter_map(|f| Some((f, module_of(f.path.strip_prefix("src/")?)?)))
        .collect();
    let modules: BTreeSet<ModPath> = with_modules.iter().map(|(_, m)| m.clone()).collect();
    with_modules
        .iter()
        .flat_map(|(f, m)| references(f, m, &modules))
        .collect()
}

/// One message per cycle among siblings: `engine -> modes -> engine` and where each edge is.
fn check_cycles(files: &[SourceFile]) -> Vec<String> {
    let mut problems = Vec::new();
    for (parent, graph) in graphs(&all_references(files)) {
        for cycle in cycles(&graph) {
            let qualify =
                |m: &String| display(&parent.iter().chain([m]).cloned().collect::<Vec<_>>());
            let mut msg = format!(
                "cycle: {}",
                cycle.iter().map(qualify).collect::<Vec<_>>().join(" -> ")
            );
            for pair in cycle.windows(2) {
                let _ = write!(
                    msg,
                    "\n    {} -> {}: {}",
                    qualify(&pair[0]),
                    qualify(&pair[1]),
                    locations(&graph[&pair[0]][&pair[1]])
                );
            }
            problems.push(msg);
        }
    }
    problems
}

/// One message per use of a top-level module listed below its user in `src/lib.rs`.
fn check_lib_order(files: &[SourceFile]) -> Vec<String> {
    let Some(lib) = files.iter().find(|f| f.path == "src/lib.rs") else {
        return vec!["src/lib.rs is missing".into()];
    };
    let toks = tokens(&strip(&lib.text));
    let mut depth = 0;
    let mut listed: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for (i, t) in toks.iter().enumerate() {
        match t.text.as_str() {
            "{" => depth += 1,
            "}" => depth -= 1,
            "mod" if depth == 0 && toks.get(i + 2).is_some_and(|t| t.text == ";") => {
                let n = listed.len();
                listed
                    .entry(toks[i + 1].text.clone())
                    .or_insert((n, toks[i + 1].line));
            }
            _ => {}
        }
    }
    let mut problems = Vec::new();
    let edges = graphs(&all_references(files))
        .remove(&ModPath::new())
        .unwrap_or_default();
    for (user, used) in &edges {
        for (dep, at) in used {
            let (Some(u), Some(d)) = (listed.get(user), listed.get(dep)) else {
                continue;
            };
            if d.0 > u.0 {
                problems.push(format!(
                    "src/lib.rs lists `{user}` (line {}) above `{dep}` (line {}), but {user} uses {dep}: {}",
                    u.1,
                    d.1,
                    locations(at)
                ));
            }
        }
    }
    problems
}

/// Every `.rs` file under `src/`, paths as `src/...`, sorted.
fn read_tree(root: &Path) -> Vec<SourceFile> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<SourceFile>) {
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                walk(&path, root, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path
                    .strip_prefix(root)
                    .expect("under root")
                    .to_string_lossy()
                    .into_owned();
                let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{rel}: {e}"));
                out.push(SourceFile { path: rel, text });
            }
        }
    }
    let mut out = Vec::new();
    walk(&root.join("src"), root, &mut out);
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

fn crate_tree() -> Vec<SourceFile> {
    let files = read_tree(Path::new(env!("CARGO_MANIFEST_DIR")));
    assert!(
        files.iter().any(|f| f.path == "src/lib.rs"),
        "no src/lib.rs under CARGO_MANIFEST_DIR"
    );
    files
}

#[test]
fn no_module_cycle_in_src() {
    let problems = check_cycles(&crate_tree());
    assert!(
        problems.is_empty(),
        "module cycles in src/:\n{}",
        problems.join("\n")
    );
}

#[test]
fn lib_rs_lists_top_level_modules_bottom_up() {
    let problems = check_lib_order(&crate_tree());
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The checker itself, on small trees in memory.
mod checker {
    use super::*;

    fn tree(files: &[(&str, &str)]) -> Vec<SourceFile> {
        files
            .iter()
            .map(|(p, t)| SourceFile {
                path: (*p).into(),
                text: (*t).into(),
            })
            .collect()
    }

    #[test]
    fn module_paths_follow_the_files() {
        assert_eq!(
            module_of("engine/tasks.rs"),
            Some(vec!["engine".into(), "tasks".into()])
        );
        assert_eq!(module_of("engine/mod.rs"), Some(vec!["engine".into()]));
        assert_eq!(module_of("inventory.rs"), Some(vec!["inventory".into()]));
        assert_eq!(module_of("lib.rs"), Some(vec![]));
        assert_eq!(module_of("bin/vfiod.rs"), None);
        assert_eq!(module_of("data/x.toml"), None);
    }

    #[test]
    fn a_top_level_cycle_is_reported_with_each_edge() {
        let files = tree(&[
            ("src/lib.rs", "pub mod a;\npub mod b;\n"),
            ("src/a.rs", "//! a\n\nuse crate::b::Thing;\n"),
            ("src/b/mod.rs", "pub mod inner;\n"),
            (
                "src/b/inner.rs",
                "fn f() {\n    let _ = crate::a::g();\n}\n",
            ),
        ]);
        let problems = check_cycles(&files);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].starts_with("cycle: a -> b -> a"),
            "{}",
            problems[0]
        );
        assert!(
            problems[0].contains("a -> b: src/a.rs:3"),
            "{}",
            problems[0]
        );
        assert!(
            problems[0].contains("b -> a: src/b/inner.rs:2"),
            "{}",
            problems[0]
        );
    }

    #[test]
    fn a_sibling_cycle_through_super_and_use_groups_is_reported() {
        let files = tree(&[
            ("src/lib.rs", "pub mod e;\n"),
            ("src/e/mod.rs", "pub mod x;\npub mod y;\npub mod z;\n"),
            ("src/e/x.rs", "use super::{y::Y, Other};\n"),
            ("src/e/y.rs", "use crate::{e::{z::{self, Z}}};\n"),
            ("src/e/z.rs", "fn f(_: super::super::e::x::X) {}\n"),
        ]);
        let problems = check_cycles(&files);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].starts_with("cycle: e::x -> e::y -> e::z -> e::x"),
            "{}",
            problems[0]
        );
    }

    #[test]
    fn parents_root_items_comments_strings_and_test_modules_make_no_edge() {
        let files = tree(&[
            ("src/lib.rs", "pub mod a;\npub mod b;\npub fn error_chain() {}\n"),
            ("src/a/mod.rs", "pub mod k;\nuse crate::b::B;\nuse self::k::K;\n"),
            (
                "src/a/k.rs",
                "use super::Parent;\nuse crate::a::Parent2;\nfn f() { crate::error_chain(); }\n",
            ),
            (
                "src/b.rs",
                concat!(
                    "//! See [`crate::a::k`].\n",
                    "/// Not [`crate::a`] either.\n",
                    "/* crate::a /* nested */ crate::a */\n",
                    "const S: &str = \"crate::a::x\";\n",
                    "const R: &str = r#\"crate::a \" still\"#;\n",
                    "const C: char = '\"'; fn g<'a>(x: &'a str) -> &'a str { x }\n",
                    "#[cfg(test)]\nmod tests {\n    use crate::a::k;\n    mod deeper { use crate::a; }\n}\n",
                ),
            ),
        ]);
        assert_eq!(check_cycles(&files), Vec::<String>::new());
        let refs = all_references(&files);
        let edges: Vec<_> = refs
            .iter()
            .map(|r| (display(&r.from), display(&r.to)))
            .collect();
        assert_eq!(
            edges,
            [
                ("a".into(), "b".into()),
                ("a::k".into(), "a".into()),
                ("a::k".into(), "a".into())
            ],
            "{refs:?}"
        );
    }

    #[test]
    fn code_for_not_test_counts() {
        let files = tree(&[
            ("src/lib.rs", "pub mod a;\npub mod b;\n"),
            ("src/a.rs", ""),
            (
                "src/b.rs",
                "#[cfg(not(test))]\nmod real {\n    use crate::a::A;\n}\n",
            ),
        ]);
        let refs = all_references(&files);
        assert_eq!(refs.len(), 1, "{refs:?}");
        assert_eq!(refs[0].at.to_string(), "src/b.rs:3");
    }

    #[test]
    fn super_inside_an_inline_module_is_relative_to_it() {
        let files = tree(&[
            ("src/lib.rs", "pub mod s;\n"),
            ("src/s/mod.rs", "pub mod m;\npub mod t;\n"),
            (
                "src/s/m.rs",
                "pub mod inner {\n    use super::super::t::T;\n}\n",
            ),
            ("src/s/t.rs", ""),
        ]);
        let refs = all_references(&files);
        assert_eq!(refs.len(), 1, "{refs:?}");
        assert_eq!(display(&refs[0].to), "s::t");
        assert_eq!(refs[0].at.to_string(), "src/s/m.rs:2");
    }

    #[test]
    fn lib_rs_order_violation_names_the_edge() {
        let files = tree(&[
            ("src/lib.rs", "pub mod b; // uses a\npub mod a;\n"),
            ("src/a.rs", ""),
            ("src/b.rs", "\nuse crate::a::A;\n"),
        ]);
        let problems = check_lib_order(&files);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains("lists `b` (line 1) above `a` (line 2), but b uses a: src/b.rs:2"),
            "{}",
            problems[0]
        );
        let fixed = tree(&[
            ("src/lib.rs", "pub mod a;\npub mod b;\n"),
            ("src/a.rs", ""),
            ("src/b.rs", "use crate::a::A;\n"),
        ]);
        assert_eq!(check_lib_order(&fixed), Vec::<String>::new());
    }
}

/// docs/architecture.md, the map beside `src/lib.rs`.
fn architecture_md() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/architecture.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every file or folder the map names (in backquotes, ending in `.rs` or `/`) exists, as written
/// from the top of the tree or under `src/`: a renamed file shows up here, not in a reader's
/// dead end.
#[test]
fn architecture_md_names_only_files_that_exist() {
    let top = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = architecture_md();
    let mut named = 0;
    let mut missing = Vec::new();
    for quoted in doc.split('`').skip(1).step_by(2) {
        let is_path = (quoted.ends_with(".rs") || quoted.ends_with('/'))
            && quoted
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-./".contains(c));
        if !is_path {
            continue;
        }
        named += 1;
        if !top.join(quoted).exists() && !top.join("src").join(quoted).exists() {
            missing.push(quoted.to_string());
        }
    }
    assert!(named > 40, "docs/architecture.md names only {named} files");
    assert!(
        missing.is_empty(),
        "docs/architecture.md names files that do not exist: {missing:?}"
    );
}

/// `unsafe` code (outside comments and strings) is only in the files the map's `unsafe` table
/// lists, and each listed file still has some.
#[test]
fn unsafe_code_is_where_architecture_md_says() {
    let doc = architecture_md();
    let table = doc
        .split("## `unsafe` code")
        .nth(1)
        .expect("docs/architecture.md has a section \"`unsafe` code\"");
    let listed: BTreeSet<String> = table
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_string)
        .collect();
    let with_unsafe: BTreeSet<String> = crate_tree()
        .into_iter()
        .filter(|f| tokens(&strip(&f.text)).iter().any(|t| t.text == "unsafe"))
        .map(|f| f.path)
        .collect();
    assert_eq!(
        with_unsafe, listed,
        "files with `unsafe` code (left) and the files docs/architecture.md lists (right)"
    );
}

/// The module names a file path gives: `src/engine/pool/flow.rs` -> `engine`, `pool`, `flow`
/// (`mod.rs`, `lib.rs` and `main.rs` name no module of their own; `src` is no module).
fn module_names(path: &str) -> Vec<String> {
    let stem = path.strip_suffix(".rs").unwrap_or(path);
    stem.split('/')
        .skip(1)
        .filter(|p| !matches!(*p, "mod" | "lib" | "main"))
        .map(str::to_owned)
        .collect()
}

/// One stem per concept (docs/architecture.md, "Names"): no module name is another's plural or
/// participle (`claim` and `claims`, `pool` and `pooled`), and schema migrations are `schema`, so
/// that "migration" always means live migration. Each problem names both modules.
fn stem_clashes(paths: &[&str]) -> Vec<String> {
    let names: BTreeSet<String> = paths.iter().flat_map(|p| module_names(p)).collect();
    let mut problems = Vec::new();
    for n in &names {
        for suffix in ["s", "ed"] {
            let longer = format!("{n}{suffix}");
            if names.contains(&longer) {
                problems.push(format!("`{n}` and `{longer}` name one concept: use `{n}`"));
            }
        }
        if n.starts_with("migrations") {
            problems.push(format!(
                "`{n}`: schema migrations are `schema`; \"migration\" means live migration"
            ));
        }
    }
    problems
}

#[test]
fn stem_clashes_finds_plural_participle_and_schema_migrations() {
    let table: &[(&[&str], usize)] = &[
        (&["src/claim/mod.rs", "src/engine/claim.rs"], 0),
        (&["src/claims/mod.rs", "src/engine/claim.rs"], 1),
        (&["src/pool/mod.rs", "src/dbus/pooled.rs"], 1),
        (
            &[
                "src/dbus/pool.rs",
                "src/dbus/pools.rs",
                "src/model/pooled.rs",
            ],
            2,
        ),
        (&["src/store/migrations.rs"], 1),
        (&["src/migration.rs", "src/store/schema.rs"], 0),
        (&["src/metrics/mod.rs", "src/engine/pool/lease.rs"], 0),
    ];
    for (paths, want) in table {
        let got = stem_clashes(paths);
        assert_eq!(got.len(), *want, "{paths:?}: {got:?}");
    }
}

#[test]
fn module_names_use_one_stem_per_concept() {
    let mut paths: Vec<String> = crate_tree().into_iter().map(|f| f.path).collect();
    for krate in [
        "crates/vfiod-pool",
        "crates/vfiod-pool-protocol",
        "crates/vfiod-man",
    ] {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(krate);
        paths.extend(read_tree(&root).into_iter().map(|f| f.path));
    }
    let refs: Vec<&str> = paths.iter().map(String::as_str).collect();
    let problems = stem_clashes(&refs);
    assert!(
        problems.is_empty(),
        "module names:\n{}",
        problems.join("\n")
    );
}

/// The daemon links no libvirt: its client library and that library's chain (GnuTLS, libxml2,
/// ICU, libssh, ...) run in the helper process `vfiod-libvirt`, which alone needs them
/// (host::libvirt::process says why). A call into `virt` from the daemon's code would bring
/// libvirt back into `vfiod`'s NEEDED entries: this reads them from the binary the tests built.
#[test]
fn the_daemon_links_no_libvirt_and_its_helper_does() {
    let needed = |bin: &str| -> Vec<String> {
        let out = std::process::Command::new("readelf")
            .args(["-d", bin])
            .output()
            .expect("readelf (binutils) runs");
        assert!(out.status.success(), "readelf -d {bin}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains("(NEEDED)"))
            .filter_map(|l| {
                l.split('[')
                    .nth(1)
                    .map(|n| n.trim_end_matches(']').to_string())
            })
            .collect()
    };
    let daemon = needed(env!("CARGO_BIN_EXE_vfiod"));
    assert!(
        !daemon.iter().any(|n| n.starts_with("libvirt")),
        "vfiod links libvirt: {daemon:?}"
    );
    let helper = needed(env!("CARGO_BIN_EXE_vfiod-libvirt"));
    assert!(
        helper.iter().any(|n| n.starts_with("libvirt.so")),
        "vfiod-libvirt does not link libvirt: {helper:?}"
    );
}
