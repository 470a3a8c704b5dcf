//! Golden files of `vfioctl`'s output: each read command, as text and as `--json`, run against
//! one vfiod on the simulated reference host (the harness's private dbus-daemon), compared
//! with `tests/data/golden/vfioctl/<case>.txt|.json`. An accidental change of a table, a
//! field, a message or an exit status fails the test with the first line that differs.
//!
//! One daemon serves every case, in two acts: the host as it starts (nothing claimed, no
//! task, no image), then after a split of the FPGA, a claim of the GPU and an image added.
//!
//! A golden file holds one case: the command line, the exit status, stdout and stderr:
//!
//! ```text
//! # vfioctl show 0000:99:00.0 --json
//! # exit 3
//! # stdout
//! # stderr
//! {"error":"org.vfiod.Vfiod1.Error.NoSuchDevice",...}
//! ```
//!
//! What differs from run to run or from machine to machine is redacted first (`normalise`):
//!
//! | what                                             | becomes        |
//! |--------------------------------------------------|----------------|
//! | the private bus's address                        | `<BUS>`        |
//! | the test's temporary directory (config, state)   | `<TMP>`        |
//! | RFC 3339 times (`2026-01-02T03:04:05.678Z`)      | `<TIME>`       |
//! | wall-clock `*_ms` JSON values (10 digits or more)| `<TIME_MS>`    |
//! | D-Bus unique names (`:1.42`)                     | `<BUS_NAME>`   |
//! | the crate's version                              | `<VERSION>`    |
//! | the caller's uid (`uid 0`)                       | `uid <UID>`    |
//! | a duration histogram's sum (`*_seconds_sum`)     | `<SECONDS>`    |
//! | its finite buckets' counts (`*_seconds_bucket`)  | `<N>`          |
//!
//! Ids (events, tasks, claims, images) are not redacted: a new store numbers them the same way
//! every run. The host name is the config's `host_name`, not the machine's. `vfioctl fleet`
//! talks to PostgreSQL, not to vfiod, and is not covered here (tests/fleet/hosts.rs).
//!
//! After an intended output change, regenerate the files and review the diff:
//!
//! ```text
//! VFIOD_BLESS=1 cargo test --features test-hooks --test simulated vfioctl::golden
//! ```

use super::ran;
use crate::common::{eventually, Harness, STEADY_CONFIG};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

const IFACE: &str = "3a00972e7aac41debbd13901124e8cda";
const AFU: &str = "d8424dc4a4a3c413f89e433683f9040b";

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden/vfioctl")
}

fn bless() -> bool {
    std::env::var_os("VFIOD_BLESS").is_some_and(|v| v != "0" && !v.is_empty())
}

/// The steady host, under a fixed host name and with one pool configured (never contacted:
/// nothing is leased), so that `pool pools` and `status` have something to show.
fn config() -> String {
    format!(
        "host_name = \"golden-host\"\n{STEADY_CONFIG}\n[[pool]]\nname = \"golden-pool\"\n\
         url = \"http://127.0.0.1:9\"\n"
    )
}

/// The strings of this run that `normalise` replaces verbatim.
struct Known {
    bus: String,
    tmp: String,
    version: &'static str,
    uid: String,
}

