//! Issue 33's soak: the real `vfiod --simulate` on a private bus under the soak's traffic
//! (claims, releases, libvirt hook runs, mode changes, applies, reloads, rescans, reads from
//! several callers at once), with the faults of issue 33 mixed in from a seeded RNG between
//! bursts:
//!
//! - item 3: the write-ahead log removed while vfiod runs (then claims), SIGKILL and restart,
//!   the log of a killed vfiod cut to half or 512 bytes of it flipped before the restart (the
//!   start must keep every acknowledged claim or refuse naming the lost ones; then
//!   `--accept-store-loss`);
//! - item 5: a PF's mode task with `Clean` asked on its VFs meanwhile (refused `Busy`);
//! - item 6: hook runs whose deadline passes while vfiod is stopped (SIGSTOP, then SIGCONT);
//! - item 7: SIGKILL part-way through a restore, restart, the operator's reset, claims at once;
//! - item 8: `prepare`, `release`, `prepare` of a domain at once.
//!
//! After each fault, once no task is in flight, it checks against the simulated kernel's sysfs
//! and the SQLite file (not the daemon's word only): store, kernel and D-Bus agree on every
//! function (the invariants of `tests/soak.rs`); no two tasks whose functions meet ran at once;
//! no acknowledged claim is lost (every claim answered OK is there unless released with an OK,
//! or named in a refusal to start that the operator then accepted); every claimed function is on
//! the driver its record says; no claim exists for a VM whose start was refused (also at its
//! deadline). Every claim acknowledged is also checked at once: its functions are on the driver
//! their records say.
//!
//! `cargo test --features test-hooks --test soak_faults` runs it for 75 s; longer:
//! `VFIOD_SOAK_FAULTS_SECS=3600 cargo test --release --features test-hooks --test soak_faults`.
//! It prints its seed; `VFIOD_SOAK_FAULTS_SEED=N` replays a run's choices (the daemon's own
//! timing is not replayed). The concurrent traffic restores and re-splits PFs while others claim
//! their VFs; `VFIOD_SOAK_FAULTS_RESTORE_RACE=0` leaves that out (see [`restore_race`]).

#[path = "common/mod.rs"]
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use vfiod::host::sysfs::Sysfs;
use vfiod::model::pci::PciAddress;
use vfiod::sim::bus::PrivateBus;

/// The NIC (X710) and the FPGA, both split by the policy.
const NIC: &str = "0000:3b:00.0";
const FPGA: &str = "0000:af:00.0";
/// A start of a debug build on a loaded machine.
const SLOW: Duration = Duration::from_secs(120);

const CONFIG: &str = "scenario = \"private\"\npoll_interval = 5\nlibvirt_uri = \"\"\n\
     [[select]]\nid = \"8086:1572\"\nmode = \"vf\"\nnum_vfs = 8\n\
     [[select]]\nclass = \"0x12\"\nkind = \"fpga\"\nmode = \"vf\"\nnum_vfs = 4\n";

/// xorshift64*, as `tests/soak.rs`: reproducible from the printed seed.
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
    fn pick<'a, T>(&self, items: &'a [T]) -> Option<&'a T> {
        (!items.is_empty()).then(|| &items[self.below(items.len() as u64) as usize])
    }
}

/// What the soak was told, against which the files are checked.
#[derive(Default)]
struct Model {
    /// Claims answered OK and not released with an OK: id -> (VM, address).
    acked: BTreeMap<u64, (String, String)>,
    /// VMs whose `prepare` was refused (also at its deadline): never a claim for them.
    refused: BTreeSet<String>,
    /// Claims held right after an accepted store loss: the loss may have brought back a claim
    /// released before it, so they are outside the refused-VM check.
    baseline: BTreeSet<u64>,
    /// Domains whose `prepare` was answered OK and not released yet: their functions.
    up: BTreeMap<String, Vec<String>>,
    next_vm: u64,
    claims_ok: usize,
    releases_ok: usize,
    prepares_ok: usize,
    prepares_refused: usize,
    busy_refusals: usize,
    cleans_accepted_during_pf_task: usize,
}

impl Model {
    fn vm(&mut self, prefix: &str) -> String {
        self.next_vm += 1;
        format!("{prefix}-{}", self.next_vm)
    }
}

/// The simulated host, its bus and the daemon on it.
struct Host {
    /// Kept when the soak fails, for its logs and files (the path is printed).
    dir: Option<tempfile::TempDir>,
    _bus: PrivateBus,
    bus: String,
    daemon: Option<Child>,
    starts: usize,
}

/// How a start ended: serving, or exited (a refusal) with its status and log.
enum Start {
    Serving,
    Exited(std::process::ExitStatus, String),
}

