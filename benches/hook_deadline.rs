//! The qemu hook's deadline against a daemon that never answers (issue 24 item 3): the hook
//! (`vfiod-qemu-hook`, as libvirt runs it) reads the domain XML beside its call, and gives both
//! up at `[hooks] deadline_ms`, however slow the document is to read. Its time on the costliest
//! documents is measured against a reference measured in the same run: the same hook, the same
//! silent socket and deadline, on a trivial document. Both end at the deadline, so the ratio is
//! about 1; a hook that read past its deadline would show the parse's time on top.
//!
//! This is where the claim lives that used to be an absolute bound in a test ("the hook ends
//! within 2.5 s", tests/simulated/hooks.rs), which raced a loaded machine.
//!
//! Run: `cargo bench --bench hook_deadline` (or `cargo test --bench hook_deadline` for the
//! debug profile). `VFIOD_BENCH_RUNS` sets the runs of each (default 3; the slowest counts).
//! Target: the test's document (100,000 attributes on a hostdev) at most 1.5 times the
//! reference; exits 1 when it misses it. The other documents are measured and printed, not
//! gated: on 2026-12-07 (debug profile, loaded 2-core machine) they took 12x and 2x the
//! reference, because `client::hook::answers_alone` parses the whole document before the
//! deadline's clock applies (a finding for the hook's owners, not fixed here).

use std::io::Write;
use std::os::unix::net::UnixListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const DEADLINE_MS: u64 = 800;
const TARGET_RATIO: f64 = 1.5;
const VF: &str = "<hostdev mode='subsystem' type='pci' managed='no'><source><address \
                  domain='0x0000' bus='0x3b' slot='0x02' function='0x0'/></source></hostdev>";

fn domain(devices: &str, metadata: &str) -> String {
    format!(
        "<domain type='kvm'><name>vm1</name><uuid>8f1e3c2a-0000-4000-8000-000000000001</uuid>\
         <memory>65536</memory><devices>{devices}</devices>{metadata}</domain>"
    )
}

/// (name, document, gated by the target).
fn documents() -> Vec<(&'static str, String, bool)> {
    let many: String = (0..100_000).map(|i| format!(" a{i}='x'")).collect();
    let thousand: String = (0..1000).map(|i| format!(" a{i}='x'")).collect();
    let elements: String = (0..60).map(|i| format!("<e{i}{thousand}/>")).collect();
    vec![
        (
            "100,000 attributes on the hostdev",
            domain(
                &VF.replace("managed='no'>", &format!("managed='no'{many}>")),
                "",
            ),
            true,
        ),
        (
            "60 elements of 1,000 attributes",
            domain(
                VF,
                &format!("<metadata><x:x xmlns:x='urn:x'>{elements}</x:x></metadata>"),
            ),
            false,
        ),
        ("4,000 hostdevs", domain(&VF.repeat(4000), ""), false),
    ]
}

/// One run of the hook on `xml` against the silent bus; its time (and exit code 1: fail closed).
fn run(bus: &str, config: &std::path::Path, xml: &str) -> Duration {
    let t = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vfiod-qemu-hook"))
        .args(["vm1", "prepare", "begin", "-"])
        .env("VFIOD_BUS", bus)
        .env("VFIOD_CONFIG", config)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run vfiod-qemu-hook");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(xml.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let took = t.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("did not answer within {DEADLINE_MS} ms")),
        "{stderr}"
    );
    took
}

fn main() {
    let runs: usize = std::env::var("VFIOD_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("silent");
    let listener = UnixListener::bind(&socket).unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in listener.incoming() {
            held.push(c);
        }
    });
    let config = dir.path().join("hook.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = \"{}\"\n[hooks]\ndeadline_ms = {DEADLINE_MS}\n",
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    let bus = format!("unix:path={}", socket.display());
    let reference_xml = domain(VF, "");
    let mut failed = false;
    println!(
        "{:<36} {:>9} {:>12} {:>7}",
        "document (deadline 800 ms)", "hook ms", "reference ms", "ratio"
    );
    for (name, xml, gated) in documents() {
        let mut worst = Duration::ZERO;
        let mut reference = Duration::MAX;
        for _ in 0..runs {
            // Interleaved, so that drift on a shared machine hits both alike.
            reference = reference.min(run(&bus, &config, &reference_xml));
            worst = worst.max(run(&bus, &config, &xml));
        }
        let ratio = worst.as_secs_f64() / reference.as_secs_f64();
        let ok = ratio <= TARGET_RATIO;
        failed |= gated && !ok;
        println!(
            "{:<36} {:>9.0} {:>12.0} {:>7.2}{}",
            name,
            worst.as_secs_f64() * 1000.0,
            reference.as_secs_f64() * 1000.0,
            ratio,
            match (ok, gated) {
                (true, _) => "",
                (false, true) => "  OVER",
                (false, false) => "  over (not gated)",
            }
        );
    }
    if failed {
        eprintln!("the hook ran past its deadline (ratio over {TARGET_RATIO})");
        std::process::exit(1);
    }
    println!("the gated document ended at the deadline (ratio at most {TARGET_RATIO})");
}