/// Redacts what varies between runs (see the module header); the rest is left byte for byte.
fn normalise(text: &str, known: &Known) -> String {
    let text = text
        .replace(&known.bus, "<BUS>")
        .replace(&known.tmp, "<TMP>");
    let text: String = text.split_inclusive('\n').map(durations).collect();
    let mut out = String::with_capacity(text.len());
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let prev = i.checked_sub(1).map(|p| b[p]);
        if let Some(n) = rfc3339_at(&b[i..]) {
            out.push_str("<TIME>");
            i += n;
        } else if let Some(n) = time_ms_at(&b[i..]) {
            out.push_str(&text[i..i + n.0]);
            out.push_str("<TIME_MS>");
            i += n.0 + n.1;
        } else if b[i] == b':' && !prev.is_some_and(|p| p.is_ascii_alphanumeric() || p == b':') {
            if let Some(n) = unique_name_at(&b[i..]) {
                out.push_str("<BUS_NAME>");
                i += n;
            } else {
                out.push(':');
                i += 1;
            }
        } else if let Some(n) = word_at(&b[i..], prev, known.version.as_bytes()) {
            out.push_str("<VERSION>");
            i += n;
        } else if let Some(n) = word_at(&b[i..], prev, known.uid.as_bytes()) {
            out.push_str("uid <UID>");
            i += n;
        } else {
            // One whole character (the text is UTF-8: tables use none but names might).
            let c = text[i..].chars().next().expect("a character");
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// A Prometheus sample of a duration histogram (how long a task took) with its value redacted:
/// the sum always, the finite buckets' counts too (a slow machine moves a task to a later
/// bucket). The `+Inf` bucket and the count are kept: they count what happened.
fn durations(line: &str) -> String {
    let name = line.split(['{', ' ']).next().unwrap_or_default();
    let placeholder = if name.ends_with("_seconds_sum") {
        "<SECONDS>"
    } else if name.ends_with("_seconds_bucket") && !line.contains("le=\"+Inf\"") {
        "<N>"
    } else {
        return line.to_string();
    };
    match line.trim_end().rsplit_once(' ') {
        Some((sample, _)) => format!("{sample} {placeholder}\n"),
        None => line.to_string(),
    }
}

fn digits(b: &[u8]) -> usize {
    b.iter().take_while(|c| c.is_ascii_digit()).count()
}

/// `YYYY-MM-DDTHH:MM:SS[.fff]Z` at the start of `b`: its length.
fn rfc3339_at(b: &[u8]) -> Option<usize> {
    let shape = b"dddd-dd-ddTdd:dd:dd";
    if b.len() < shape.len() + 1 {
        return None;
    }
    for (c, s) in b.iter().zip(shape) {
        let ok = if *s == b'd' {
            c.is_ascii_digit()
        } else {
            c == s
        };
        if !ok {
            return None;
        }
    }
    let mut n = shape.len();
    if b[n] == b'.' {
        n += 1 + digits(&b[n + 1..]);
    }
    (b.get(n) == Some(&b'Z')).then_some(n + 1)
}

/// `_ms": 1796281821042` (pretty or compact JSON) at the start of `b`: the length of the part
/// kept (`_ms": `) and of the wall-clock number (10 digits or more; 0 and small numbers, such as
/// a timeout, are kept).
fn time_ms_at(b: &[u8]) -> Option<(usize, usize)> {
    let key = b"_ms\":";
    if !b.starts_with(key) {
        return None;
    }
    let kept = key.len() + b[key.len()..].iter().take_while(|c| **c == b' ').count();
    let n = digits(&b[kept..]);
    (n >= 10).then_some((kept, n))
}

/// A D-Bus unique name (`:1.42`) at the start of `b`: its length.
fn unique_name_at(b: &[u8]) -> Option<usize> {
    let major = digits(&b[1..]);
    if major == 0 || b.get(1 + major) != Some(&b'.') {
        return None;
    }
    let minor = digits(&b[2 + major..]);
    let end = 2 + major + minor;
    let delimited = b
        .get(end)
        .is_none_or(|c| !c.is_ascii_alphanumeric() && *c != b'.');
    (minor > 0 && delimited).then_some(end)
}

/// `word` at the start of `b`, not inside a longer word or number: its length.
fn word_at(b: &[u8], prev: Option<u8>, word: &[u8]) -> Option<usize> {
    let part = |c: u8| c.is_ascii_alphanumeric() || c == b'.' || c == b'_';
    if !b.starts_with(word) || prev.is_some_and(part) {
        return None;
    }
    b.get(word.len())
        .is_none_or(|c| !part(*c))
        .then_some(word.len())
}

/// One case as its golden file holds it, normalised.
fn record(bus: &str, args: &[&str], known: &Known) -> String {
    let r = ran(bus, args, false);
    let code = r
        .code
        .map_or_else(|| "signal".to_string(), |c| c.to_string());
    let mut text = format!("# vfioctl {}\n# exit {code}\n# stdout\n", args.join(" "));
    text.push_str(&r.stdout);
    if !r.stdout.is_empty() && !r.stdout.ends_with('\n') {
        text.push('\n');
    }
    text.push_str("# stderr\n");
    text.push_str(&r.stderr);
    if !r.stderr.is_empty() && !r.stderr.ends_with('\n') {
        text.push('\n');
    }
    normalise(&text, known)
}

/// Where `want` and `got` first differ, line by line, with the line before for context.
fn first_difference(want: &str, got: &str) -> String {
    let (w, g): (Vec<&str>, Vec<&str>) = (want.lines().collect(), got.lines().collect());
    if w == g {
        return "the same lines, but not the same line endings or final newline".to_string();
    }
    let at = w
        .iter()
        .zip(&g)
        .position(|(a, b)| a != b)
        .unwrap_or(w.len().min(g.len()));
    let line = |v: &[&str], i: usize| {
        v.get(i)
            .map_or("<end of output>".to_string(), |l| format!("{l:?}"))
    };
    let context = at
        .checked_sub(1)
        .map(|p| format!("\n      after: {}", line(&w, p)))
        .unwrap_or_default();
    format!(
        "first difference at line {}:{context}\n   expected: {}\n        got: {}",
        at + 1,
        line(&w, at),
        line(&g, at)
    )
}

/// The cases of a run, by golden file name.
struct Cases {
    bus: String,
    known: Known,
    recorded: BTreeMap<String, String>,
}

impl Cases {
    /// Runs `vfioctl ARGS` and keeps its output as golden file `name`.
    fn one(&mut self, name: &str, args: &[&str]) {
        let text = record(&self.bus, args, &self.known);
        let before = self.recorded.insert(name.to_string(), text);
        assert!(before.is_none(), "two cases named {name}");
    }

    /// The text and the `--json` output of one command, as `NAME.txt` and `NAME.json`.
    fn both(&mut self, name: &str, args: &[&str]) {
        self.one(&format!("{name}.txt"), args);
        self.one(&format!("{name}.json"), &[args, &["--json"]].concat());
    }
}

/// Every read command of vfioctl, as text and as JSON, against a golden file each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_output_of_each_read_command() {
    let h = Harness::start(&config()).await;
    let bus = h.bus.address().to_string();
    let known = Known {
        bus: bus.clone(),
        tmp: h
            .dir
            .path()
            .to_str()
            .expect("a UTF-8 temporary path")
            .to_string(),
        version: env!("CARGO_PKG_VERSION"),
        uid: format!("uid {}", nix::unistd::getuid()),
    };
    let mut cases = Cases {
        bus: bus.clone(),
        known,
        recorded: BTreeMap::new(),
    };

    // The host as it starts: nothing claimed, no task, no image.
    cases.both("list", &["list"]);
    cases.one(
        "list-kind-crypto-no-legend.txt",
        &["list", "--kind", "crypto", "--no-legend"],
    );
    cases.both("show-0000_3b_00_0", &["show", "0000:3b:00.0"]);
    cases.both("show-0000_3d_00_0-protected", &["show", "0000:3d:00.0"]);
    cases.both("show-0000_5e_00_1-vf", &["show", "0000:5e:00.1"]);
    cases.both("show-0000_99_00_0-not-found", &["show", "0000:99:00.0"]);
    cases.both("find-kind-fpga", &["find", "--kind", "fpga"]);
    cases.both(
        "find-parent-0000_5e_00_0",
        &["find", "--parent", "0000:5e:00.0"],
    );
    cases.both("find-id-ffff_ffff-no-match", &["find", "--id", "ffff:ffff"]);
    cases.both("plan", &["plan"]);
    cases.both("plan-0000_af_00_0", &["plan", "0000:af:00.0"]);
    cases.both("status", &["status"]);
    cases.both("claims-empty", &["claims"]);
    cases.both("task-list-empty", &["task", "list"]);
    cases.both("task-show-999-not-found", &["task", "show", "999"]);
    cases.both(
        "events-kind-added-limit-4",
        &["events", "--kind", "added", "--limit", "4"],
    );
    cases.both("events-0000_3b_00_0", &["events", "0000:3b:00.0"]);
    cases.both(
        "events-before-3-limit-2",
        &["events", "--before", "3", "--limit", "2"],
    );
    cases.both("image-list-empty", &["image", "list"]);
    cases.both("pool-list", &["pool", "list"]);
    cases.both("pool-pools", &["pool", "pools"]);

    // Act two: the FPGA split into 2 VFs (task 1), the GPU's group claimed (claim 1), an image.
    let r = ran(
        &bus,
        &["mode", "0000:af:00.0", "vf", "--vfs", "2", "--wait"],
        false,
    );
    assert_eq!(r.code, Some(0), "the split: {}", r.stderr);
    // The inventory records the split's VFs after the task has ended: wait for them, so that
    // the claim's event comes after theirs in every run.
    let store = h.store();
    eventually(
        Duration::from_secs(20),
        "the split's VFs are recorded",
        || {
            let events = store.events(None, 0, 10_000).ok()?;
            events
                .iter()
                .any(|e| e.message.contains("0000:af:00.2 appeared"))
                .then_some(())
        },
    )
    .await;
    let r = ran(&bus, &["claim", "--id", "10de:1aef", "--vm", "web1"], false);
    assert_eq!(r.code, Some(0), "the claim: {}", r.stderr);
    let gbs = vfiod::fpga::image::build::gbs(IFACE, &[AFU], b"golden bits");
    let file = h.dir.path().join("nlb.gbs");
    std::fs::write(&file, &gbs).unwrap();
    let digest: String = Sha256::digest(&gbs)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect();
    let r = ran(
        &bus,
        &[
            "image",
            "add",
            "nlb",
            file.to_str().unwrap(),
            "--sha256",
            &digest,
        ],
        false,
    );
    assert_eq!(r.code, Some(0), "the image: {}", r.stderr);

    cases.both("list-kind-fpga-split", &["list", "--kind", "fpga"]);
    cases.both("show-0000_af_00_0-split", &["show", "0000:af:00.0"]);
    cases.both("show-0000_17_00_0-claimed", &["show", "0000:17:00.0"]);
    cases.both("status-claimed", &["status"]);
    cases.both("claims", &["claims"]);
    cases.both("find-kind-gpu-claimed", &["find", "--kind", "gpu"]);
    cases.both("task-list", &["task", "list"]);
    cases.both("task-show-1", &["task", "show", "1"]);
    cases.both("task-show-0000_af_00_0", &["task", "show", "0000:af:00.0"]);
    cases.both("events-kind-task", &["events", "--kind", "task"]);
    cases.both("events-kind-claim", &["events", "--kind", "claim"]);
    cases.both("events-since-32", &["events", "--since", "32"]);
    cases.both("image-list", &["image", "list"]);
    cases.both("image-show-nlb", &["image", "show", "nlb"]);
    cases.both(
        "image-show-missing-not-found",
        &["image", "show", "missing"],
    );
    cases.one("metrics.txt", &["metrics"]);

    let cases = cases.recorded;
    let dir = golden_dir();
    if bless() {
        std::fs::create_dir_all(&dir).unwrap();
        // A case no longer recorded loses its file.
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if !cases.contains_key(&name) {
                std::fs::remove_file(&path).unwrap();
            }
        }
        for (name, text) in &cases {
            std::fs::write(dir.join(name), text).unwrap();
        }
        eprintln!("wrote {} golden files to {}", cases.len(), dir.display());
    }

    let mut problems = Vec::new();
    for (name, got) in &cases {
        let path = dir.join(name);
        match std::fs::read_to_string(&path) {
            Err(e) => problems.push(format!("{name}: cannot read {}: {e}", path.display())),
            Ok(want) if &want != got => problems.push(format!(
                "{name}: the output differs from tests/data/golden/vfioctl/{name}: {}",
                first_difference(&want, got)
            )),
            Ok(_) => {}
        }
    }
    for entry in std::fs::read_dir(&dir).into_iter().flatten() {
        let name = entry.unwrap().file_name().to_string_lossy().to_string();
        if !cases.contains_key(&name) {
            problems.push(format!("{name}: a golden file that no case records"));
        }
    }
    assert!(
        problems.is_empty(),
        "vfioctl's output is not what the golden files say (after an intended change, \
         regenerate them: VFIOD_BLESS=1 cargo test --features test-hooks --test simulated \
         vfioctl::golden, and review the diff):\n{}",
        problems.join("\n")
    );
}