impl Drop for Host {
    fn drop(&mut self) {
        if let Some(mut c) = self.daemon.take() {
            let pid = nix::unistd::Pid::from_raw(c.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            if let Some(d) = self.dir.take() {
                eprintln!(
                    "soak_faults: the host, the store and vfiod's logs kept in {}",
                    d.keep().display()
                );
            }
        }
    }
}

impl Host {
    fn new() -> Host {
        let dir = common::fast_tempdir();
        std::fs::write(dir.path().join("vfiod.toml"), CONFIG).unwrap();
        let bus = PrivateBus::start(&dir.path().join("bus"), "").unwrap();
        let host = Host {
            bus: bus.address().to_string(),
            _bus: bus,
            dir: Some(dir),
            daemon: None,
            starts: 0,
        };
        // The hook reads vfiod's state directory (its socket) and the deadlines; the second
        // one looks for the socket where there is none, so it asks on the bus.
        for (name, state, deadlines) in [
            (
                "hook.toml",
                host.state(),
                "deadline_ms = 10000\nnotify_deadline_ms = 5000\n",
            ),
            (
                "hook-socket-short.toml",
                host.state(),
                "deadline_ms = 1000\nnotify_deadline_ms = 500\n",
            ),
            (
                "hook-bus-short.toml",
                host.dir().join("no-socket-here"),
                "deadline_ms = 1000\nnotify_deadline_ms = 500\n",
            ),
        ] {
            std::fs::write(
                host.dir().join(name),
                format!(
                    "state_dir = \"{}\"\n{CONFIG}[hooks]\n{deadlines}",
                    state.display()
                ),
            )
            .unwrap();
        }
        host
    }

    fn dir(&self) -> &std::path::Path {
        self.dir.as_ref().expect("the soak's directory").path()
    }
    fn root(&self) -> PathBuf {
        self.dir().join("sim/root")
    }
    fn state(&self) -> PathBuf {
        self.dir().join("sim/state")
    }
    fn db(&self) -> PathBuf {
        self.state().join(vfiod::store::DB_FILE_NAME)
    }
    fn wal(&self) -> PathBuf {
        self.state()
            .join(format!("{}-wal", vfiod::store::DB_FILE_NAME))
    }
    fn log(&self) -> PathBuf {
        self.dir().join(format!("vfiod-{}.log", self.starts))
    }
    fn log_text(&self) -> String {
        std::fs::read_to_string(self.log()).unwrap_or_default()
    }
    fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(self.daemon.as_ref().expect("vfiod runs").id() as i32)
    }

