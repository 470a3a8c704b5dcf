//! The history kept within `[history]` by the running daemon (its pruner, on the store's
//! blocking pool, while `vfioctl events` goes on answering), and `vfioctl backup` with a restore
//! through the real binaries: `vfiod --simulate`, its state database copied while it runs, the
//! copy put back after more changes were acknowledged, the start refused naming what the copy
//! lacks, and `--accept-store-loss` starting on it.

use crate::common::{self, eventually, vfioctl, Harness, STEADY_CONFIG};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use vfiod::model::event::EventKind;
use vfiod::store::NewEvent;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_keeps_the_events_within_the_limit_and_events_still_reads() {
    let config =
        format!("{STEADY_CONFIG}\n[history]\nevents_max_count = 100\nprune_interval_seconds = 1\n");
    let mut h = Harness::start(&config).await;
    let store = h.store();
    let first = store
        .record_event(NewEvent::new(None, EventKind::Config, "the first of many"))
        .unwrap();
    for i in 0..400 {
        store
            .record_event(NewEvent::new(None, EventKind::Config, format!("event {i}")))
            .unwrap();
    }
    // Written faster than a prune runs: the bound is passed for a moment, and the pruner brings
    // the history back within it.
    eventually(
        Duration::from_secs(30),
        "the pruner keeps 100 events",
        || {
            let (events, _) = store.history_counts().unwrap();
            (events <= 100).then_some(())
        },
    )
    .await;
    let bus = h.bus.address().to_string();
    let (ok, out) = tokio::task::block_in_place(|| {
        vfioctl(
            &bus,
            &["events", "--json", "--since", &first.id.to_string()],
        )
    });
    assert!(ok, "{out}");
    let events: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert!(
        !events.is_empty() && events.len() <= 100,
        "{} events",
        events.len()
    );
    assert!(
        events.iter().all(|e| e["id"].as_i64().unwrap() > first.id),
        "the events after a pruned id are those that are left"
    );
    assert_eq!(
        events.last().unwrap()["message"].as_str(),
        Some("event 399"),
        "the newest events stay"
    );
    h.stop_server().await;
}

/// A running `vfiod --simulate --sim-root DIR`; killed if the test ends early.
struct Sim {
    child: Child,
    stderr: mpsc::Receiver<String>,
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Sim {
    fn start(root: &Path, extra: &[&str]) -> Sim {
        let mut child = Command::new(env!("CARGO_BIN_EXE_vfiod"))
            .args(["--simulate", "--sim-root"])
            .arg(root)
            .args(extra)
            .env("VFIOD_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start vfiod --simulate");
        let (tx, rx) = mpsc::channel();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Sim { child, stderr: rx }
    }

    /// The bus address once the API is served; panics with what it said if it ends first.
    fn wait_banner(&self) -> String {
        let deadline = Instant::now() + Duration::from_secs(90);
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stderr.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.trim().strip_prefix("export VFIOD_BUS='") {
                        return rest.trim_end_matches('\'').to_string();
                    }
                    seen.push(line);
                }
                Err(_) => panic!("no banner from vfiod --simulate; it said: {seen:#?}"),
            }
        }
    }

    /// Waits for the process to end by itself: its status and everything it said.
    fn wait_exit(mut self) -> (std::process::ExitStatus, String) {
        let deadline = Instant::now() + Duration::from_secs(90);
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "vfiod did not end");
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut said = String::new();
        // The reader thread ends with the pipe; what it read is all in the channel.
        while let Ok(line) = self.stderr.recv_timeout(Duration::from_secs(5)) {
            said.push_str(&line);
            said.push('\n');
        }
        (status, said)
    }

    fn terminate(mut self) -> std::process::ExitStatus {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        self.child.wait().unwrap()
    }
}

fn events(bus: &str) -> Vec<serde_json::Value> {
    let (ok, out) = vfioctl(bus, &["events", "--json", "--limit", "10000"]);
    assert!(ok, "{out}");
    serde_json::from_str(&out).unwrap()
}

#[test]
fn a_backup_restored_after_later_changes_is_refused_until_the_loss_is_accepted() {
    let dir = common::fast_tempdir();
    let root = dir.path().join("sim");
    let state = root.join("state");
    let copy = dir.path().join("vfiod-backup.db");

    let first = Sim::start(&root, &[]);
    let bus = first.wait_banner();
    let before = events(&bus);
    let backed_up = before.last().unwrap()["id"].as_i64().unwrap();

    // The copy, taken by vfioctl itself while the daemon runs; the state directory from the
    // configuration $VFIOD_CONFIG names.
    let config = dir.path().join("backup.toml");
    std::fs::write(
        &config,
        format!("state_dir = {:?}\n", state.display().to_string()),
    )
    .unwrap();
    let backup = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_vfioctl"))
            .arg("backup")
            .args(args)
            .env("VFIOD_CONFIG", &config)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    let (ok, out) = backup(&["--json", copy.to_str().unwrap()]);
    assert!(ok, "{out}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(
        report["last_event"].as_i64().unwrap() >= backed_up,
        "{report}"
    );
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&copy).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "the copy is its owner's only");
    // An existing file is kept unless --force.
    let (ok, out) = backup(&[copy.to_str().unwrap()]);
    assert!(
        !ok && out.contains("exists") && out.contains("--force"),
        "{out}"
    );
    // The copy is a database of its own, whole, in one file.
    let conn = rusqlite::Connection::open(&copy).unwrap();
    let mode: String = conn
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "delete");
    let held: i64 = conn
        .query_row("SELECT max(id) FROM events", [], |r| r.get(0))
        .unwrap();
    assert_eq!(held, report["last_event"].as_i64().unwrap());
    drop(conn);

    // A change after the copy, acknowledged to its client: a claim.
    let (ok, out) = vfioctl(
        &bus,
        &[
            "claim",
            "--kind",
            "gpu",
            "--vm",
            "after-the-backup",
            "--json",
        ],
    );
    assert!(ok, "{out}");
    let claim: serde_json::Value = serde_json::from_str(&out).unwrap();
    let claim_id = claim["id"].as_i64().unwrap();
    assert!(first.terminate().success());

    // The restore, as docs/operations.md says: the log files gone, the copy in place.
    for name in ["vfiod.db-wal", "vfiod.db-shm"] {
        let _ = std::fs::remove_file(state.join(name));
    }
    std::fs::copy(&copy, state.join("vfiod.db")).unwrap();

    // vfiod refuses to start on it, naming what it lacks and the way out.
    let (status, said) = Sim::start(&root, &[]).wait_exit();
    assert!(!status.success(), "{said}");
    assert!(said.contains("lacks changes vfiod acknowledged"), "{said}");
    assert!(said.contains(&format!("claim {claim_id}")), "{said}");
    assert!(said.contains("--accept-store-loss"), "{said}");

    // Accepted: it starts on the copy, which holds what the backup held and records the loss.
    let third = Sim::start(&root, &["--accept-store-loss"]);
    let bus = third.wait_banner();
    let now = events(&bus);
    let ids: Vec<i64> = now.iter().map(|e| e["id"].as_i64().unwrap()).collect();
    assert!(ids.contains(&backed_up), "{ids:?}");
    assert!(
        now.iter().any(|e| e["kind"] == "store"
            && e["message"]
                .as_str()
                .unwrap()
                .contains("--accept-store-loss")),
        "the accepted loss is an event"
    );
    let (ok, out) = vfioctl(&bus, &["claims", "--json"]);
    assert!(ok, "{out}");
    assert!(
        !out.contains("after-the-backup"),
        "the claim after the copy is not in it: {out}"
    );
    assert!(third.terminate().success());
}
