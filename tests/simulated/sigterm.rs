//! SIGTERM ends the real `vfiod --simulate --sim-root DIR` within a few seconds whatever it is
//! doing, and after a SIGKILL at such a moment it starts again on the same simulated host:
//! during a storm of SIGHUP reloads of a large configuration (swapped now and then for a FIFO,
//! which the loader must refuse rather than block on), during a running 64-VF split, and while
//! an inventory read blocks.

use crate::common;

use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vfiod::sim::bus::PrivateBus;

const NIC: &str = "0000:3b:00.0";
const BUS_NAME: &str = "org.vfiod.Vfiod1";

/// How long vfiod may take to end after SIGTERM.
const TERM_BOUND: Duration = Duration::from_secs(5);
/// How long a (debug, loaded machine) start may take.
const START_BOUND: Duration = Duration::from_secs(60);

/// The NIC and the FPGA selected, private scenario: nothing is converted at start.
const CONFIG: &str = "scenario = \"private\"\npoll_interval = 3600\n\
                      [[select]]\nid = \"8086:1572\"\n\
                      [[select]]\nclass = \"0x12\"\nkind = \"fpga\"\n";

/// [`CONFIG`] and `n` selectors that match nothing: a file that takes the loader a while.
fn large_config(n: usize) -> String {
    let mut c = CONFIG.to_string();
    for i in 0..n {
        c.push_str(&format!("[[select]]\nid = \"1234:{i:04x}\"\n"));
    }
    c
}

/// The daemon under test, killed (SIGKILL) and reaped whatever happens to the test.
struct Daemon {
    child: Option<Child>,
    log: PathBuf,
}

impl Daemon {
    fn pid(&self) -> Pid {
        Pid::from_raw(self.child.as_ref().expect("running").id() as i32)
    }

    fn signal(&self, s: Signal) {
        kill(self.pid(), s).unwrap_or_else(|e| panic!("cannot send {s} to vfiod: {e}"));
    }

    /// Whether it has ended, without reaping it: until it is reaped its pid cannot be reused, so
    /// signals sent meanwhile cannot reach another process.
    fn ended(&self) -> bool {
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
        !matches!(
            waitid(Id::Pid(self.pid()), flags),
            Ok(WaitStatus::StillAlive)
        )
    }