    fn try_start(&mut self, args: &[&str], pause_clean: bool) -> Start {
        assert!(self.daemon.is_none());
        self.starts += 1;
        let mut c = Command::new(env!("CARGO_BIN_EXE_vfiod"));
        c.args(["--simulate", "--sim-root"])
            .arg(self.dir().join("sim"))
            .arg("--config")
            .arg(self.dir().join("vfiod.toml"))
            .args(["--bus", &self.bus])
            .args(args)
            .env("VFIOD_LOG", "info")
            .env_remove("VFIOD_TEST_KILL_AT_STEP")
            .env_remove("VFIOD_TEST_KILL_AT")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.log()).unwrap());
        // Item 8's window held open (a clean that gave its functions back, not ended yet).
        if pause_clean {
            c.env("VFIOD_TEST_PAUSE_AT", "clean:given-back");
        } else {
            c.env_remove("VFIOD_TEST_PAUSE_AT");
        }
        let mut child = c.spawn().expect("start vfiod");
        let deadline = Instant::now() + SLOW;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return Start::Exited(status, self.log_text());
            }
            if self.ctl(&["status"]).0 {
                self.daemon = Some(child);
                return Start::Serving;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "vfiod neither serves nor exits within {SLOW:?}:\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn start(&mut self, args: &[&str], pause_clean: bool) {
        if let Start::Exited(status, log) = self.try_start(args, pause_clean) {
            panic!("vfiod exited during its start ({status}):\n{log}");
        }
    }

    fn kill(&mut self) {
        let mut c = self.daemon.take().expect("vfiod runs");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGCONT,
        );
        c.kill().unwrap();
        c.wait().unwrap();
    }

    fn stop(&mut self) {
        let mut c = self.daemon.take().expect("vfiod runs");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = c.try_wait().unwrap() {
                break s;
            }
            assert!(
                Instant::now() < deadline,
                "SIGTERM did not end vfiod:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "{status}:\n{}", self.log_text());
    }

    fn ctl(&self, args: &[&str]) -> (bool, String) {
        common::vfioctl(&self.bus, args)
    }

    /// Runs the hook as libvirt does (`vfiod-qemu-hook`), with `config` (a file in the soak's
    /// directory): (exit code, stderr).
    fn hook(&self, config: &str, args: &[&str], xml: &str) -> (i32, String) {
        use std::io::Write;
        let mut child = Command::new(env!("CARGO_BIN_EXE_vfiod-qemu-hook"))
            .args(args)
            .env("VFIOD_BUS", &self.bus)
            .env("VFIOD_CONFIG", self.dir().join(config))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let _ = child.stdin.take().unwrap().write_all(xml.as_bytes());
        let out = child.wait_with_output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// The SQLite file, read-only (a reader never checkpoints nor writes the mark).
    fn sql(&self) -> rusqlite::Connection {
        let c = rusqlite::Connection::open_with_flags(
            self.db(),
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .expect("open vfiod.db read-only");
        // The pragma, not `busy_timeout()`: that one needs a newer libsqlite3 than the system's.
        c.pragma_update(None, "busy_timeout", 10_000).unwrap();
        c
    }

    /// Active claims in the file: id -> (VM, address).
    fn claims_in_file(&self) -> BTreeMap<u64, (String, String)> {
        let c = self.sql();
        let mut q = c
            .prepare(
                "SELECT id, COALESCE(vm_name, ''), address FROM claims \
                 WHERE state IN ('claimed', 'attached')",
            )
            .unwrap();
        q.query_map([], |r| {
            Ok((r.get::<_, i64>(0)? as u64, (r.get(1)?, r.get(2)?)))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect()
    }

    /// Every function an active claim holds: (claim id, address).
    fn claimed_functions(&self) -> Vec<(u64, String)> {
        let c = self.sql();
        let mut q = c
            .prepare(
                "SELECT f.claim_id, f.address FROM claim_functions f JOIN claims c \
                 ON c.id = f.claim_id WHERE f.active = 1 AND c.state IN ('claimed', 'attached')",
            )
            .unwrap();
        q.query_map([], |r| Ok((r.get::<_, i64>(0)? as u64, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    /// The driver each function's record says.
    fn recorded_drivers(&self) -> BTreeMap<String, Option<String>> {
        let c = self.sql();
        let mut q = c.prepare("SELECT address, driver FROM devices").unwrap();
        q.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    fn kernel_driver(&self, address: &str) -> Option<String> {
        let a: PciAddress = address.parse().unwrap();
        Sysfs::host(self.root())
            .read_function(a)
            .ok()
            .and_then(|f| f.driver)
    }

    /// A PF's VFs as the kernel has them.
    fn vfs(&self, pf: &str) -> Vec<String> {
        let dev = self.root().join("sys/bus/pci/devices").join(pf);
        (0..64)
            .filter_map(|i| std::fs::read_link(dev.join(format!("virtfn{i}"))).ok())
            .filter_map(|t| Some(t.file_name()?.to_str()?.to_string()))
            .collect()
    }

    fn wal_len(&self) -> u64 {
        std::fs::metadata(self.wal()).map(|m| m.len()).unwrap_or(0)
    }
}

fn hostdev(a: &str, guest_bus: u8) -> String {
    let p: PciAddress = a.parse().unwrap();
    format!(
        "<hostdev mode='subsystem' type='pci' managed='no'>\
         <source><address domain='0x{:04x}' bus='0x{:02x}' slot='0x{:02x}' function='0x{:x}'/></source>\
         <address type='pci' domain='0x0000' bus='0x{guest_bus:02x}' slot='0x00' function='0x0'/>\
         </hostdev>",
        p.domain, p.bus, p.slot, p.function
    )
}

fn domain_xml(name: &str, devices: &[String]) -> String {
    let hostdevs: String = devices
        .iter()
        .enumerate()
        .map(|(i, a)| hostdev(a, 7 + i as u8))
        .collect();
    format!(
        "<domain type='kvm'><name>{name}</name><memory>65536</memory>\
         <devices><disk type='file' device='disk'><source file='/x.qcow2'/><target dev='vda'/></disk>\
         {hostdevs}</devices></domain>"
    )
}

/// The claim just acknowledged for these functions: each is on the driver its record says,
/// in the simulated kernel's files (checked at once, while others keep calling).
fn check_handed_out(host: &Host, what: &str, functions: &[String]) {
    let records = host.recorded_drivers();
    for f in functions {
        let kernel = host.kernel_driver(f);
        let tasks = || {
            tasks_in_file(host)
                .into_iter()
                .filter(|t| t.scope.contains(f))
                .map(|t| {
                    format!(
                        "task {} {} on {}: {} {}",
                        t.id, t.kind, t.address, t.state, t.message
                    )
                })
                .collect::<Vec<_>>()
        };
        assert!(
            records.contains_key(f),
            "{what}: {f} was handed out with no record in vfiod.db (driver {kernel:?} in \
             sysfs; tasks on it: {:?})",
            tasks()
        );
        let recorded = records.get(f).cloned().flatten();
        assert_eq!(
            kernel, recorded,
            "{what}: {f} was handed out on driver {kernel:?}, its record says {recorded:?}"
        );
        assert_eq!(
            kernel.as_deref(),
            Some("vfio-pci"),
            "{what}: {f} was handed out without vfio-pci (tasks on it: {:?})",
            tasks()
        );
    }
}

/// `vfioctl claim`: the acknowledged claim, recorded in the model and checked at once.
fn claim(host: &Host, model: &Mutex<Model>, args: &[&str]) -> Option<u64> {
    let vm = model.lock().unwrap().vm("c");
    let mut full = vec!["claim", "--vm", &vm, "--json"];
    full.extend_from_slice(args);
    let (ok, out) = host.ctl(&full);
    if !ok {
        return None;
    }
    let c: serde_json::Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("vfioctl claim answered OK with no claim ({e}): {out}"));
    let id = c["id"].as_u64().unwrap();
    let address = c["address"].as_str().unwrap().to_string();
    let functions: Vec<String> = c["functions"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|f| Some(f.as_str()?.to_string()))
                .collect()
        })
        .unwrap_or_else(|| vec![address.clone()]);
    {
        let mut m = model.lock().unwrap();
        m.acked.insert(id, (vm.clone(), address));
        m.claims_ok += 1;
    }
    check_handed_out(host, &format!("claim {id} for {vm}"), &functions);
    Some(id)
}

/// `vfioctl release ID`. The claim leaves the acknowledged set first: a release cut off by a
/// fault may have happened or not.
fn release(host: &Host, model: &Mutex<Model>, id: u64) -> bool {
    model.lock().unwrap().acked.remove(&id);
    let ok = host.ctl(&["release", &id.to_string()]).0;
    if ok {
        model.lock().unwrap().releases_ok += 1;
    }
    ok
}

/// `prepare` of a new domain with `functions`: up on OK, refused otherwise.
fn prepare(
    host: &Host,
    model: &Mutex<Model>,
    config: &str,
    vm: &str,
    functions: &[String],
) -> (i32, String) {
    let xml = domain_xml(vm, functions);
    let (code, err) = host.hook(config, &[vm, "prepare", "begin", "-"], &xml);
    let mut m = model.lock().unwrap();
    if code == 0 {
        m.prepares_ok += 1;
        m.up.insert(vm.to_string(), functions.to_vec());
    } else {
        m.prepares_refused += 1;
        if err.contains("is busy") {
            m.busy_refusals += 1;
        }
        m.refused.insert(vm.to_string());
    }
    drop(m);
    if code == 0 {
        // A function the kernel no longer has (a restore removed the VF since the soak listed
        // it) is not vfiod's to refuse: libvirt fails that start itself, and stops the domain.
        let gone = functions
            .iter()
            .any(|f| !host.root().join("sys/bus/pci/devices").join(f).exists());
        if gone {
            stop_domain(host, model, vm);
            return (code, err);
        }
        check_handed_out(host, &format!("prepare of {vm}"), functions);
    }
    (code, err)
}

/// `stopped` and `release` of a running domain: (release's code, its stderr).
fn stop_domain(host: &Host, model: &Mutex<Model>, vm: &str) -> (i32, String) {
    let Some(functions) = model.lock().unwrap().up.remove(vm) else {
        return (0, String::new());
    };
    let xml = domain_xml(vm, &functions);
    let _ = host.hook("hook.toml", &[vm, "stopped", "end", "-"], &xml);
    host.hook("hook.toml", &[vm, "release", "end", "-"], &xml)
}

/// Whether the traffic restores and re-splits PFs while others claim their VFs: on unless
/// `VFIOD_SOAK_FAULTS_RESTORE_RACE=0`. It found (seed 1796665768741365169) a restore's task
/// ending before the inventory pass recorded its VFs removed, and a claim in between handed out
/// a VF the kernel no longer had ("claim 146 for c-221: 0000:af:00.2 was handed out on driver
/// None, its record says Some(\"vfio-pci\")"); a task's pass now runs before its end is
/// recorded (`tests/simulated/vf_gap.rs`).
fn restore_race() -> bool {
    std::env::var("VFIOD_SOAK_FAULTS_RESTORE_RACE").map_or(true, |v| v != "0")
}

/// One random call of the traffic.
fn random_call(host: &Host, model: &Mutex<Model>, rng: &Rng) {
    let pf = if rng.below(2) == 0 { NIC } else { FPGA };
    match rng.below(16) {
        0..=3 => {
            let args: &[&str] = match rng.below(3) {
                0 => &["--vf"],
                1 => &["--vf", "--parent", NIC],
                _ => &["--vf", "--parent", FPGA],
            };
            claim(host, model, args);
        }
        4 | 5 => {
            let ids: Vec<u64> = model.lock().unwrap().acked.keys().copied().collect();
            if let Some(id) = rng.pick(&ids) {
                release(host, model, *id);
            }
        }
        6 | 7 => {
            // A domain started through the hook with one or two VFs of a PF, unclaimed when
            // the soak looks (another caller may take them meanwhile: a refusal then).
            let held: BTreeSet<String> = host
                .claims_in_file()
                .into_values()
                .map(|(_, a)| a)
                .collect();
            let vfs: Vec<String> = host
                .vfs(pf)
                .into_iter()
                .filter(|v| !held.contains(v))
                .collect();
            let mut chosen: Vec<String> = Vec::new();
            for _ in 0..1 + rng.below(2) {
                if let Some(v) = rng.pick(&vfs) {
                    if !chosen.contains(v) {
                        chosen.push(v.clone());
                    }
                }
            }
            if !chosen.is_empty() {
                let vm = model.lock().unwrap().vm("h");
                prepare(host, model, "hook.toml", &vm, &chosen);
            }
        }
        8 => {
            let up: Vec<String> = model.lock().unwrap().up.keys().cloned().collect();
            if let Some(vm) = rng.pick(&up) {
                stop_domain(host, model, vm);
            }
        }
        // Restores and re-splits while others claim (unless VFIOD_SOAK_FAULTS_RESTORE_RACE=0;
        // then an apply, which leaves the split).
        9 if restore_race() => {
            let vfs = (1 + rng.below(8)).to_string();
            let _ = host.ctl(&["mode", pf, "vf", "--vfs", &vfs]);
        }
        10 if restore_race() => {
            let _ = host.ctl(&["mode", pf, "pf"]);
        }
        9 | 10 => {
            let _ = host.ctl(&["task", "start", pf, "apply"]);
        }
        11 => {
            let _ = host.ctl(&["task", "start", pf, "apply"]);
        }
        12 => {
            let _ = host.ctl(&["reload"]);
        }
        13 => {
            let _ = host.ctl(&["rescan"]);
        }
        14 => {
            let _ = host.ctl(&["list", "--json"]);
        }
        _ => {
            let vfs = host.vfs(pf);
            if let Some(v) = rng.pick(&vfs) {
                let _ = host.ctl(&["show", v, "--json"]);
            }
        }
    }
}

/// A burst of `width` concurrent callers for `length`.
fn burst(host: &Host, model: &Mutex<Model>, rng: &Rng, width: usize, length: Duration) -> usize {
    let until = Instant::now() + length;
    let calls = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..width {
            s.spawn(|| {
                while Instant::now() < until {
                    random_call(host, model, rng);
                    calls.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    });
    calls.load(Ordering::Relaxed) as usize
}

/// One task row.
struct TaskRow {
    id: i64,
    address: String,
    kind: String,
    state: String,
    message: String,
    reset: bool,
    started: Option<i64>,
    finished: Option<i64>,
    scope: BTreeSet<String>,
}

fn tasks_in_file(host: &Host) -> Vec<TaskRow> {
    let c = host.sql();
    let mut scopes: BTreeMap<i64, BTreeSet<String>> = BTreeMap::new();
    let mut q = c
        .prepare("SELECT task_id, address FROM task_scope")
        .unwrap();
    for r in q
        .query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))
        .unwrap()
    {
        let (id, a) = r.unwrap();
        scopes.entry(id).or_default().insert(a);
    }
    let mut q = c
        .prepare(
            "SELECT id, address, kind, state, message, reset_ms IS NOT NULL, started_ms, \
             finished_ms FROM tasks ORDER BY id",
        )
        .unwrap();
    q.query_map([], |r| {
        let id: i64 = r.get(0)?;
        let address: String = r.get(1)?;
        let mut scope = scopes.remove(&id).unwrap_or_default();
        scope.insert(address.clone());
        Ok(TaskRow {
            id,
            address,
            kind: r.get(2)?,
            state: r.get(3)?,
            message: r.get(4)?,
            reset: r.get(5)?,
            started: r.get(6)?,
            finished: r.get(7)?,
            scope,
        })
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

/// Waits until no task is in flight, resets the tasks a kill interrupted (as an operator
/// would), fails on any other task in error; then brings a PF left whole back to its split.
fn settle(host: &Host, round: usize) {
    for pass in 0..3 {
        let deadline = Instant::now() + SLOW;
        loop {
            let tasks = tasks_in_file(host);
            let busy = tasks
                .iter()
                .any(|t| t.state == "prepare" || t.state == "running");
            let held: Vec<&TaskRow> = tasks
                .iter()
                .filter(|t| t.state == "error" && !t.reset)
                .collect();
            if !busy {
                for t in &held {
                    assert!(
                        t.message.contains("interrupted"),
                        "round {round}: task {} {} on {} failed while it ran: {}\nvfiod's log:\n{}",
                        t.id,
                        t.kind,
                        t.address,
                        t.message,
                        host.log_text()
                    );
                    let _ = host.ctl(&["task", "reset", &t.address]);
                }
                if held.is_empty() {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: tasks still in flight after {SLOW:?}: {:?}",
                tasks
                    .iter()
                    .filter(|t| t.state == "prepare" || t.state == "running")
                    .map(|t| (t.id, &t.kind, &t.address))
                    .collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        // A PF a restore left whole: split again (once nothing holds it).
        let mut started = false;
        for pf in [NIC, FPGA] {
            if host.vfs(pf).is_empty() && pass < 2 {
                started |= host.ctl(&["task", "start", pf, "apply"]).0;
            }
        }
        if !started {
            return;
        }
    }
}

/// The invariants, against sysfs and the SQLite file.
fn check(host: &Host, model: &Mutex<Model>, round: usize, runtime: &tokio::runtime::Runtime) {
    settle(host, round);
    assert!(host.ctl(&["rescan"]).0, "round {round}: rescan");
    let m = model.lock().unwrap();
    // Store, kernel and D-Bus agree on every function (tests/soak.rs).
    let sysfs = Sysfs::host(host.root());
    let records = host.recorded_drivers();
    let in_kernel = sysfs.list_functions().unwrap();
    assert_eq!(
        records.len(),
        in_kernel.len(),
        "round {round}: store and kernel disagree on the functions present"
    );
    let bus = host.bus.clone();
    let on_bus: BTreeMap<String, vfiod::client::DeviceView> = runtime.block_on(async {
        let conn = common::connect(&bus).await;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let listed = vfiod::client::list_devices(&conn).await.unwrap();
            if listed.iter().all(|d| d.task_state == "idle") || Instant::now() >= deadline {
                break listed.into_iter().map(|d| (d.address.clone(), d)).collect();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    assert_eq!(
        records.len(),
        on_bus.len(),
        "round {round}: store and D-Bus"
    );
    for a in in_kernel {
        let raw = sysfs.read_function(a).unwrap();
        let key = a.to_string();
        assert_eq!(
            records.get(&key).cloned().flatten(),
            raw.driver,
            "round {round}: {a}: the record's driver is not the kernel's"
        );
        let b = &on_bus[&key];
        assert_eq!(b.driver, raw.driver, "round {round}: {a} on D-Bus");
        assert_eq!(b.task_state, "idle", "round {round}: {a} on D-Bus");
    }
    // No two tasks whose functions meet ran at once (a PF's task covers its VFs: item 5).
    let tasks = tasks_in_file(host);
    for (i, a) in tasks.iter().enumerate() {
        for b in &tasks[i + 1..] {
            let (Some(sa), Some(sb)) = (a.started, b.started) else {
                continue;
            };
            let (fa, fb) = (
                a.finished.unwrap_or(i64::MAX),
                b.finished.unwrap_or(i64::MAX),
            );
            let meet = a.scope.intersection(&b.scope).next();
            if let Some(f) = meet {
                assert!(
                    !(sa < fb && sb < fa),
                    "round {round}: tasks {} {} on {} and {} {} on {} both held {f} at once \
                     ({sa}..{fa} and {sb}..{fb}): {:?} / {:?}",
                    a.id,
                    a.kind,
                    a.address,
                    b.id,
                    b.kind,
                    b.address,
                    a.message,
                    b.message
                );
            }
        }
    }
    // No acknowledged claim lost.
    let held = host.claims_in_file();
    for (id, (vm, address)) in &m.acked {
        assert_eq!(
            held.get(id),
            Some(&(vm.clone(), address.clone())),
            "round {round}: claim {id} of {vm} on {address} was acknowledged, never released \
             with an OK, and is not in vfiod.db: an acknowledged claim lost\nvfiod's log:\n{}",
            host.log_text()
        );
    }
    // A running domain still holds each of its functions.
    for (vm, functions) in &m.up {
        for f in functions {
            assert!(
                held.values().any(|(v, a)| v == vm && a == f),
                "round {round}: {vm}'s prepare was answered OK, it was not released, and no \
                 claim holds {f} for it"
            );
        }
    }
    // Every claimed function is on the driver its record says.
    for (id, f) in host.claimed_functions() {
        let kernel = host.kernel_driver(&f);
        assert_eq!(
            kernel,
            records.get(&f).cloned().flatten(),
            "round {round}: claim {id} holds {f}, on driver {kernel:?} in sysfs"
        );
        assert_eq!(
            kernel.as_deref(),
            Some("vfio-pci"),
            "round {round}: claim {id} holds {f}, not on vfio-pci"
        );
    }
    // No claim for a VM whose start was refused.
    for (id, (vm, address)) in &held {
        assert!(
            !m.refused.contains(vm) || m.baseline.contains(id),
            "round {round}: claim {id} holds {address} for {vm}, whose start was refused\n\
             vfiod's log:\n{}",
            host.log_text()
        );
    }
}

/// Ids a refusal to start names as lost: "claim N" and "claims A to B".
fn named_lost_claims(refusal: &str) -> BTreeSet<u64> {
    let mut ids = BTreeSet::new();
    let words: Vec<&str> = refusal
        .split(|c: char| c.is_whitespace() || c == ',' || c == ';' || c == ':')
        .filter(|w| !w.is_empty())
        .collect();
    for (i, w) in words.iter().enumerate() {
        let n = |k: usize| words.get(i + k).and_then(|w| w.parse::<u64>().ok());
        if *w == "claim" {
            ids.extend(n(1));
        } else if *w == "claims" && words.get(i + 2) == Some(&"to") {
            if let (Some(a), Some(b)) = (n(1), n(3)) {
                ids.extend(a..=b);
            }
        }
    }
    ids
}

/// Starts vfiod after a kill that may have left a damaged log: either it serves with every
/// acknowledged claim, or it refuses naming each one it lacks; then `--accept-store-loss`.
fn start_after_damage(host: &mut Host, model: &Mutex<Model>, what: &str, pause: bool) {
    match host.try_start(&[], pause) {
        Start::Serving => {}
        Start::Exited(status, log) => {
            assert_eq!(status.code(), Some(1), "{what}: {status}:\n{log}");
            assert!(
                log.contains("lacks changes vfiod acknowledged")
                    && log.contains("--accept-store-loss"),
                "{what}: vfiod exited without naming a loss:\n{log}"
            );
            let named = named_lost_claims(&log);
            host.start(&["--accept-store-loss"], pause);
            let held = host.claims_in_file();
            let mut m = model.lock().unwrap();
            for (id, (vm, address)) in &m.acked {
                assert!(
                    held.contains_key(id) || named.contains(id),
                    "{what}: claim {id} of {vm} on {address} was acknowledged, is lost, and \
                     the refusal does not name it:\n{log}"
                );
            }
            println!("  {what}: refused, naming the loss; started with --accept-store-loss");
            // From here the file is what the operator accepted.
            m.acked.retain(|id, _| held.contains_key(id));
            m.baseline = held.keys().copied().collect();
            let up: Vec<String> = m.up.keys().cloned().collect();
            for vm in up {
                if !held.values().any(|(v, _)| *v == vm) {
                    m.up.remove(&vm);
                }
            }
        }
    }
}

/// Releases every claim on `pf`'s VFs, so that its restore may run.
fn free_pf(host: &Host, model: &Mutex<Model>, pf: &str, round: usize) {
    let vfs = host.vfs(pf);
    for (id, (vm, address)) in host.claims_in_file() {
        if vfs.contains(&address) {
            release(host, model, id);
            model.lock().unwrap().up.remove(&vm);
        }
    }
    // The cleans the releases started end first.
    settle(host, round);
}

/// Waits until a task holds `pf` (its restore started), or gives up after a while.
fn pf_task_running(host: &Host, pf: &str) -> bool {
    tasks_in_file(host)
        .iter()
        .any(|t| t.address == pf && (t.state == "prepare" || t.state == "running"))
}

/// One fault, chosen by the RNG. Returns its name.
fn fault(host: &mut Host, model: &Mutex<Model>, rng: &Rng) -> &'static str {
    let pause = rng.below(4) == 0;
    match rng.below(9) {
        0 => {
            host.kill();
            host.start(&[], pause);
            "SIGKILL, restart"
        }
        1 => {
            host.stop();
            host.start(&[], pause);
            "SIGTERM, restart"
        }
        2 => {
            // Item 3: the log removed while vfiod runs, then claims acknowledged.
            let _ = std::fs::remove_file(host.wal());
            for _ in 0..2 {
                claim(host, model, &["--vf"]);
            }
            if rng.below(2) == 0 {
                host.kill();
            } else {
                host.stop();
            }
            host.start(&[], pause);
            "the log removed while vfiod runs, claims, restart"
        }
        3 => {
            // Item 3: the log of a killed vfiod damaged before the restart.
            for _ in 0..2 {
                claim(host, model, &["--vf"]);
            }
            host.kill();
            let len = host.wal_len();
            if len > 4096 {
                if rng.below(2) == 0 {
                    std::fs::OpenOptions::new()
                        .write(true)
                        .open(host.wal())
                        .unwrap()
                        .set_len(len / 2)
                        .unwrap();
                } else {
                    let mut bytes = std::fs::read(host.wal()).unwrap();
                    let mid = bytes.len() / 2;
                    bytes[mid..mid + 512].iter_mut().for_each(|b| *b = !*b);
                    std::fs::write(host.wal(), bytes).unwrap();
                }
            }
            start_after_damage(host, model, "damaged log", pause);
            "the log damaged after SIGKILL, restart"
        }
        4 => {
            // Item 5: a PF's restore, and Clean asked on its VFs meanwhile.
            let pf = if rng.below(2) == 0 { NIC } else { FPGA };
            free_pf(host, model, pf, 0);
            let vfs = host.vfs(pf);
            if !host.ctl(&["mode", pf, "pf"]).0 {
                return "a PF's restore (refused) with Clean on its VFs";
            }
            let answers: Vec<(String, bool, bool, String)> = std::thread::scope(|s| {
                let handles: Vec<_> = vfs
                    .iter()
                    .map(|vf| {
                        s.spawn(|| {
                            let during = pf_task_running(host, pf);
                            let (ok, out) = host.ctl(&["clean", vf]);
                            (vf.clone(), during, ok, out)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (vf, during, ok, out) in answers {
                if ok && during {
                    model.lock().unwrap().cleans_accepted_during_pf_task += 1;
                }
                if !ok {
                    // Refused: Busy while the PF's task runs, or the VF is gone with it.
                    assert!(
                        out.contains("org.vfiod.Vfiod1.Error.Busy")
                            || out.contains("org.vfiod.Vfiod1.Error.NoSuchDevice")
                            || out.contains("Unknown object"),
                        "Clean of {vf} during {pf}'s restore refused for another cause: {out}"
                    );
                }
            }
            "a PF's restore with Clean on its VFs"
        }
        5 => {
            // Item 6: hook runs whose deadline passes while vfiod is stopped.
            let vfs = host.vfs(NIC);
            let config = if rng.below(2) == 0 {
                "hook-bus-short.toml"
            } else {
                "hook-socket-short.toml"
            };
            nix::sys::signal::kill(host.pid(), nix::sys::signal::Signal::SIGSTOP).unwrap();
            let mut ghosts = Vec::new();
            for _ in 0..1 + rng.below(3) {
                let Some(vf) = rng.pick(&vfs) else { break };
                let vm = model.lock().unwrap().vm("ghost");
                let xml = domain_xml(&vm, std::slice::from_ref(vf));
                let (code, err) = host.hook(config, &[&vm, "prepare", "begin", "-"], &xml);
                assert_ne!(
                    code, 0,
                    "{vm}: prepare answered OK while vfiod is stopped: {err}"
                );
                {
                    let mut m = model.lock().unwrap();
                    m.refused.insert(vm.clone());
                    m.prepares_refused += 1;
                }
                if rng.below(2) == 0 {
                    let (code, err) = host.hook(config, &[&vm, "release", "end", "-"], &xml);
                    assert_eq!(code, 0, "{vm}: a release passes: {err}");
                }
                ghosts.push(vm);
            }
            nix::sys::signal::kill(host.pid(), nix::sys::signal::Signal::SIGCONT).unwrap();
            if config == "hook-bus-short.toml" {
                // The bus kept the calls for vfiod: it logs its answer to each prepare, carried
                // out or not. (On the hook socket a hook that gave up closed its connection
                // before vfiod's handshake: vfiod never gets the call.)
                common::eventually_blocking(SLOW, "vfiod answers the queued prepares", || {
                    let log = host.log_text();
                    ghosts
                        .iter()
                        .all(|vm| log.contains(&format!("prepare begin - of {vm}:")))
                        .then_some(())
                });
            }
            "hook runs given up on while vfiod was stopped"
        }
        6 => {
            // Item 7: SIGKILL part-way through a restore, restart, then claims at once.
            let pf = if rng.below(2) == 0 { NIC } else { FPGA };
            free_pf(host, model, pf, 0);
            let started = host.ctl(&["mode", pf, "pf"]).0;
            std::thread::sleep(Duration::from_millis(rng.below(300)));
            host.kill();
            host.start(&[], pause);
            // The records say what sysfs says, before any reset.
            let records = host.recorded_drivers();
            let busy: BTreeSet<String> = tasks_in_file(host)
                .into_iter()
                .filter(|t| t.state == "prepare" || t.state == "running")
                .flat_map(|t| t.scope)
                .collect();
            for vf in host.vfs(pf) {
                if !busy.contains(&vf) {
                    assert_eq!(
                        records.get(&vf).cloned().flatten(),
                        host.kernel_driver(&vf),
                        "after a kill during {pf}'s restore: {vf}'s record is not sysfs"
                    );
                }
            }
            let _ = host.ctl(&["task", "reset", pf]);
            for _ in 0..2 {
                claim(host, model, &["--vf", "--parent", pf]);
            }
            if started {
                "SIGKILL during a restore, restart, reset, claims"
            } else {
                "SIGKILL (the restore was refused), restart, claims"
            }
        }
        7 => {
            // Item 8: a domain started, released and started again at once.
            let (_, out) = host.ctl(&["find", "--vf", "--parent", NIC]);
            let free: Vec<String> = out
                .lines()
                .filter_map(|l| l.split_whitespace().next())
                .filter(|a| a.starts_with("0000:3b:"))
                .map(str::to_string)
                .take(2)
                .collect();
            if free.len() < 2 {
                return "a domain restarted at once (no two free VFs)";
            }
            let vm = model.lock().unwrap().vm("again");
            let (code, err) = prepare(host, model, "hook.toml", &vm, &free);
            assert_eq!(
                code, 0,
                "{vm}: the first start on free VFs is refused: {err}"
            );
            let xml = domain_xml(&vm, &free);
            let (_, _) = host.hook("hook.toml", &[&vm, "started", "begin", "-"], &xml);
            let (code, released) = stop_domain(host, model, &vm);
            assert_eq!(code, 0, "{vm}: release: {released}");
            model.lock().unwrap().refused.remove(&vm);
            let (code, err) = prepare(host, model, "hook.toml", &vm, &free);
            assert_eq!(
                code,
                0,
                "{vm}: the start at once after its release is refused: {err}\nvfiod's log:\n{}",
                host.log_text()
            );
            "a domain started, released and started again at once"
        }
        _ => {
            // A restart while the hook's domains run: then stop some of them.
            host.kill();
            host.start(&[], pause);
            let up: Vec<String> = model.lock().unwrap().up.keys().cloned().collect();
            for vm in up.iter().take(2) {
                stop_domain(host, model, vm);
            }
            "SIGKILL, restart, domains stopped"
        }
    }
}

fn main() {
    // As a libtest binary would: nothing under `--ignored` (the root-only run) or `--list`,
    // nor for a name filter that does not match this soak.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    if args.iter().any(|a| a == "--ignored" || a == "--list")
        || (!filters.is_empty() && !filters.iter().any(|f| "soak_faults".contains(f.as_str())))
    {
        println!("soak_faults: not run (filtered out)");
        return;
    }
    let secs: u64 = std::env::var("VFIOD_SOAK_FAULTS_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(75);
    let seed: u64 = std::env::var("VFIOD_SOAK_FAULTS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    println!("soak_faults: {secs} s, VFIOD_SOAK_FAULTS_SEED={seed}");
    let rng = Rng(AtomicU64::new(seed));
    let model = Mutex::new(Model::default());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut host = Host::new();
    host.start(&[], false);
    let deadline = Instant::now() + Duration::from_secs(secs);
    let (mut rounds, mut calls) = (0usize, 0usize);
    let mut faults: BTreeMap<&'static str, usize> = BTreeMap::new();
    while Instant::now() < deadline {
        rounds += 1;
        check(&host, &model, rounds, &runtime);
        let width = 2 + rng.below(4) as usize;
        calls += burst(
            &host,
            &model,
            &rng,
            width,
            Duration::from_millis(1000 + rng.below(3000)),
        );
        let what = fault(&mut host, &model, &rng);
        println!("round {rounds}: {what}");
        *faults.entry(what).or_default() += 1;
    }
    check(&host, &model, rounds + 1, &runtime);
    host.stop();
    let m = model.lock().unwrap();
    println!(
        "soak_faults passed (seed {seed}): {rounds} rounds, {calls} calls; {} claims and {} \
         releases acknowledged, {} prepares answered OK, {} refused ({} busy); {} cleans \
         accepted while their PF's task was seen running; faults: {faults:?}",
        m.claims_ok,
        m.releases_ok,
        m.prepares_ok,
        m.prepares_refused,
        m.busy_refusals,
        m.cleans_accepted_during_pf_task
    );
}
