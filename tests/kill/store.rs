//! Issue 33 (3), against the real daemon (`vfiod --simulate --sim-root`, driven with `vfioctl`):
//! after a clean stop `vfiod.db` held no table and everything was in `vfiod.db-wal`; with the
//! log of a killed vfiod cut to half or 512 bytes of it flipped, vfiod started, said nothing
//! and had lost every claim; with the log removed while vfiod ran, two more claims were
//! acknowledged and the whole store was gone at the next start.
//!
//! Now: a clean stop leaves the whole store in `vfiod.db`; after a damaged log vfiod either
//! holds every acknowledged claim or refuses to start, naming the lost claims and the way on
//! (`--accept-store-loss`, which then starts it and records the loss); a log removed while vfiod
//! runs loses nothing.

use crate::common;

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;
use vfiod::client::claim::ClaimView;
use vfiod::sim::bus::PrivateBus;

/// A daemon start on a loaded machine, a debug build.
const SLOW: Duration = Duration::from_secs(60);

/// The daemon under test, killed whatever happens to the test.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One persistent simulated host with the X710 split into 8 VFs, and its bus.
struct Host {
    _bus: PrivateBus,
    bus: String,
    dir: tempfile::TempDir,
    starts: usize,
}

/// How a start ended: serving, or exited (a refusal) with its status and log.
enum Start {
    Serving(Daemon),
    Exited(ExitStatus, String),
}

impl Host {
    fn new() -> Host {
        let dir = common::fast_tempdir();
        std::fs::write(
            dir.path().join("vfiod.toml"),
            "scenario = \"public\"\npoll_interval = 3600\n\
             [[select]]\nid = \"8086:1572\"\nmode = \"vf\"\nnum_vfs = 8\n",
        )
        .unwrap();
        let bus = PrivateBus::start(&dir.path().join("bus"), "").unwrap();
        Host {
            bus: bus.address().to_string(),
            _bus: bus,
            dir,
            starts: 0,
        }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("sim/state")
    }

    fn db(&self) -> PathBuf {
        self.state().join(vfiod::store::DB_FILE_NAME)
    }

    fn wal(&self) -> PathBuf {
        self.state()
            .join(format!("{}-wal", vfiod::store::DB_FILE_NAME))
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join(format!("vfiod-{}.log", self.starts))
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(self.log()).unwrap_or_default()
    }

