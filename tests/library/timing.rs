//! Tests that cannot race the clock (issue 34, item 6): a guard over the test code itself.
//!
//! CI runs every harness on a loaded 2-core machine, where anything takes longer than on an
//! idle one. So a test never bounds how long something took, and never pauses and then looks:
//!
//! 1. **No upper bound on a measured time.** An `assert!` may not compare `elapsed()`, or a
//!    value taken from `elapsed()` in the same file (`let took = t.elapsed();`, a `took:` field),
//!    with `<` or `<=`. A timing claim lives in `benches/`, as a ratio against a reference
//!    measured in the same run (`benches/domain_xml.rs`, `benches/hook_deadline.rs`). A test
//!    states the property instead: the error names the deadline that ended it, the hang is
//!    still held in the simulated kernel (`SimKernel::hanging`), the refusal came before the
//!    read. A lower bound (`took >= timeout`: it waited at least its timeout) cannot fail on a
//!    slow machine and is allowed.
//! 2. **No sleep followed by an assertion.** A `sleep(` that is not inside a loop, a closure or
//!    an async block (where it is the pause of a poll or a peer's pace) may not be followed by an
//!    `assert` in the rest of its block. Wait for the event or state instead, with
//!    `common::eventually*` and a deadline that only ends a hung test (`common::HUNG`). For
//!    "nothing happens", find an event that proves the code went past the point: a later event,
//!    a count (`SimKernel::hanging`, `Libvirt::daemon_looks`, a metric), a task that ended, a
//!    D-Bus round trip after the trigger.
//!
//! The guard reads every `.rs` file under `tests/` and `crates/*/tests/`. The sites below
//! (`ALLOWED`) are known and not yet rewritten: each is a debt, listed by file and line text,
//! and the list may only shrink (a listed line that is gone fails the guard too, so it is taken
//! off).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Known sites, not yet rewritten: (file, the line's text, trimmed).
const ALLOWED: &[(&str, &str)] = &[
    // Not a wait: the mixed-fault soak SIGKILLs vfiod at a random moment of a restore, and what
    // it asserts after the restart (records agree with sysfs) must hold at every moment.
    (
        "tests/soak_faults.rs",
        "std::thread::sleep(Duration::from_millis(rng.below(300)));",
    ),
    // A settle before the baseline of descriptors (compared, with slack, after the pressure).
    (
        "tests/exhaustion.rs",
        "tokio::time::sleep(Duration::from_millis(500)).await;",
    ),
    // The flood's peak of descriptors, printed only.
    (
        "tests/exhaustion.rs",
        "tokio::time::sleep(Duration::from_millis(1500)).await;",
    ),
    // The reference pool's tests (crates/vfiod-pool): windows timed with pauses.
    (
        "crates/vfiod-pool/tests/pool_protocol.rs",
        "tokio::time::sleep(Duration::from_millis(100)).await;",
    ),
    (
        "crates/vfiod-pool/tests/pool_protocol.rs",
        "tokio::time::sleep(Duration::from_millis(80)).await;",
    ),
    (
        "crates/vfiod-pool/tests/pool_service_limits.rs",
        "tokio::time::sleep(Duration::from_millis(200)).await;",
    ),
    (
        "crates/vfiod-pool/tests/pool_service_limits.rs",
        "tokio::time::sleep(Duration::from_millis(300)).await;",
    ),
    (
        "crates/vfiod-pool/tests/pool_service_limits.rs",
        "tokio::time::sleep(Duration::from_millis(100)).await;",
    ),
];

/// The workspace's root: this package's manifest directory, or `VFIOD_TIMING_GUARD_ROOT` (to
/// run the guard over another checkout, e.g. to see what it finds in an older tree).
fn root() -> PathBuf {
    std::env::var_os("VFIOD_TIMING_GUARD_ROOT")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every test source the guard reads.
fn test_sources() -> Vec<PathBuf> {
    let root = root();
    let mut out = Vec::new();
    rust_files(&root.join("tests"), &mut out);
    for c in std::fs::read_dir(root.join("crates")).unwrap().flatten() {
        rust_files(&c.path().join("tests"), &mut out);
    }
    out.sort();
    out
}

/// `text` without comments (line and block) and with string and char literals blanked, line
/// breaks kept: what the guard matches is code, never prose or a message.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out: Vec<u8> = Vec::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i < b.len() && !(b[i] == b'*' && b.get(i + 1) == Some(&b'/')) {
                if b[i] == b'\n' {
                    out.push(b'\n');
                }
                i += 1;
            }
            i += 2;
        } else if c == b'r' && matches!(b.get(i + 1), Some(b'"') | Some(b'#')) && {
            let mut j = i + 1;
            while b.get(j) == Some(&b'#') {
                j += 1;
            }
            b.get(j) == Some(&b'"') && (i == 0 || !(b[i - 1].is_ascii_alphanumeric()))
        } {
            // A raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b[j] == b'#' {
                hashes += 1;
                j += 1;
            }
            j += 1;
            out.extend_from_slice(b"\"\"");
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&b'#')) {
                    j += 1 + hashes;
                    break;
                }
                if b[j] == b'\n' {
                    out.push(b'\n');
                }
                j += 1;
            }
            i = j;
        } else if c == b'"' {
            out.extend_from_slice(b"\"\"");
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                if i < b.len() && b[i] == b'\n' {
                    out.push(b'\n');
                }
                i += 1;
            }
            i += 1;
        } else if c == b'\''
            && (b.get(i + 2) == Some(&b'\'')
                || (b.get(i + 1) == Some(&b'\\')
                    && b[i + 2..].iter().take(10).any(|&x| x == b'\'')))
        {
            // A char literal ('x', '\n', '\u{..}'); a lifetime ('a) is left alone.
            out.extend_from_slice(b"' '");
            i += 1;
            while i < b.len() && b[i] != b'\'' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    // Non-ASCII bytes are copied whole, outside literals and comments: still UTF-8.
    String::from_utf8_lossy(&out).into_owned()
}

