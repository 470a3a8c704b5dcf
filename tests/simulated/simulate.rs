//! `vfiod --simulate --sim-root DIR`, the real binary, across the ways it ends: a second run on
//! the same directory refuses while the first lives; after a SIGKILL or a fatal SIGUSR1 its
//! private dbus-daemon dies with it and a restart on the same directory serves `vfioctl`.

use crate::common;

use crate::common::vfioctl;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A running `vfiod --simulate`, killed if the test ends early.
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
    fn start(sim_root: &Path) -> Sim {
        let mut child = Command::new(env!("CARGO_BIN_EXE_vfiod"))
            .args(["--simulate", "--sim-root"])
            .arg(sim_root)
            .env("VFIOD_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start vfiod --simulate");
        // Drained on a thread, so that vfiod never blocks on a full pipe.
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

    /// The bus address from the banner's `export VFIOD_BUS='...'` line: the API is served.
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

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn signal(&mut self, sig: nix::sys::signal::Signal) -> std::process::ExitStatus {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig).unwrap();
        self.child.wait().unwrap()
    }
}

/// Pids of live dbus-daemons whose config lies under `dir` (from `/proc`; zombies have no
/// command line and do not count).
fn bus_daemons_under(dir: &Path) -> Vec<i32> {
    let prefix = format!("--config-file={}/", dir.display());
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.first().is_some_and(|a| a.ends_with("dbus-daemon"))
            && args.iter().any(|a| a.starts_with(&prefix))
        {
            pids.push(pid);
        }
    }
    pids
}

fn sim_root() -> (tempfile::TempDir, PathBuf) {
    let dir = common::fast_tempdir();
    let root = dir.path().join("sim");
    (dir, root)
}

/// Kills a running simulation with `sig` (whose default action ends the process, so vfiod
/// cannot clean up), then checks that its bus is gone and that a restart on the same
/// directory serves `vfioctl list`.
fn killed_then_restarted(sig: nix::sys::signal::Signal) {
    let (_dir, root) = sim_root();
    let mut first = Sim::start(&root);
    let bus = first.wait_banner();
    assert!(vfioctl(&bus, &["list"]).0, "the first run serves");
    let buses = bus_daemons_under(&root);
    assert_eq!(buses.len(), 1, "one private bus while it runs: {buses:?}");

    let status = first.signal(sig);
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(sig as i32),
        "{status:?}"
    );
    common::eventually_blocking(
        Duration::from_secs(5),
        &format!("the private dbus-daemon {buses:?} ends with vfiod killed by {sig}"),
        || bus_daemons_under(&root).is_empty().then_some(()),
    );

    let second = Sim::start(&root);
    let bus2 = second.wait_banner();
    assert_ne!(bus2, bus, "a restart gets a socket of its own");
    let (ok, out) = vfioctl(&bus2, &["list"]);
    assert!(ok, "vfioctl list against the restarted vfiod: {out}");
    assert!(out.contains("0000:3b:00.0"), "{out}");
    // The first run's leftovers (its bus directory) were cleared; only the live one is left.
    let instances: Vec<_> = std::fs::read_dir(root.join("bus"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(instances.len(), 1, "{instances:?}");
    assert_eq!(bus_daemons_under(&root).len(), 1);
}

#[test]
fn sigkill_takes_the_private_bus_along_and_a_restart_serves() {
    killed_then_restarted(nix::sys::signal::Signal::SIGKILL);
}

#[test]
fn fatal_sigusr1_takes_the_private_bus_along_and_a_restart_serves() {
    killed_then_restarted(nix::sys::signal::Signal::SIGUSR1);
}

#[test]
fn a_second_run_on_the_same_sim_root_refuses_with_the_holders_pid() {
    let (_dir, root) = sim_root();
    let mut first = Sim::start(&root);
    let bus = first.wait_banner();

    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_vfiod"))
        .args(["--simulate", "--sim-root"])
        .arg(&root)
        .env("VFIOD_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let took = started.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the second run must fail: {err}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert!(
        err.contains(&format!(
            "is in use by vfiod pid {} (lock {})",
            first.pid(),
            root.join("vfiod.lock").display()
        )),
        "{err}"
    );
    // The refused run disturbed nothing: one bus, and the first still serves on it.
    assert_eq!(bus_daemons_under(&root).len(), 1);
    let (ok, list) = vfioctl(&bus, &["list"]);
    assert!(ok, "{list}");

    // After the first stops (SIGTERM: a clean stop), a new run starts.
    let status = first.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(status.success(), "{status:?}");
    let third = Sim::start(&root);
    let bus3 = third.wait_banner();
    let (ok, list) = vfioctl(&bus3, &["list"]);
    assert!(ok, "{list}");
}
