//! Soak: the real `vfiod --simulate --sim-root DIR --config FILE` under random concurrent D-Bus
//! calls (mode changes, applies, resets, reloads of a config that changes under it, rescans,
//! reads), killed with SIGKILL or stopped with SIGTERM at random moments and restarted on the
//! same simulated host and state. After each restart, once no task is in flight: the store,
//! the simulated kernel's files and the D-Bus objects agree on every device.
//!
//! It fails on: a call that takes longer than its bound (a hang), a SIGTERM that does not end the
//! daemon within 5 s, a restart that does not come up, a disagreement after a restart, or a task
//! that failed while it ran (the operator's reset is part of the soak only for tasks a SIGKILL
//! interrupted).
//!
//! `cargo test --features test-hooks --test soak` runs it for 30 s; the documented soak is
//! `VFIOD_SOAK_SECS=3600 cargo test --release --features test-hooks --test soak -- --nocapture`.
//! `VFIOD_SOAK_SEED=N` replays a run's random choices. The soak under exhaustion (descriptor
//! floods, FIFOs, claims, tasks and hooks against a vfiod with a low descriptor limit) is
//! `tests/exhaustion.rs`, `VFIOD_EXHAUST_SECS` long.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vfiod::client;
use vfiod::host::sysfs::Sysfs;
use vfiod::model::pci::PciAddress;
use vfiod::store::Store;

/// Bound of one D-Bus call: far above what any call takes (a task replies once prepared), far
/// below "hung".
const CALL_BOUND: Duration = Duration::from_secs(30);
/// The managed devices the calls aim at (and one that does not exist, and a protected one).
const TARGETS: &[&str] = &[
    "0000:17:00.0",
    "0000:17:00.1",
    "0000:3b:00.0",
    "0000:af:00.0",
    "0000:5e:00.0",
    "0000:d8:00.0",
    "0000:3d:00.0",
    "0000:99:00.0",
];

/// xorshift64*: reproducible from the printed seed, no crate needed.
struct Rng(AtomicU64);

impl Rng {
    fn next(&self) -> u64 {
        let mut x = self.0.load(Ordering::Relaxed);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0.store(x, Ordering::Relaxed);
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A config the soak rewrites between reloads: the GPU group on vfio-pci or not, the NIC split
/// into a varying number of VFs or whole, the FPGA split or not.
fn config(rng: &Rng) -> String {
    let mut c = String::from("scenario = \"private\"\npoll_interval = 5\n");
    c.push_str("[[select]]\nclass = \"0x03\"\n");
    if rng.below(2) == 0 {
        c.push_str("pf_driver = \"vfio-pci\"\n");
    }
    c.push_str("[[select]]\nid = \"10de:1aef\"\n");
    if rng.below(2) == 0 {
        c.push_str("pf_driver = \"vfio-pci\"\n");
    }
    c.push_str("[[select]]\nid = \"8086:1572\"\n");
    match rng.below(3) {
        0 => {}
        1 => c.push_str("mode = \"vf\"\nnum_vfs = 8\n"),
        _ => c.push_str(&format!("mode = \"vf\"\nnum_vfs = {}\n", 1 + rng.below(64))),
    }
    c.push_str("[[select]]\nid = \"8086:37c8\"\nkind = \"crypto\"\nmode = \"vf\"\nnum_vfs = 16\nvf_driver = \"c6xxvf\"\n");
    c.push_str("[[select]]\nclass = \"0x12\"\nkind = \"fpga\"\n");
    if rng.below(2) == 0 {
        c.push_str("mode = \"vf\"\nnum_vfs = 4\n");
    }
    c.push_str("[[select]]\nid = \"144d:a824\"\n");
    c
}

struct Daemon {
    child: Child,
    bus: String,
}

fn start(dir: &Path, config: &Path) -> Daemon {
    let mut child = Command::new(env!("CARGO_BIN_EXE_vfiod"))
        .arg("--simulate")
        .arg("--sim-root")
        .arg(dir)
        .arg("--config")
        .arg(config)
        .env("VFIOD_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start vfiod");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.trim().strip_prefix("export VFIOD_BUS='") {
                if !sent {
                    let _ = tx.send(rest.trim_end_matches('\'').to_string());
                    sent = true;
                }
            } else if line.contains("ERROR") || line.contains("panicked") {
                eprintln!("vfiod: {line}");
            }
        }
    });
    let bus = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("vfiod serves within 120 s of a (re)start");
    Daemon { child, bus }
}