/// The names a file binds to a measured time: `let NAME = ...elapsed();` and `NAME: ...elapsed()`.
fn elapsed_names(code: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for stmt in code.split([';', ',', '{', '}']) {
        let stmt = stmt.trim();
        if !stmt.ends_with(".elapsed()") {
            continue;
        }
        let head = stmt
            .split_once('=')
            .map(|(h, _)| h)
            .or_else(|| stmt.split_once(':').map(|(h, _)| h));
        if let Some(head) = head {
            let name = head
                .trim()
                .trim_start_matches("let ")
                .trim_start_matches("mut ")
                .trim();
            if !name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || c == '_') {
                names.insert(name.to_string());
            }
        }
    }
    names
}

/// The text of each `assert!`-family invocation in `code` (its arguments), with its line.
fn asserts(code: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let b = code.as_bytes();
    let mut from = 0;
    while let Some(at) = code[from..].find("assert") {
        let start = from + at;
        from = start + 6;
        if start > 0 && (b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_') {
            continue;
        }
        let Some(open) = code[start..].find('(') else {
            break;
        };
        let name = &code[start..start + open];
        if !name.ends_with('!') || name.contains(char::is_whitespace) {
            continue;
        }
        let mut depth = 0;
        let mut end = start + open;
        for (k, &c) in b[start + open..].iter().enumerate() {
            match c {
                b'(' => depth += 1,
                b')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = start + open + k;
                        break;
                    }
                }
                _ => {}
            }
        }
        let line = code[..start].matches('\n').count() + 1;
        out.push((line, code[start + open + 1..end].to_string()));
    }
    out
}

/// Whether `args` (an assertion's) bounds a measured time from above.
fn bounds_a_time_from_above(args: &str, names: &BTreeSet<String>) -> bool {
    let flat: String = args.split_whitespace().collect::<Vec<_>>().join(" ");
    let upper = |subject: &str| {
        flat.match_indices(subject).any(|(i, _)| {
            let before = flat[..i].chars().last();
            let after = flat[i + subject.len()..].trim_start();
            before.is_none_or(|c| !(c.is_alphanumeric() || c == '_'))
                && after.starts_with('<')
                && !after.starts_with("<<")
        })
    };
    // `LIMIT > t.elapsed()`, `LIMIT >= took`: the subject with its receiver on the right.
    let lower_side = |subject: &str| {
        flat.match_indices(subject).any(|(i, _)| {
            let before = flat[..i]
                .trim_end_matches(|c: char| c.is_alphanumeric() || c == '_' || c == '.')
                .trim_end();
            let before = before.strip_suffix('=').unwrap_or(before);
            before.ends_with('>') && !before.ends_with("=>") && !before.ends_with("->")
        })
    };
    upper("elapsed()")
        || lower_side("elapsed()")
        || names
            .iter()
            .any(|n| upper(n) || upper(&format!(".{n}")) || lower_side(n))
}

/// The kind of each open block around a position: true for a loop, a closure or an async block
/// (a sleep there paces a poll or a peer), false for a function body or a plain block.
fn sleeps_followed_by_an_assert(code: &str) -> Vec<usize> {
    let b = code.as_bytes();
    // (pacing, index of '{') of the open blocks.
    let mut stack: Vec<bool> = Vec::new();
    let mut last_break = 0; // start of the current statement's text
    let mut found = Vec::new();
    // Sleeps waiting for an assert in their block: (depth, line).
    let mut pending: Vec<(usize, usize)> = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'{' => {
                let head = &code[last_break..i];
                let words: Vec<&str> = head
                    .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .filter(|w| !w.is_empty())
                    .collect();
                let is_fn = words.contains(&"fn");
                let pacing = !is_fn
                    && (words
                        .iter()
                        .any(|w| matches!(*w, "loop" | "while" | "for" | "async" | "spawn"))
                        || head.contains('|'));
                stack.push(pacing);
                last_break = i + 1;
            }
            b'}' => {
                let depth = stack.len();
                pending.retain(|&(d, _)| d < depth);
                stack.pop();
                last_break = i + 1;
            }
            b';' => last_break = i + 1,
            _ => {}
        }
        if b[i..].starts_with(b"sleep(")
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
            && !stack.iter().any(|&pacing| pacing)
            && !code[last_break..i].contains("fn ")
        {
            pending.push((stack.len(), code[..i].matches('\n').count() + 1));
        }
        if b[i..].starts_with(b"assert")
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
        {
            let depth = stack.len();
            for &(d, line) in &pending {
                if d <= depth && !found.contains(&line) {
                    found.push(line);
                }
            }
        }
        i += 1;
    }
    found
}

