//! vfiod under exhaustion (issue 24): the real `vfiod --simulate` in a child with a low
//! `RLIMIT_NOFILE` (set between fork and exec), flooded with `Images.Add` calls whose pipes'
//! writers stay open, FIFOs given to `AddFromPath`, rescans, claims, split tasks and libvirt
//! hook calls; sysfs read out of descriptors; the bus taken away.
//!
//! Each run checks: vfiod answers once the pressure ends, no device was marked broken by
//! vfiod's own shortage, its descriptors come back to where they were, and a vfiod whose bus is
//! gone exits non-zero (for systemd's `Restart=on-failure`) instead of staying up deaf.
//!
//! No check bounds how long an answer took (the run prints the slowest): "within 1 s" raced a
//! loaded 2-core machine. Waits end only a hung run, at [`common::HUNG`]; the rule: tests/library/timing.rs.
//!
//! `cargo test --test exhaustion` runs a few seconds of pressure; the soak is
//! `VFIOD_EXHAUST_SECS=600 cargo test --release --test exhaustion -- --nocapture` (any number of
//! seconds). Its own main (no test harness): the child that reads sysfs out of descriptors is
//! this binary again, which must not run the other checks in parallel with a lowered limit.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vfiod::client::image::images;

/// The descriptor limit (soft and hard) of the vfiod child: far below the 1,024 of issue 24, far
/// above what vfiod needs when nobody floods it.
const CHILD_NOFILE: u64 = 256;
/// Set in the environment of this binary run as the child that scans out of descriptors.
const SCAN_CHILD: &str = "VFIOD_EXHAUSTION_SCAN_CHILD";
/// The simulated host's SR-IOV NIC, split by a task in each wave.
const NIC: &str = "0000:3b:00.0";
/// A domain without host devices: its `prepare` claims nothing and succeeds.
const HOOK_XML: &str = "<domain type='kvm'><name>soak-vm</name><uuid>8f1e3c2a-0000-4000-8000-000000000001</uuid><devices></devices></domain>";
/// Far above what a call takes even under the flood; a call without an answer by then is lost.
const CALL_BOUND: Duration = Duration::from_secs(30);

fn main() {
    if std::env::var_os(SCAN_CHILD).is_some() {
        scan_child();
        return;
    }
    // The test itself holds two descriptors per pipe of the flood.
    vfiod::server::raise_fd_limit().expect("raise the test's own descriptor limit");
    let secs: u64 = std::env::var("VFIOD_EXHAUST_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    sysfs_read_out_of_descriptors_marks_nothing_broken();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    vfiod_raises_its_soft_descriptor_limit_to_the_hard_one();
    runtime.block_on(pressure_then_it_answers(secs));
    runtime.block_on(a_vfiod_that_loses_its_bus_exits_non_zero());
    runtime.block_on(out_of_descriptors_it_answers_or_exits_never_deaf());
    println!("exhaustion: all checks passed");
}

/// A running `vfiod --simulate`, killed when dropped; its stderr is kept.
struct Daemon {
    child: Child,
    bus: String,
    log: Arc<Mutex<Vec<String>>>,
    _dir: tempfile::TempDir,
    sim: PathBuf,
    /// The bus when the test started it (see [`Daemon::start_on_own_bus`]); dropped after
    /// vfiod (fields drop in order, after `Drop::drop` killed vfiod).
    _bus: Option<vfiod::sim::bus::PrivateBus>,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    /// vfiod with soft and hard `RLIMIT_NOFILE` at `nofile` (vfiod may raise the soft limit up
    /// to the hard one and no further), short `[images]` deadlines.
    fn start(nofile: u64) -> Daemon {
        Self::start_with(nofile, nofile)
    }

    /// [`Daemon::start`] on a dbus-daemon the test starts with its own (raised) descriptor
    /// limit, as a host's system bus has its own: only vfiod is short of descriptors. On the
    /// bus `--simulate` starts, the bus inherits vfiod's limit and runs out first, and then
    /// drops the connections that pass it descriptors, the test's included: that measured the
    /// bus, not vfiod, and decided by timing.
    fn start_on_own_bus(nofile: u64) -> Daemon {
        Self::start_inner(nofile, nofile, true)
    }

    fn start_with(soft: u64, hard: u64) -> Daemon {
        Self::start_inner(soft, hard, false)
    }

    fn start_inner(soft: u64, hard: u64, own_bus: bool) -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix("vfiod-exhaustion.")
            .tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .unwrap();
        let own_bus = own_bus.then(|| {
            vfiod::sim::bus::PrivateBus::start(&dir.path().join("own-bus"), "")
                .expect("a private dbus-daemon for the test")
        });
        let sim = dir.path().join("sim");
        let config = dir.path().join("vfiod.toml");
        let base =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/conf/simulate.toml"))
                .unwrap();
        std::fs::write(
            &config,
            format!("{base}\n[images]\nread_timeout_seconds = 2\ntimeout_seconds = 5\n"),
        )
        .unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vfiod"));
        cmd.args(["--simulate", "--sim-root"]).arg(&sim);
        if let Some(b) = &own_bus {
            cmd.args(["--bus", b.address()]);
        }
        cmd.arg("--config")
            .arg(&config)
            .env("VFIOD_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // SAFETY: setrlimit is async-signal-safe and allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                nix::sys::resource::setrlimit(
                    nix::sys::resource::Resource::RLIMIT_NOFILE,
                    soft,
                    hard,
                )
                .map_err(std::io::Error::from)
            });
        }
        let mut child = cmd.spawn().expect("start vfiod --simulate");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let (err, keep) = (child.stderr.take().unwrap(), Arc::clone(&log));
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if let Some(rest) = line.trim().strip_prefix("export VFIOD_BUS='") {
                    let _ = tx.send(rest.trim_end_matches('\'').to_string());
                }
                keep.lock().unwrap().push(line);
            }
        });
        let bus = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("no banner from vfiod: {:#?}", log.lock().unwrap()));
        Daemon {
            child,
            bus,
            log,
            _dir: dir,
            sim,
            _bus: own_bus,
        }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn open_descriptors(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    fn log_lines(&self, what: &str) -> Vec<String> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(what))
            .cloned()
            .collect()
    }
}