fn wait_exit(child: &mut Child, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if child.try_wait().ok().flatten().is_some() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// One random call, bounded; a timeout is a failure naming the call.
async fn random_call(conn: &zbus::Connection, rng: &Rng, config_path: &Path) {
    let target = TARGETS[rng.below(TARGETS.len() as u64) as usize];
    let which = rng.below(12);
    let label = format!("call {which} on {target}");
    let call = async {
        let m = client::manager(conn).await.ok()?;
        match which {
            0 | 1 => {
                let d = client::device(conn, target).await.ok()?;
                let _ = d
                    .set_mode("vf", vfiod::client::mode_options(Some(rng.below(5) as u32)))
                    .await;
            }
            2 => {
                let d = client::device(conn, target).await.ok()?;
                let _ = d.set_mode("pf", vfiod::client::mode_options(None)).await;
            }
            3 | 4 => {
                let d = client::device(conn, target).await.ok()?;
                let _ = d.apply().await;
            }
            5 => {
                // As an operator's tools do: write aside, rename into place (a reload never
                // reads half a file; callers race here, so each has its own temporary name).
                let tmp = config_path.with_extension(format!("toml.{}", rng.next()));
                std::fs::write(&tmp, config(rng)).ok()?;
                std::fs::rename(&tmp, config_path).ok()?;
                let _ = m.reload().await;
            }
            6 => {
                let _ = m.rescan().await;
            }
            7 => {
                let _ = client::list_devices(conn).await;
            }
            8 => {
                let _ = client::show_device(conn, target).await;
            }
            9 => {
                let _ = m
                    .get_tasks(client::query(vec![("limit", Some(50u32.into()))]))
                    .await;
            }
            10 => {
                let _ = m.get_events(client::query(vec![])).await;
            }
            _ => {
                let _ = m.get_plans().await;
            }
        }
        Some(())
    };
    if tokio::time::timeout(CALL_BOUND, call).await.is_err() {
        panic!("{label} took longer than {CALL_BOUND:?}: vfiod hangs");
    }
}

/// After a restart: waits until no task is in prepare or running, resets the tasks a SIGKILL
/// interrupted (as an operator would), fails on any other task in error, rescans, and checks that
/// store, kernel files and D-Bus agree.
async fn settle_and_check(conn: &zbus::Connection, state: &Path, sysfs: &Sysfs, round: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let store = Store::open(state).expect("open the store beside the daemon");
    loop {
        let tasks = store.tasks(None, 10_000).unwrap();
        let busy = tasks.iter().any(|t| !t.state.is_final());
        let held: Vec<_> = tasks.iter().filter(|t| t.is_active()).cloned().collect();
        if !busy {
            for t in &held {
                assert!(
                    t.message.contains("interrupted"),
                    "round {round}: task {} {} on {} failed while it ran: {}",
                    t.id,
                    t.kind,
                    t.address,
                    t.message
                );
                let d = client::device(conn, &t.address.to_string()).await.unwrap();
                let _ = d.reset_task().await;
            }
            if held.is_empty() {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "round {round}: tasks still in flight after 120 s: {:?}",
            tasks
                .iter()
                .filter(|t| !t.state.is_final())
                .map(|t| (t.id, t.kind, t.state))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let m = client::manager(conn).await.unwrap();
    tokio::time::timeout(CALL_BOUND, m.rescan())
        .await
        .expect("rescan within its bound")
        .expect("rescan");
    // A task's last event may still be on its way when the store already says it ended: give
    // the bus a few seconds to show every device idle (a stale state never converges).
    let deadline = Instant::now() + Duration::from_secs(10);
    let on_bus: BTreeMap<String, client::DeviceView> = loop {
        let listed = client::list_devices(conn).await.unwrap();
        let busy: Vec<_> = listed
            .iter()
            .filter(|d| d.task_state != "idle")
            .map(|d| {
                (
                    d.address.clone(),
                    d.task_state.clone(),
                    d.current_task.clone(),
                )
            })
            .collect();
        if busy.is_empty() {
            break listed.into_iter().map(|d| (d.address.clone(), d)).collect();
        }
        if Instant::now() >= deadline {
            // What the store says of the tasks the bus shows, to tell a lost event from a
            // wrong read.
            let records: Vec<_> = busy
                .iter()
                .filter_map(|(_, _, path)| path.as_deref()?.rsplit('/').next()?.parse().ok())
                .map(|id: i64| store.task(id))
                .collect();
            panic!(
                "round {round}: the store has no task in flight, but D-Bus still shows \
                 {busy:?}; the store has {records:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let stored = store.devices().unwrap();
    let in_kernel: Vec<PciAddress> = sysfs.list_functions().unwrap();
    assert_eq!(
        stored.len(),
        in_kernel.len(),
        "round {round}: store and kernel disagree on the functions present"
    );
    assert_eq!(stored.len(), on_bus.len(), "round {round}: store and D-Bus");
    for d in &stored {
        let raw = sysfs.read_function(d.address).unwrap();
        assert_eq!(d.driver, raw.driver, "round {round}: {} driver", d.address);
        assert_eq!(
            d.num_vfs,
            raw.sriov.as_ref().map_or(0, |s| s.num_vfs),
            "round {round}: {} VFs",
            d.address
        );
        let b = &on_bus[&d.address.to_string()];
        assert_eq!(b.driver, d.driver, "round {round}: {} on D-Bus", d.address);
        assert_eq!(
            b.num_vfs, d.num_vfs,
            "round {round}: {} on D-Bus",
            d.address
        );
        assert_eq!(b.state, d.state.as_str(), "round {round}: {}", d.address);
        assert_eq!(b.task_state, "idle", "round {round}: {}", d.address);
    }
}

fn main() {
    let secs: u64 = std::env::var("VFIOD_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let seed: u64 = std::env::var("VFIOD_SOAK_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    println!("soak: {secs} s, VFIOD_SOAK_SEED={seed}");
    let rng = Arc::new(Rng(AtomicU64::new(seed)));
    let dir = tempfile::Builder::new()
        .prefix("vfiod-soak.")
        .tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .unwrap();
    let sim: PathBuf = dir.path().join("sim");
    let config_path = dir.path().join("vfiod.toml");
    std::fs::write(&config_path, config(&rng)).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let (mut rounds, mut kills, mut terms, mut calls) = (0usize, 0usize, 0usize, 0usize);
    let mut daemon = start(&sim, &config_path);
    while Instant::now() < deadline {
        rounds += 1;
        let sysfs = Sysfs::host(sim.join("root"));
        let bus = daemon.bus.clone();
        let (rng2, cfg) = (Arc::clone(&rng), config_path.clone());
        let state = sim.join("state");
        calls += runtime.block_on(async move {
            let conn = zbus::connection::Builder::address(bus.as_str())
                .build()
                .await
                .expect("connect to the simulation's bus");
            settle_and_check(&conn, &state, &sysfs, rounds).await;
            // A burst of concurrent callers for a random while.
            let burst = Duration::from_millis(1000 + rng2.below(4000));
            let until = Instant::now() + burst;
            let mut n = 0;
            while Instant::now() < until {
                let width = 4 + rng2.below(28) as usize;
                let mut set = tokio::task::JoinSet::new();
                for _ in 0..width {
                    let (c, r, p) = (conn.clone(), Arc::clone(&rng2), cfg.clone());
                    set.spawn(async move { random_call(&c, &r, &p).await });
                }
                while let Some(done) = set.join_next().await {
                    if let Err(e) = done {
                        std::panic::resume_unwind(e.into_panic());
                    }
                }
                n += width;
            }
            n
        });
        // Stop it, rudely or not, and bring it back on the same host and state.
        let pid = nix::unistd::Pid::from_raw(daemon.child.id() as i32);
        if rng.below(3) == 0 {
            terms += 1;
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
            assert!(
                wait_exit(&mut daemon.child, Duration::from_secs(5)),
                "round {rounds}: SIGTERM did not end vfiod within 5 s"
            );
        } else {
            kills += 1;
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
            let _ = daemon.child.wait();
        }
        daemon = start(&sim, &config_path);
    }
    // The last restart is checked too, then the daemon stops cleanly.
    let sysfs = Sysfs::host(sim.join("root"));
    let (bus, state) = (daemon.bus.clone(), sim.join("state"));
    runtime.block_on(async move {
        let conn = zbus::connection::Builder::address(bus.as_str())
            .build()
            .await
            .unwrap();
        settle_and_check(&conn, &state, &sysfs, rounds + 1).await;
    });
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(daemon.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(wait_exit(&mut daemon.child, Duration::from_secs(5)));
    println!(
        "soak passed: {rounds} rounds, {calls} calls, {kills} SIGKILLs, {terms} SIGTERMs, every restart consistent"
    );
}