/// The redactions, on fixed input: each placeholder, and what must stay.
#[test]
fn golden_normalise_redacts_only_what_varies() {
    let known = Known {
        bus: "unix:path=/tmp/x/bus.sock,guid=ab12".to_string(),
        tmp: "/tmp/x".to_string(),
        version: "0.1.0",
        uid: "uid 1000".to_string(),
    };
    let input = "vfiod 0.1.0 on unix:path=/tmp/x/bus.sock,guid=ab12, config /tmp/x/vfiod.toml\n\
                 28  2026-12-03T07:10:21.042Z  added  0000:5e:01.0 (rev 0.1.0x)\n\
                 1   2026-12-03T07:10:21Z  split  by uid 1000 (:1.25) not uid 10000\n\
                 \"created_ms\": 1796281821391, \"lease_expires_ms\": 0, \"t_ms\":1796281821391\n\
                 \"connect_timeout_ms\": 2000, vfiod_build_info{version=\"0.1.0\"} 1\n\
                 x_seconds_bucket{kind=\"split\",le=\"0.05\"} 1\n\
                 x_seconds_bucket{kind=\"split\",le=\"+Inf\"} 1\n\
                 x_seconds_sum{kind=\"split\"} 0.009\n\
                 x_seconds_count{kind=\"split\"} 1\n";
    let want = "vfiod <VERSION> on <BUS>, config <TMP>/vfiod.toml\n\
                28  <TIME>  added  0000:5e:01.0 (rev 0.1.0x)\n\
                1   <TIME>  split  by uid <UID> (<BUS_NAME>) not uid 10000\n\
                \"created_ms\": <TIME_MS>, \"lease_expires_ms\": 0, \"t_ms\":<TIME_MS>\n\
                \"connect_timeout_ms\": 2000, vfiod_build_info{version=\"<VERSION>\"} 1\n\
                x_seconds_bucket{kind=\"split\",le=\"0.05\"} <N>\n\
                x_seconds_bucket{kind=\"split\",le=\"+Inf\"} 1\n\
                x_seconds_sum{kind=\"split\"} <SECONDS>\n\
                x_seconds_count{kind=\"split\"} 1\n";
    assert_eq!(normalise(input, &known), want);
    assert_eq!(
        first_difference("a\nb\nc\n", "a\nB\nc\n"),
        "first difference at line 2:\n      after: \"a\"\n   expected: \"b\"\n        got: \"B\""
    );
    assert!(first_difference("a\n", "a\nb\n").contains("expected: <end of output>"));
    assert!(first_difference("a\n", "a").contains("final newline"));
}