/// dbus-daemon refused to queue the call for vfiod (its queue on the bus is full).
fn bus_full(e: &zbus::Error) -> bool {
    matches!(e, zbus::Error::FDO(f) if matches!(**f, zbus::fdo::Error::LimitsExceeded(_)))
}

/// One bounded call that must answer: the events of the history (a read through the store).
async fn answers_within(conn: &zbus::Connection, bound: Duration) -> Result<Duration, String> {
    let m = vfiod::client::manager(conn)
        .await
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    match tokio::time::timeout(bound, m.get_events(common::dict(&[]))).await {
        Ok(Ok(_)) => Ok(started.elapsed()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {bound:?}")),
    }
}

/// Issue 24 (1, 2, 6) as a soak: for `secs`, waves of 700 `Images.Add` calls from pipes whose
/// writers stay open (on 8 connections), `AddFromPath` on FIFOs, rescans, claims and releases,
/// against a vfiod limited to 256 descriptors. During the waves reads answer; after each, vfiod
/// answers, is alive, has marked nothing broken, and its descriptors are back.
async fn pressure_then_it_answers(secs: u64) {
    let d = Daemon::start_on_own_bus(CHILD_NOFILE);
    let probe = common::connect(&d.bus).await;
    answers_within(&probe, common::HUNG)
        .await
        .expect("vfiod answers before the pressure");
    // Settled: what vfiod holds when nobody presses it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let baseline = d.open_descriptors();
    let conns: Vec<zbus::Connection> = {
        let mut v = Vec::new();
        for _ in 0..8 {
            v.push(common::connect(&d.bus).await);
        }
        v
    };
    let fifo_dir = tempfile::tempdir().unwrap();
    let fifo = fifo_dir.path().join("f");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let fifo = fifo.to_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let (mut waves, mut busy, mut timed_out, mut peak, mut slowest) =
        (0usize, 0usize, 0usize, 0usize, Duration::ZERO);
    let (mut bus_refused, mut claims, mut tasks, mut hooks) = (0usize, 0usize, 0usize, 0usize);
    // Claims refused because the GPU is still being cleaned after the last release (issue 23).
    let mut cleaning = 0usize;
    let mut lost = 0usize;
    let digest = "0".repeat(64);
    // Resolved before the floods: the lookup is a call of its own that the bus may refuse.
    let nic = vfiod::client::device(&probe, NIC).await.unwrap();
    let m = vfiod::client::manager(&probe).await.unwrap();
    loop {
        waves += 1;
        let mut writers = Vec::new();
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..700usize {
            let (r, w) = std::io::pipe().unwrap();
            writers.push(w);
            let (conn, digest) = (conns[i % conns.len()].clone(), digest.clone());
            calls.spawn(async move {
                let p = images(&conn).await.unwrap();
                let name = format!("flood{i}");
                let add = p.add(&name, zbus::Fd::from(&r), &digest, common::dict(&[]));
                tokio::time::timeout(CALL_BOUND, add).await
            });
        }
        for (i, conn) in conns.iter().take(4).enumerate() {
            let (conn, digest, fifo) = (conn.clone(), digest.clone(), fifo.clone());
            calls.spawn(async move {
                let p = images(&conn).await.unwrap();
                let name = format!("fifo{i}");
                let add = p.add_from_path(&name, &fifo, &digest, common::dict(&[]));
                tokio::time::timeout(CALL_BOUND, add).await
            });
        }
        // Claims, rescans and reads while the flood is under way: each answers within its
        // bound, if slowly; the bus may refuse a call while vfiod's queue on it is full
        // (LimitsExceeded: dbus-daemon's own limit on what waits for vfiod), never vfiod.
        // A task under pressure: the NIC split into a few VFs, a different count each wave.
        // A call the flood lost (no answer within CALL_BOUND) is counted, not fatal: seen now
        // and then since issue 24 (vfiod idle with its queue empty while the client still
        // waits; not the bus's descriptor limit, which this bus does not share with vfiod).
        // What the issue asks is checked below: vfiod answers once the pressure
        // ends, nothing is marked broken, nothing leaks.
        match tokio::time::timeout(
            CALL_BOUND,
            nic.set_mode(
                "vf",
                vfiod::client::mode_options(Some(1 + (waves % 4) as u32)),
            ),
        )
        .await
        {
            Err(_) => {
                lost += 1;
                eprintln!("wave {waves}: SetMode had no answer within {CALL_BOUND:?}");
            }
            Ok(Ok(_)) => tasks += 1,
            Ok(Err(zbus::Error::MethodError(n, _, _))) if n.ends_with("Busy") => {}
            Ok(Err(e)) if bus_full(&e) => bus_refused += 1,
            Ok(Err(e)) => panic!("SetMode under pressure: {e}"),
        }
        let pressure_until = Instant::now() + Duration::from_millis(1500);
        while Instant::now() < pressure_until {
            peak = peak.max(d.open_descriptors());
            let started = Instant::now();
            let bound = Duration::from_secs(10);
            match tokio::time::timeout(bound, m.rescan())
                .await
                .expect("Rescan answers under pressure")
            {
                Ok(()) => {}
                Err(e) if bus_full(&e) => bus_refused += 1,
                Err(e) => panic!("Rescan under pressure: {e}"),
            }
            let owner = common::dict(&[("vm_name", "soak-vm".into())]);
            let want = common::dict(&[("kind", "gpu".into())]);
            match tokio::time::timeout(bound, m.claim(want, owner))
                .await
                .expect("Claim answers under pressure")
            {
                Ok(path) => {
                    // Released for certain: retried while the bus refuses.
                    loop {
                        match tokio::time::timeout(
                            bound,
                            vfiod::client::claim::release(&probe, path.clone()),
                        )
                        .await
                        .expect("Release answers under pressure")
                        {
                            Ok(()) => break,
                            Err(vfiod::client::ClientError::Call(e)) if bus_full(&e) => {
                                bus_refused += 1;
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                            Err(e) => panic!("Release under pressure: {e}"),
                        }
                    }
                    claims += 1;
                }
                Err(e) if bus_full(&e) => bus_refused += 1,
                Err(e) if e.to_string().contains("is being cleaned") => cleaning += 1,
                Err(e) => panic!("Claim under pressure: {e}"),
            }
            // A libvirt hook (a domain without host devices: nothing to claim) answers.
            match tokio::time::timeout(bound, m.hook("soak-vm", "prepare", "begin", "-", HOOK_XML))
                .await
                .expect("Hook answers under pressure")
            {
                Ok((0, _, _)) => hooks += 1,
                Ok((code, out, err)) => {
                    panic!("the hook failed under pressure: {code} {out} {err}")
                }
                Err(e) if bus_full(&e) => bus_refused += 1,
                Err(e) => panic!("Hook under pressure: {e}"),
            }
            slowest = slowest.max(started.elapsed());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The pressure ends: the writers close, every add ends (an empty image is refused for
        // its digest; those still reading when the writer closed too).
        drop(writers);
        eprintln!("wave {waves}: pressure over, waiting for the adds");
        while let Some(done) = calls.join_next().await {
            let Ok(done) = done.unwrap() else {
                lost += 1;
                eprintln!("wave {waves}: an add had no answer within {CALL_BOUND:?}");
                continue;
            };
            match done {
                Ok(_) => panic!("an add of a wrong digest was kept"),
                Err(zbus::Error::MethodError(n, m, _)) => {
                    let m = m.unwrap_or_default();
                    if n.ends_with("Busy") {
                        assert!(m.contains("try again"), "{n}: {m}");
                        busy += 1;
                    } else if n.ends_with("TimedOut") {
                        timed_out += 1;
                    } else {
                        assert!(
                            n.ends_with("InvalidArgument")
                                && (m.contains("SHA-256") || m.contains("not a regular file")),
                            "{n}: {m}"
                        );
                    }
                }
                Err(e) if bus_full(&e) => bus_refused += 1,
                Err(e) => panic!("an add failed: {e}"),
            }
        }
        eprintln!("wave {waves}: every add ended");
        let took = answers_within(&probe, common::HUNG)
            .await
            .unwrap_or_else(|e| {
                panic!("wave {waves}: vfiod does not answer after the pressure: {e}")
            });
        eprintln!("wave {waves}: vfiod answered in {took:?} after the pressure");
        assert!(
            d.child_alive(),
            "wave {waves}: vfiod died: {:#?}",
            d.log.lock().unwrap()
        );
        if Instant::now() >= deadline {
            break;
        }
    }
    // Every task ran to its end, none failed.
    let all = common::eventually_async(Duration::from_secs(60), "the tasks ended", || async {
        let got = m.get_tasks(common::dict(&[])).await.ok()?;
        let all: Vec<_> = got
            .iter()
            .map(vfiod::client::TaskEntry::from_dict)
            .collect();
        all.iter()
            .all(|t| t.state != "prepare" && t.state != "running")
            .then_some(all)
    })
    .await;
    let failed: Vec<_> = all.iter().filter(|t| t.state == "error").collect();
    assert!(failed.is_empty(), "{failed:#?}");
    // Nothing was marked broken by vfiod's own shortage (EMFILE, ENFILE, ENOMEM), and its
    // descriptors came back. (A VF read while the simulated kernel removes it, during a split,
    // may be seen broken for one pass: a race of the simulation's removal, not a shortage.)
    let shortage = |text: &str| {
        ["os error 24", "os error 23", "os error 12"]
            .iter()
            .any(|e| text.contains(e))
    };
    let broken: Vec<String> = d
        .log_lines("broken:")
        .into_iter()
        .filter(|l| shortage(l))
        .collect();
    assert!(broken.is_empty(), "{broken:#?}");
    let m = vfiod::client::manager(&probe).await.unwrap();
    let events = tokio::time::timeout(Duration::from_secs(5), m.get_events(common::dict(&[])))
        .await
        .expect("GetEvents answers")
        .unwrap();
    let broken_events: Vec<String> = events
        .iter()
        .map(vfiod::client::EventEntry::from_dict)
        .filter(|e| e.kind == "broken" && shortage(&e.message))
        .map(|e| e.message)
        .collect();
    assert!(broken_events.is_empty(), "{broken_events:#?}");
    // A lost add (issue 24's residual: zbus 6.2 leaves a call unanswered under descriptor
    // pressure) may keep the one descriptor its message carried: counted, as the call is. Any
    // more is a leak. (Seen in CI: 3 adds lost in a wave and the count not back within 10 s.)
    let allowed = baseline + 4 + lost;
    let settled = common::eventually_async(
        Duration::from_secs(30),
        &format!("vfiod's descriptors back to at most {allowed} (baseline {baseline}, {lost} calls lost)"),
        || async {
            let now = d.open_descriptors();
            (now <= allowed).then_some(now)
        },
    )
    .await;
    assert!(
        busy > 0,
        "no add was refused as Busy: the cap did not apply"
    );
    let sim = d.sim.display().to_string();
    println!(
        "pressure: {waves} wave(s) of 700 adds from open pipes + 4 FIFOs against a limit of \
         {CHILD_NOFILE}: {busy} refused Busy, {timed_out} TimedOut, {bus_refused} calls refused by the bus \
         (LimitsExceeded), {lost} calls never answered, {claims} claims made and released ({cleaning} \
         refused while the GPU was being cleaned), {tasks} split tasks, {hooks} hook \
         calls under pressure, peak {peak} descriptors \
         (baseline {baseline}, after {settled}), slowest rescan+claim+release {slowest:?}, \
         answered after each wave ({sim})"
    );
}

impl Daemon {
    fn child_alive(&self) -> bool {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), None).is_ok()
            && !std::fs::read_to_string(format!("/proc/{}/stat", self.pid()))
                .map(|s| s.contains(") Z "))
                .unwrap_or(true)
    }
}

/// Issue 24 (1): once its bus connection failed, vfiod stayed up and answered nobody. Kill its
/// bus: it exits non-zero within seconds, for systemd to start it again.
async fn a_vfiod_that_loses_its_bus_exits_non_zero() {
    let mut d = Daemon::start(1024);
    let probe = common::connect(&d.bus).await;
    answers_within(&probe, Duration::from_secs(5))
        .await
        .expect("vfiod answers");
    drop(probe);
    let bus_pid = children_named(d.pid(), "dbus-daemon")
        .into_iter()
        .next()
        .expect("the private dbus-daemon of vfiod --simulate");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(bus_pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let deadline = Instant::now() + common::HUNG;
    let status = loop {
        if let Some(s) = d.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "vfiod stays up without its bus: {:#?}",
            d.log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success(), "{status:?}");
    assert!(
        !d.log_lines("connection to the bus is lost").is_empty(),
        "{:#?}",
        d.log.lock().unwrap()
    );
    println!("bus lost: vfiod exited with {status}");
}

/// Issue 24 (1), the limit really reached: with 64 descriptors (soft and hard), a flood of
/// adds from open pipes can use up what vfiod has left between the bus's queue and its own.
/// Whatever gives way, vfiod is never up and deaf: after the flood it answers, or it has exited
/// non-zero (for systemd to restart it). Each try is bounded, and the whole only against a hung
/// test (common::HUNG): "within 5 s, answering within 1 s" raced a loaded machine.
async fn out_of_descriptors_it_answers_or_exits_never_deaf() {
    let mut d = Daemon::start(64);
    let probe = common::connect(&d.bus).await;
    answers_within(&probe, common::HUNG)
        .await
        .expect("vfiod answers before the flood");
    let mut writers = Vec::new();
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..700usize {
        let (r, w) = std::io::pipe().unwrap();
        writers.push(w);
        let conn = probe.clone();
        calls.spawn(async move {
            let Ok(p) = images(&conn).await else { return };
            let (name, digest) = (format!("flood{i}"), "0".repeat(64));
            let add = p.add(&name, zbus::Fd::from(&r), &digest, common::dict(&[]));
            // Any answer, or none: the bus itself may give way.
            let _ = tokio::time::timeout(Duration::from_secs(10), add).await;
        });
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let peak = d.open_descriptors();
    drop(writers);
    while calls.join_next().await.is_some() {}
    drop(probe);
    let deadline = Instant::now() + common::HUNG;
    let outcome = loop {
        if let Some(status) = d.child.try_wait().unwrap() {
            assert!(
                !status.success(),
                "vfiod exited with success under the flood"
            );
            break format!("exited with {status}: {:?}", d.log_lines("ERROR"));
        }
        if let Ok(conn) = tokio::time::timeout(
            Duration::from_secs(10),
            zbus::connection::Builder::address(d.bus.as_str()).build(),
        )
        .await
        .unwrap_or_else(|_| Err(zbus::Error::Failure("no connection within 10 s".into())))
        {
            if let Ok(took) = answers_within(&conn, Duration::from_secs(10)).await {
                break format!("answered within {took:?}");
            }
        }
        assert!(
            Instant::now() < deadline,
            "vfiod is up but answers nobody {:?} after the flood: {:#?}",
            common::HUNG,
            d.log_lines("")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!("out of descriptors (limit 64, peak {peak}): vfiod {outcome}");
}

/// Issue 24 (1): nothing raised the soft limit (1,024 by default, with a far higher hard one).
/// Started with a soft limit of 64 and a hard one of 4,096, vfiod runs with 4,096.
fn vfiod_raises_its_soft_descriptor_limit_to_the_hard_one() {
    let d = Daemon::start_with(64, 4096);
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", d.pid())).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .to_string();
    let numbers: Vec<&str> = line.split_whitespace().skip(3).take(2).collect();
    assert_eq!(numbers, ["4096", "4096"], "{line}");
    println!(
        "descriptor limit: started with 64/4096, vfiod runs with {}",
        numbers.join("/")
    );
}

/// Pids of the live children of `parent` whose command is `comm`.
fn children_named(parent: i32, comm: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...
        let Some((name, rest)) = stat.split_once(") ") else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if name.ends_with(&format!("({comm}"))
            && fields.get(1) == Some(&parent.to_string().as_str())
        {
            out.push(pid);
        }
    }
    out
}

/// Issue 24 (1): a sysfs read that failed with EMFILE made every device `broken`. This binary
/// again, as a child (a lowered limit must not meet the other checks' threads): it scans the
/// simulated host, uses up its descriptors, scans again.
fn sysfs_read_out_of_descriptors_marks_nothing_broken() {
    let out = Command::new(std::env::current_exe().unwrap())
        .env(SCAN_CHILD, "1")
        .output()
        .expect("run the scan child");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("scan child: "), "{text}");
    print!("{}", String::from_utf8_lossy(&out.stdout));
}

fn scan_child() {
    use vfiod::model::device::State;
    use vfiod::sim::kernel::{HostModel, SimKernel};
    let dir = tempfile::tempdir().unwrap();
    let kernel = SimKernel::build(&dir.path().join("root"), &HostModel::reference()).unwrap();
    let sysfs = kernel.sysfs();
    let settings = vfiod::config::Settings::default();
    let first = vfiod::inventory::scan(&sysfs, &settings, &BTreeMap::new()).unwrap();
    assert!(first.len() > 10, "{}", first.len());
    assert!(first.iter().all(|d| d.state != State::Broken));
    let previous: BTreeMap<_, _> = first.iter().map(|d| (d.address, d.clone())).collect();

    // Every descriptor taken: the limit lowered to what is open, the rest filled.
    let open_now = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    nix::sys::resource::setrlimit(
        nix::sys::resource::Resource::RLIMIT_NOFILE,
        open_now + 16,
        open_now + 1024,
    )
    .unwrap();
    let mut hog = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => hog.push(f),
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(
        std::fs::File::open("/dev/null").unwrap_err().raw_os_error() == Some(libc::EMFILE),
        "the descriptors are used up"
    );
    // The bus listing itself may fail (a directory to open): an error of the pass, not of any
    // device. When the listing works, every read fails with EMFILE: nothing changes.
    let starved = vfiod::inventory::scan(&sysfs, &settings, &previous);
    match &starved {
        Ok(devices) => {
            let broken: Vec<_> = devices
                .iter()
                .filter(|d| d.state == State::Broken)
                .map(|d| d.address.to_string())
                .collect();
            assert!(broken.is_empty(), "marked broken by EMFILE: {broken:?}");
            assert_eq!(
                devices, &first,
                "a device changed while sysfs could not be read"
            );
        }
        Err(e) => assert_eq!(e.errno(), Some(libc::EMFILE), "{e}"),
    }
    // Some descriptors back: the listing works, the reads of the functions may not all.
    hog.truncate(hog.len().saturating_sub(3));
    let partial = vfiod::inventory::scan(&sysfs, &settings, &previous).unwrap();
    assert!(partial.iter().all(|d| d.state != State::Broken));
    assert_eq!(partial, first);
    drop(hog);
    let after = vfiod::inventory::scan(&sysfs, &settings, &previous).unwrap();
    assert_eq!(after, first);
    println!(
        "scan child: {} functions kept their state with no descriptor left (the pass: {})",
        first.len(),
        match starved {
            Ok(_) => "read nothing, changed nothing".to_string(),
            Err(e) => format!("failed as a whole: {}", vfiod::error_chain(&e)),
        }
    );
}