/// What the guard finds in one file: (line, what), before the allowances.
fn findings(text: &str) -> Vec<(usize, &'static str)> {
    let code = code_only(text);
    let names = elapsed_names(&code);
    let mut out = Vec::new();
    for (line, args) in asserts(&code) {
        if bounds_a_time_from_above(&args, &names) {
            out.push((line, "an upper bound on a measured time"));
        }
    }
    for line in sleeps_followed_by_an_assert(&code) {
        out.push((line, "a sleep followed by an assertion"));
    }
    out.sort();
    out
}

#[test]
fn no_test_races_the_clock() {
    let root = root();
    let mut offences = Vec::new();
    let mut used = BTreeSet::new();
    for path in test_sources() {
        let rel = path
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (line, what) in findings(&text) {
            let at = lines.get(line - 1).map_or("", |l| l.trim());
            match ALLOWED
                .iter()
                .position(|(f, l)| *f == rel && at.starts_with(l))
            {
                Some(k) => {
                    used.insert(k);
                }
                None => offences.push(format!("{rel}:{line}: {what}: {at}")),
            }
        }
    }
    let stale: Vec<_> = ALLOWED
        .iter()
        .enumerate()
        .filter(|(k, _)| !used.contains(k))
        .map(|(_, (f, l))| format!("{f}: {l}"))
        .collect();
    assert!(
        offences.is_empty(),
        "tests that race the clock (see tests/library/timing.rs for the rule and how to wait \
         instead):\n{}",
        offences.join("\n")
    );
    assert!(
        stale.is_empty(),
        "allowed sites that are gone: take them off ALLOWED in tests/library/timing.rs:\n{}",
        stale.join("\n")
    );
}

/// The rule itself, as a table: what is flagged and what is not.
#[test]
fn the_guard_flags_the_races_and_not_the_waits() {
    let flagged: &[(&str, &str)] = &[
        (
            "fn t() { let t = Instant::now(); f(); assert!(t.elapsed() < Duration::from_secs(2)); }",
            "an upper bound on a measured time",
        ),
        (
            "fn t() { let started = Instant::now(); f();\n let took = started.elapsed();\n assert!(took < Duration::from_secs(2), \"{took:?}\"); }",
            "an upper bound on a measured time",
        ),
        (
            "fn t() { let r = run(); assert!(r.took < Duration::from_millis(1500)); }\nstruct Ran { took: Duration }\nfn run() -> Ran { Ran { took: s.elapsed() } }",
            "an upper bound on a measured time",
        ),
        (
            "fn t() { assert!(\n    Duration::from_secs(1) > t.elapsed(),\n); }",
            "an upper bound on a measured time",
        ),
        (
            "fn t() { h.kernel.release_hangs();\n std::thread::sleep(Duration::from_millis(100));\n assert_eq!(h.kernel.reset_count(a), Some(0)); }",
            "a sleep followed by an assertion",
        ),
        (
            "async fn t() { release().await;\n tokio::time::sleep(Duration::from_millis(1500)).await;\n let d = show().await;\n assert_ne!(d.state, \"usable\"); }",
            "a sleep followed by an assertion",
        ),
    ];
    for (code, what) in flagged {
        let found: Vec<_> = findings(code).into_iter().map(|(_, w)| w).collect();
        assert!(found.contains(what), "not flagged as {what}: {code}");
    }
    let fine: &[&str] = &[
        // A lower bound: it waited at least its timeout.
        "fn t() { let took = t.elapsed(); assert!(took >= timeout, \"{took:?}\"); }",
        // A deadline in a poll loop.
        "fn t() { loop { if done() { break; } assert!(Instant::now() < deadline, \"hung\"); sleep(Duration::from_millis(20)); } }",
        "fn t() { loop { if done() { break; } std::thread::sleep(Duration::from_millis(20)); } assert!(done()); }",
        // A peer's pace in a thread or a task.
        "fn t() { std::thread::spawn(move || { w.write_all(b\"x\"); std::thread::sleep(GAP); }); assert!(read().is_err()); }",
        "async fn t() { tokio::spawn(async move { tokio::time::sleep(GAP).await; stop(); }); assert!(run().await.is_err()); }",
        // Words in comments and messages are not code.
        "fn t() { // sleep(1) then assert!(x)\n assert!(ok, \"took < 2 s after sleep(\"); }",
        // A measured time printed, not bounded.
        "fn t() { let took = t.elapsed(); eprintln!(\"{took:?}\"); assert!(ok); }",
    ];
    for code in fine {
        assert_eq!(findings(code), vec![], "flagged: {code}");
    }
}