    /// Starts vfiod with `args`; waits until it serves, or until it exits.
    fn try_start(&mut self, args: &[&str]) -> Start {
        self.starts += 1;
        let mut c = Command::new(env!("CARGO_BIN_EXE_vfiod"));
        c.args(["--simulate", "--sim-root"])
            .arg(self.dir.path().join("sim"))
            .arg("--config")
            .arg(self.dir.path().join("vfiod.toml"))
            .args(["--bus", &self.bus])
            .args(args)
            .env("VFIOD_LOG", "info")
            .env_remove("VFIOD_TEST_KILL_AT_STEP")
            .env_remove("VFIOD_TEST_KILL_AT")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.log()).unwrap());
        let mut daemon = Daemon(c.spawn().expect("start vfiod"));
        let deadline = std::time::Instant::now() + SLOW;
        loop {
            if let Some(status) = daemon.0.try_wait().unwrap() {
                return Start::Exited(status, self.log_text());
            }
            if self.ctl(&["status"]).0 {
                return Start::Serving(daemon);
            }
            assert!(
                std::time::Instant::now() < deadline,
                "vfiod neither serves nor exits within {SLOW:?}:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn start(&mut self, args: &[&str]) -> Daemon {
        match self.try_start(args) {
            Start::Serving(d) => d,
            Start::Exited(status, log) => {
                panic!("vfiod exited during its start ({status}):\n{log}")
            }
        }
    }

    fn ctl(&self, args: &[&str]) -> (bool, String) {
        common::vfioctl(&self.bus, args)
    }

    fn ok(&self, args: &[&str]) -> String {
        let (ok, out) = self.ctl(args);
        assert!(
            ok,
            "vfioctl {args:?}: {out}\nvfiod's log:\n{}",
            self.log_text()
        );
        out
    }

    /// Claims a VF for `vm`: the claim's id, acknowledged.
    fn claim(&self, vm: &str) -> u64 {
        let out = self.ok(&["claim", "--vf", "--vm", vm]);
        out.strip_prefix("claim ")
            .and_then(|r| r.split(':').next())
            .and_then(|id| id.parse().ok())
            .unwrap_or_else(|| panic!("claim N: ...: {out}"))
    }

    fn claims(&self) -> Vec<u64> {
        let views: Vec<ClaimView> = serde_json::from_str(&self.ok(&["claims", "--json"])).unwrap();
        views.iter().map(|c| c.id).collect()
    }

    /// SIGTERM, and a clean exit within the stop's bound.
    fn stop(&self, mut d: Daemon) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(d.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let status = d.0.wait().unwrap();
        assert!(status.success(), "{status}:\n{}", self.log_text());
    }

    /// SIGKILL: a crash, no cleanup.
    fn kill(&self, mut d: Daemon) {
        d.0.kill().unwrap();
        d.0.wait().unwrap();
    }

    /// Waits until a VF can be claimed (`vfioctl find --vf` lists one).
    fn wait_claimable(&self, what: &str) {
        let deadline = std::time::Instant::now() + SLOW;
        while !self
            .ctl(&["find", "--vf"])
            .1
            .lines()
            .any(|l| l.starts_with("0000:3b:"))
        {
            assert!(
                std::time::Instant::now() < deadline,
                "{what}: no VF claimable within {SLOW:?}:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn wal_len(&self) -> u64 {
        std::fs::metadata(self.wal()).map(|m| m.len()).unwrap_or(0)
    }
}

/// After SIGTERM the log is empty (or gone) and `vfiod.db` alone, copied elsewhere, holds the
/// tables and the claims.
#[test]
fn a_clean_stop_leaves_the_whole_store_in_the_database_file() {
    let mut host = Host::new();
    let d = host.start(&[]);
    let ids = [host.claim("vm1"), host.claim("vm2")];
    host.stop(d);
    assert_eq!(
        host.wal_len(),
        0,
        "the log still holds changes after a clean stop (vfiod.db: {} bytes)",
        std::fs::metadata(host.db()).unwrap().len()
    );
    let alone = tempfile::tempdir().unwrap();
    let copy = alone.path().join("copy.db");
    std::fs::copy(host.db(), &copy).unwrap();
    let conn = rusqlite::Connection::open(&copy).unwrap();
    for id in ids {
        let found: bool = conn
            .query_row(
                "SELECT EXISTS (SELECT 1 FROM claims WHERE id = ?1)",
                [id as i64],
                |r| r.get(0),
            )
            .unwrap_or_else(|e| panic!("vfiod.db alone: {e}"));
        assert!(found, "claim {id} is not in vfiod.db alone");
    }
}

/// The log of a killed vfiod cut to half, or 512 bytes of it flipped: at the next start every
/// acknowledged claim is there, or vfiod refuses (exit 1) naming the lost claims and
/// `--accept-store-loss`, which then starts it with the loss recorded as an event.
#[test]
fn a_damaged_log_after_a_kill_is_refused_or_loses_nothing() {
    type Fault = fn(&std::path::Path);
    let faults: [(&str, Fault); 2] = [
        ("the log cut to half", |p| {
            let len = std::fs::metadata(p).unwrap().len();
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .unwrap()
                .set_len(len / 2)
                .unwrap();
        }),
        ("512 bytes of the log flipped", |p| {
            let mut bytes = std::fs::read(p).unwrap();
            let mid = bytes.len() / 2;
            bytes[mid..mid + 512].iter_mut().for_each(|b| *b = !*b);
            std::fs::write(p, bytes).unwrap();
        }),
    ];
    let mut host = Host::new();
    let mut d = host.start(&[]);
    let mut acknowledged: Vec<u64> = Vec::new();
    for (what, fault) in faults {
        acknowledged.extend([host.claim("vm1"), host.claim("vm2")]);
        host.kill(d);
        assert!(
            host.wal_len() > 4096,
            "{what}: the log is empty after the kill: the fault would test nothing"
        );
        fault(&host.wal());
        d = match host.try_start(&[]) {
            Start::Serving(d) => {
                println!("{what}: vfiod started with every claim");
                let held = host.claims();
                for id in &acknowledged {
                    assert!(
                        held.contains(id),
                        "{what}: vfiod started without claim {id}, acknowledged before the \
                         kill (holds {held:?}):\n{}",
                        host.log_text()
                    );
                }
                d
            }
            Start::Exited(status, log) => {
                println!(
                    "{what}: refused: {}",
                    log.lines().last().unwrap_or_default()
                );
                assert_eq!(status.code(), Some(1), "{what}: {status}:\n{log}");
                let last = acknowledged.last().unwrap();
                assert!(
                    log.contains("lacks changes vfiod acknowledged")
                        && (log.contains(&format!("claim {last}"))
                            || log.contains(&format!("to {last}")))
                        && log.contains("--accept-store-loss"),
                    "{what}: the refusal does not name the lost claims:\n{log}"
                );
                // Refused again, unchanged, until the operator accepts the loss.
                assert!(matches!(host.try_start(&[]), Start::Exited(..)), "{what}");
                let d = host.start(&["--accept-store-loss"]);
                let events = host.ok(&["events", "--kind", "store", "--json"]);
                assert!(
                    events.contains("--accept-store-loss"),
                    "{what}: no store event: {events}"
                );
                // The store went back to a moment before the lost changes: a split that had
                // ended may be running there, and is interrupted now (the devices in
                // error). The operator looks and resets it; then VFs can be claimed again.
                let _ = host.ctl(&["task", "reset", "0000:3b:00.0"]);
                host.wait_claimable(what);
                // What it holds is what the next acknowledgements build on.
                acknowledged = host.claims();
                d
            }
        };
    }
    host.stop(d);
}

/// The log removed while vfiod runs (as a cleanup script may), then two claims acknowledged:
/// after a clean stop, or a kill, every claim is there at the next start, and the log said
/// which file was rescued.
#[test]
fn a_log_removed_while_vfiod_runs_loses_no_acknowledged_claim() {
    let mut host = Host::new();
    for kill in [false, true] {
        let d = host.start(&[]);
        let mut ids = vec![host.claim("before")];
        std::fs::remove_file(host.wal()).unwrap();
        ids.extend([host.claim("after-1"), host.claim("after-2")]);
        let log = host.log_text();
        if kill {
            host.kill(d);
        } else {
            host.stop(d);
        }
        let d = host.start(&[]);
        let held = host.claims();
        for id in &ids {
            assert!(
                held.contains(id),
                "kill {kill}: claim {id} acknowledged and lost (holds {held:?})"
            );
        }
        assert!(
            log.contains(&host.wal().display().to_string()) && log.contains("was removed"),
            "kill {kill}: no warning names the removed log:\n{log}"
        );
        host.stop(d);
    }
}