    fn log(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(15).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    /// Reaps it; its exit status.
    fn reap(&mut self) -> std::process::ExitStatus {
        self.child.take().expect("running").wait().unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One simulated host (its directory, the configuration file, a private bus) that vfiod is
/// started on, stopped and started again.
struct Host {
    dir: tempfile::TempDir,
    bus: PrivateBus,
    starts: usize,
}

impl Host {
    fn new(config: &str) -> Host {
        let dir = common::fast_tempdir();
        std::fs::write(dir.path().join("vfiod.toml"), config).unwrap();
        let bus = PrivateBus::start(&dir.path().join("bus"), "").unwrap();
        Host {
            dir,
            bus,
            starts: 0,
        }
    }

    fn config_path(&self) -> PathBuf {
        self.dir.path().join("vfiod.toml")
    }

    /// Puts `text` in place of the configuration, whatever is there now: writing through the
    /// name would block for ever on a FIFO the storm left there.
    fn replace_config(&self, text: &str) {
        let tmp = self.config_path().with_extension("toml.new");
        let _ = std::fs::remove_file(&tmp);
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.config_path()).unwrap();
    }

    fn sim_root(&self) -> PathBuf {
        self.dir.path().join("sim/root")
    }

    /// Starts vfiod and waits until it serves its name.
    async fn start(&mut self) -> (Daemon, zbus::Connection) {
        self.starts += 1;
        let log = self.dir.path().join(format!("vfiod-{}.log", self.starts));
        let child = Command::new(env!("CARGO_BIN_EXE_vfiod"))
            .args(["--simulate", "--sim-root"])
            .arg(self.dir.path().join("sim"))
            .arg("--config")
            .arg(self.config_path())
            .args(["--bus", self.bus.address()])
            .env("VFIOD_LOG", "info")
            .env_remove("VFIOD_TEST_KILL_AT_STEP")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start vfiod");
        let daemon = Daemon {
            child: Some(child),
            log,
        };
        let conn = zbus::connection::Builder::address(self.bus.address())
            .build()
            .await
            .unwrap();
        let deadline = Instant::now() + START_BOUND;
        loop {
            let ping = conn
                .call_method(
                    Some(BUS_NAME),
                    "/org/vfiod/Vfiod1",
                    Some("org.freedesktop.DBus.Peer"),
                    "Ping",
                    &(),
                )
                .await;
            if ping.is_ok() {
                break;
            }
            assert!(
                !daemon.ended(),
                "vfiod ended while starting:\n{}",
                daemon.log()
            );
            assert!(
                Instant::now() < deadline,
                "vfiod did not start within {START_BOUND:?}:\n{}",
                daemon.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        (daemon, conn)
    }
}

/// Sends SIGTERM and waits for the end; fails if it takes more than [`TERM_BOUND`] or vfiod
/// does not exit 0. `what` says what it was doing.
async fn terminate(mut daemon: Daemon, what: &str, busy: impl FnOnce()) {
    daemon.signal(Signal::SIGTERM);
    let sent = Instant::now();
    while !daemon.ended() {
        if sent.elapsed() > TERM_BOUND {
            busy();
            panic!(
                "vfiod still runs {TERM_BOUND:?} after SIGTERM {what}; its log ends:\n{}",
                daemon.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    busy();
    let took = sent.elapsed();
    let status = daemon.reap();
    assert!(
        status.success(),
        "vfiod ended with {status} after SIGTERM {what}:\n{}",
        daemon.log()
    );
    eprintln!("sigterm: ended {took:?} after SIGTERM {what}");
}

/// The configuration reload events so far (accepted or rejected), from the store's history.
async fn reloads(conn: &zbus::Connection) -> usize {
    let Ok(m) = vfiod::client::manager(conn).await else {
        return 0;
    };
    let query = vfiod::client::query(vec![("limit", Some(zbus::Variant::from(10_000u32)))]);
    match m.get_events(query).await {
        Ok(events) => events
            .iter()
            .map(vfiod::client::EventEntry::from_dict)
            .filter(|e| e.message.starts_with("configuration reload"))
            .count(),
        Err(_) => 0,
    }
}

/// A thread that sends SIGHUP to vfiod every few milliseconds, and every few signals swaps the
/// configuration between the large file and a FIFO nobody writes, until stopped.
struct Storm {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Storm {
    fn start(pid: Pid, config: PathBuf, text: String) -> Storm {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicUsize::new(0));
        let (s, n) = (Arc::clone(&stop), Arc::clone(&sent));
        let thread = std::thread::spawn(move || {
            let tmp = config.with_extension("toml.new");
            let mut i = 0usize;
            while !s.load(Ordering::SeqCst) {
                if i % 8 == 4 {
                    let _ = std::fs::remove_file(&tmp);
                    nix::unistd::mkfifo(&tmp, nix::sys::stat::Mode::from_bits_truncate(0o600))
                        .unwrap();
                    std::fs::rename(&tmp, &config).unwrap();
                } else if i.is_multiple_of(8) {
                    std::fs::write(&tmp, &text).unwrap();
                    std::fs::rename(&tmp, &config).unwrap();
                }
                // The pid is not reused while vfiod is unreaped, and the test reaps it only
                // after this thread has stopped.
                if kill(pid, Signal::SIGHUP).is_err() {
                    return;
                }
                n.fetch_add(1, Ordering::SeqCst);
                i += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        Storm {
            stop,
            sent,
            thread: Some(thread),
        }
    }

    fn stop(&mut self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().expect("the storm thread");
        }
        self.sent.load(Ordering::SeqCst)
    }
}

impl Drop for Storm {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Lets a storm run until vfiod has handled `at_least` reloads (accepted and refused ones), or
/// for `within` at most (a reload stuck on the FIFO would handle no more: SIGTERM must end vfiod
/// all the same). Returns how many it handled.
async fn storm_for(
    conn: &zbus::Connection,
    daemon: &Daemon,
    at_least: usize,
    within: Duration,
) -> usize {
    let before = reloads(conn).await;
    let deadline = Instant::now() + within;
    loop {
        let handled = reloads(conn).await - before;
        if handled >= at_least || Instant::now() >= deadline {
            return handled;
        }
        assert!(
            !daemon.ended(),
            "vfiod died in the storm:\n{}",
            daemon.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A SIGHUP storm over a configuration that takes the loader about a second, swapped now and
/// then for a FIFO: SIGTERM in the middle ends vfiod within 5 s; so does one after a restart;
/// and after a SIGKILL in the middle of another storm, vfiod starts again on the same host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_sighup_reload_storm() {
    let text = large_config(1500);
    let mut host = Host::new(&text);
    let (daemon, conn) = host.start().await;
    let mut storm = Storm::start(daemon.pid(), host.config_path(), text.clone());
    // At least 4 reloads handled in the storm: waited for with a deadline that only ends a
    // hung test (it was 20 s, which a loaded machine could miss at a second per reload).
    let handled = storm_for(&conn, &daemon, 4, common::HUNG).await;
    terminate(daemon, "during a SIGHUP storm", || {
        let sent = storm.stop();
        eprintln!("sigterm: {sent} SIGHUPs sent, {handled} reloads handled");
    })
    .await;
    assert!(
        handled >= 4,
        "only {handled} reloads were handled in {:?} of SIGHUP storm",
        common::HUNG
    );

    // Restart on the same host (the storm may have left the configuration a FIFO).
    host.replace_config(&text);
    let (mut daemon, conn) = host.start().await;
    let mut storm = Storm::start(daemon.pid(), host.config_path(), text.clone());
    storm_for(&conn, &daemon, 2, Duration::from_secs(20)).await;
    daemon.signal(Signal::SIGKILL);
    let deadline = Instant::now() + TERM_BOUND;
    while !daemon.ended() {
        assert!(Instant::now() < deadline, "SIGKILL did not end vfiod");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    storm.stop();
    daemon.reap();

    host.replace_config(CONFIG);
    let (daemon, conn) = host.start().await;
    let tasks = vfiod::client::manager(&conn)
        .await
        .unwrap()
        .get_tasks(vfiod::client::query(vec![]))
        .await
        .expect("the restarted vfiod answers");
    assert!(
        tasks.is_empty(),
        "reloads of this configuration start no task"
    );
    terminate(daemon, "after a restart", || {}).await;
}

/// The kernel's view of the NIC in the simulated host's files: (sriov_numvfs, virtfnN links).
fn nic_in_files(root: &Path) -> (u32, usize) {
    let dev = root.join("sys/bus/pci/devices").join(NIC);
    let numvfs = std::fs::read_to_string(dev.join("sriov_numvfs"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let links = std::fs::read_dir(&dev)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().starts_with("virtfn"))
        })
        .count();
    (numvfs, links)
}

/// Starts a 64-VF split of the NIC over D-Bus and returns once its task runs.
async fn split_running(conn: &zbus::Connection) -> zbus::OwnedObjectPath {
    let nic = vfiod::client::device(conn, NIC).await.unwrap();
    let path = nic
        .set_mode("vf", vfiod::client::mode_options(Some(64)))
        .await
        .expect("the split starts");
    let task = vfiod::client::task(conn, path.clone()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state = task.state().await.unwrap();
        match state.as_str() {
            "running" => return path,
            "prepare" => {}
            other => panic!("the split ended ({other}) before it was seen running"),
        }
        assert!(Instant::now() < deadline, "the split never ran");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// After a stop in the middle of a split: the restarted vfiod shows the task ended (success, or
/// error "interrupted" until reset) and the NIC as the kernel has it; reset if needed.
async fn after_the_split(conn: &zbus::Connection, root: &Path, context: &str) -> String {
    let tasks = vfiod::client::manager(conn)
        .await
        .unwrap()
        .get_tasks(vfiod::client::query(vec![]))
        .await
        .unwrap();
    let last = vfiod::client::TaskEntry::from_dict(tasks.first().expect("the split's task"));
    let (numvfs, links) = nic_in_files(root);
    assert_eq!(
        numvfs as usize, links,
        "{context}: the kernel is never half-split"
    );
    let shown = vfiod::client::show_device(conn, NIC).await.unwrap();
    assert_eq!(
        shown.num_vfs, numvfs,
        "{context}: the store re-read the NIC"
    );
    match last.state.as_str() {
        "success" => {}
        "error" => {
            assert!(last.result.contains("interrupted"), "{context}: {last:?}");
            let nic = vfiod::client::device(conn, NIC).await.unwrap();
            nic.reset_task().await.unwrap();
            // The reset brings the NIC back to its configured mode with a task of its own:
            // wait for it to end before anything else asks for the NIC.
            common::eventually_async(
                Duration::from_secs(60),
                "the task the reset started ends",
                || async {
                    let shown = vfiod::client::show_device(conn, NIC).await.unwrap();
                    shown.current_task.is_none().then_some(())
                },
            )
            .await;
        }
        other => panic!("{context}: the split's task is {other} after a restart: {last:?}"),
    }
    last.state
}

/// SIGTERM while a 64-VF split runs ends vfiod within 5 s; a SIGKILL while one runs leaves a
/// host that vfiod starts on again, with the task ended and the NIC consistent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_running_split() {
    let mut host = Host::new(CONFIG);
    let root = host.sim_root();
    let (daemon, conn) = host.start().await;
    split_running(&conn).await;
    terminate(daemon, "during a running split", || {}).await;
    let (daemon, conn) = host.start().await;
    let outcome = after_the_split(&conn, &root, "after SIGTERM").await;
    eprintln!("sigterm: the split stopped by SIGTERM ended in {outcome}");
    // From PF mode again for the next split.
    if nic_in_files(&root).0 != 0 {
        let nic = vfiod::client::device(&conn, NIC).await.unwrap();
        let t = nic
            .set_mode("pf", vfiod::client::mode_options(None))
            .await
            .unwrap();
        let t = vfiod::client::task(&conn, t).await.unwrap();
        let (state, result) = vfiod::client::wait_task(&t, |_, _| {}).await.unwrap();
        assert_eq!(state, "success", "{result}");
    }

    split_running(&conn).await;
    let mut daemon = daemon;
    daemon.signal(Signal::SIGKILL);
    while !daemon.ended() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    daemon.reap();
    let (daemon, conn) = host.start().await;
    let outcome = after_the_split(&conn, &root, "after SIGKILL").await;
    eprintln!("sigterm: the split stopped by SIGKILL ended in {outcome}");
    terminate(daemon, "after a restart", || {}).await;
}

/// A sysfs read that blocks (here a device's `uevent` made a FIFO nobody writes, as a read of
/// a wedged device's attribute can block on a real kernel) holds an inventory pass on a
/// blocking thread. SIGTERM must still end vfiod within 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_an_inventory_read_blocks() {
    let mut host = Host::new(CONFIG);
    let (daemon, conn) = host.start().await;
    let fifo = host
        .sim_root()
        .join("sys/bus/pci/devices/0000:d8:00.0/uevent");
    std::fs::remove_file(&fifo).unwrap();
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    // A rescan reads every function; it blocks on the FIFO (the call gets no reply).
    let rescan = tokio::spawn(async move {
        let m = vfiod::client::manager(&conn).await.unwrap();
        let _ = m.rescan().await;
    });
    // vfiod is blocked in the read once the FIFO has a reader: opening its write end without
    // blocking succeeds only then. Held open (and never written), the read stays blocked.
    let deadline = Instant::now() + Duration::from_secs(30);
    let writer = loop {
        use std::os::unix::fs::OpenOptionsExt;
        match std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
        {
            Ok(w) => break w,
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
                assert!(Instant::now() < deadline, "vfiod never read the FIFO");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("cannot open the FIFO: {e}"),
        }
    };
    terminate(daemon, "while an inventory read blocks", || {}).await;
    drop(writer);
    rescan.abort();
}

/// systemd starts vfiod as `Type=dbus` (started once it owns its name) and reloads it with
/// `kill -HUP $MAINPID`: a SIGHUP as soon as the name appears must reload, not kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sighup_as_soon_as_the_name_appears_reloads_rather_than_kills() {
    let mut killed = Vec::new();
    for attempt in 0..5 {
        let mut host = Host::new(CONFIG);
        host.starts += 1;
        let log = host.dir.path().join("vfiod.log");
        let child = Command::new(env!("CARGO_BIN_EXE_vfiod"))
            .args(["--simulate", "--sim-root"])
            .arg(host.dir.path().join("sim"))
            .arg("--config")
            .arg(host.config_path())
            .args(["--bus", host.bus.address()])
            .env("VFIOD_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start vfiod");
        let daemon = Daemon {
            child: Some(child),
            log,
        };
        let conn = zbus::connection::Builder::address(host.bus.address())
            .build()
            .await
            .unwrap();
        let bus = zbus::fdo::DBusProxy::new(&conn).await.unwrap();
        let name = zbus::names::BusName::try_from(BUS_NAME).unwrap();
        let deadline = Instant::now() + START_BOUND;
        // As systemd sees it: started the moment the name has an owner.
        while !bus.name_has_owner(name.clone()).await.unwrap() {
            assert!(
                !daemon.ended(),
                "vfiod ended while starting:\n{}",
                daemon.log()
            );
            assert!(Instant::now() < deadline, "vfiod did not start");
        }
        daemon.signal(Signal::SIGHUP);
        // Answered after the reload, or refused because the process is gone.
        let m = vfiod::client::manager(&conn).await;
        let alive = match m {
            Ok(m) => m.get_tasks(vfiod::client::query(vec![])).await.is_ok(),
            Err(_) => false,
        };
        if !alive || daemon.ended() {
            killed.push(attempt);
            continue;
        }
        terminate(daemon, "after a SIGHUP at start", || {}).await;
    }
    assert!(
        killed.is_empty(),
        "a SIGHUP right after the name appeared killed vfiod in attempts {killed:?} of 5"
    );
}
