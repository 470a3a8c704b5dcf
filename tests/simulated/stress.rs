//! The D-Bus deadlock shape, under pressure. The issue: bursts of 49 concurrent calls on the GPU's
//! IOMMU group (Reload, Apply and SetMode on 0000:17:00.0 and 0000:17:00.1, with
//! Properties.GetAll and GetManagedObjects mixed in), the group selected onto vfio-pci and back
//! between rounds, hung the daemon in 2 of about 20 rounds: every call timed out, Peer.Ping too.
//!
//! Each round rewrites the configuration (the group's `pf_driver = "vfio-pci"` lines in or out),
//! fires such a burst from several client connections, each call under its own bound, then waits
//! until no task is active and checks that sysfs, the store and D-Bus agree on the group's drivers
//! and tasks. A call over its bound fails the test naming the call, the round and the tasks that
//! are stuck; a watchdog thread ends the process with the same report should the test's own
//! runtime be stuck too.
//!
//! `VFIOD_STRESS_ROUNDS` sets the number of rounds (a soak: a few thousand).

use crate::common;

use crate::common::{addr, eventually, eventually_async, prop_str, Harness, Props, STEADY_CONFIG};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use vfiod::store::{TaskRecord, TaskState, REFUSED_BY};
use zbus::OwnedObjectPath;

const GPU: &str = "0000:17:00.0";
const AUDIO: &str = "0000:17:00.1";
const NATIVE: [(&str, &str); 2] = [(GPU, "nouveau"), (AUDIO, "snd_hda_intel")];

const BUS_NAME: &str = "org.vfiod.Vfiod1";
const ROOT: &str = "/org/vfiod/Vfiod1";
const MANAGER: &str = "org.vfiod.Vfiod1.Manager";
const DEVICE: &str = "org.vfiod.Vfiod1.Device";
const TASK: &str = "org.vfiod.Vfiod1.Task";
const PROPERTIES: &str = "org.freedesktop.DBus.Properties";

/// Rounds by default: about 75 s on an idle 2-core machine, under 3 minutes on a busy one.
const ROUNDS: usize = 200;
/// Client connections the calls of a round are spread over.
const CLIENTS: usize = 4;
/// The most one call may take. A call takes milliseconds; a loaded machine may make it seconds;
/// a deadlock makes it for ever.
const CALL_BOUND: Duration = Duration::from_secs(30);
/// The most a round may take before the watchdog thread gives up on the test's own runtime.
const WATCHDOG_BOUND: Duration = Duration::from_secs(180);

fn rounds() -> usize {
    std::env::var("VFIOD_STRESS_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(ROUNDS)
}

fn device_path(a: &str) -> String {
    vfiod::dbus::device_path(addr(a)).to_string()
}

/// What a call in a burst is.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Reload,
    Apply(&'static str),
    SetMode(&'static str),
    GetAll(&'static str),
    ManagerGetAll,
    GetManagedObjects,
    GetTasks,
    Ping,
}

/// The 49 calls of a burst: mutating calls on both functions of the group, mixed with the reads
/// that wait on every object (GetManagedObjects) or on one (GetAll), and Ping.
fn burst() -> Vec<Kind> {
    let mut calls = Vec::new();
    for _ in 0..4 {
        calls.push(Kind::Reload);
    }
    for a in [GPU, AUDIO] {
        for _ in 0..5 {
            calls.push(Kind::Apply(a));
            calls.push(Kind::SetMode(a));
            calls.push(Kind::GetAll(a));
        }
    }
    for _ in 0..2 {
        calls.push(Kind::ManagerGetAll);
        calls.push(Kind::GetTasks);
    }
    for _ in 0..6 {
        calls.push(Kind::GetManagedObjects);
    }
    for _ in 0..5 {
        calls.push(Kind::Ping);
    }
    assert_eq!(calls.len(), 49);
    // Interleaved, so that the kinds reach the daemon mixed rather than in blocks.
    let mut mixed = Vec::with_capacity(calls.len());
    let stride = 7;
    for start in 0..stride {
        mixed.extend(calls.iter().skip(start).step_by(stride).copied());
    }
    mixed
}

type Reply = Pin<Box<dyn Future<Output = zbus::Result<zbus::Message>> + Send>>;

fn send(conn: &zbus::Connection, kind: Kind) -> Reply {
    let c = conn.clone();
    Box::pin(async move {
        let root = Some(BUS_NAME);
        match kind {
            Kind::Reload => {
                c.call_method(root, ROOT, Some(MANAGER), "Reload", &())
                    .await
            }
            Kind::Apply(a) => {
                c.call_method(root, device_path(a).as_str(), Some(DEVICE), "Apply", &())
                    .await
            }
            Kind::SetMode(a) => {
                let path = device_path(a);
                c.call_method(
                    root,
                    path.as_str(),
                    Some(DEVICE),
                    "SetMode",
                    &("pf", vfiod::dbus::wire::Dict::new()),
                )
                .await
            }
            Kind::GetAll(a) => {
                let path = device_path(a);
                c.call_method(root, path.as_str(), Some(PROPERTIES), "GetAll", &(DEVICE,))
                    .await
            }
            Kind::ManagerGetAll => {
                c.call_method(root, ROOT, Some(PROPERTIES), "GetAll", &(MANAGER,))
                    .await
            }
            Kind::GetManagedObjects => {
                let om = "org.freedesktop.DBus.ObjectManager";
                c.call_method(root, ROOT, Some(om), "GetManagedObjects", &())
                    .await
            }
            Kind::GetTasks => {
                let query = (vfiod::dbus::wire::Dict::new(),);
                c.call_method(root, ROOT, Some(MANAGER), "GetTasks", &query)
                    .await
            }
            Kind::Ping => {
                let peer = "org.freedesktop.DBus.Peer";
                c.call_method(root, ROOT, Some(peer), "Ping", &()).await
            }
        }
    })
}

/// The D-Bus error name of a refused call.
fn error_name(e: &zbus::Error) -> Option<String> {
    match e {
        zbus::Error::MethodError(name, _, _) => Some(name.to_string()),
        zbus::Error::FDO(e) => Some(zbus::DBusError::name(&**e).to_string()),
        _ => None,
    }
}

/// The latest tasks, read from the store file through a connection of its own (the daemon's
/// store handle may be what is stuck): "task N KIND on ADDRESS: STATE (step, percent)", the
/// unfinished ones marked.
fn tasks_in_store(db: &std::path::Path) -> String {
    let read = || -> rusqlite::Result<Vec<String>> {
        let c = rusqlite::Connection::open(db)?;
        let mut stmt = c.prepare(
            "SELECT id, address, kind, state, step, percent, reset_ms IS NULL FROM tasks \
             ORDER BY id DESC LIMIT 6",
        )?;
        let rows = stmt.query_map([], |r| {
            let state: String = r.get(3)?;
            let unfinished = state == "prepare"
                || state == "running"
                || (state == "error" && r.get::<_, bool>(6)?);
            Ok(format!(
                "{}task {} {} on {}: {} (step {:?}, {}%)",
                if unfinished { "UNFINISHED " } else { "" },
                r.get::<_, i64>(0)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(1)?,
                state,
                r.get::<_, String>(4)?,
                r.get::<_, i64>(5)?,
            ))
        })?;
        rows.collect()
    };
    match read() {
        Ok(t) if t.is_empty() => "no task".into(),
        Ok(t) => t.join("; "),
        Err(e) => format!("cannot read the store: {e}"),
    }
}

/// The latest tasks as D-Bus shows them through a fresh connection: GetTasks (read from the
/// store) and each task object's State (read from the view the publisher feeds), so that a
/// publisher that stopped shows as objects behind the store. Bounded: it may be stuck as well.
async fn tasks_over_dbus(h: &Harness) -> String {
    let bound = Duration::from_secs(5);
    let conn = match tokio::time::timeout(
        bound,
        zbus::connection::Builder::address(h.bus.address()).build(),
    )
    .await
    {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return format!("cannot connect: {e}"),
        Err(_) => return "connecting timed out".into(),
    };
    let ask = async {
        let m = vfiod::client::manager(&conn)
            .await
            .map_err(|e| zbus::Error::Failure(e.to_string()))?;
        m.get_tasks(vfiod::client::query(vec![(
            "limit",
            Some(zbus::Variant::from(6u32)),
        )]))
        .await
    };
    let list = match tokio::time::timeout(bound, ask).await {
        Err(_) => return "GetTasks on a fresh connection timed out too".into(),
        Ok(Err(e)) => return format!("GetTasks on a fresh connection failed: {e}"),
        Ok(Ok(list)) => list,
    };
    let mut out = Vec::new();
    for t in list.iter().map(vfiod::client::TaskEntry::from_dict) {
        let path = vfiod::dbus::task::task_path(t.id);
        let shown = tokio::time::timeout(
            bound,
            conn.call_method(
                Some(BUS_NAME),
                path.as_str(),
                Some(PROPERTIES),
                "Get",
                &(TASK, "State"),
            ),
        )
        .await;
        let object = match shown {
            Err(_) => "no reply".to_string(),
            Ok(Err(e)) => e.to_string(),
            Ok(Ok(m)) => m
                .body()
                .deserialize::<zbus::OwnedVariant>()
                .ok()
                .and_then(|v| String::try_from(v).ok())
                .unwrap_or_default(),
        };
        out.push(format!(
            "task {} {} on {}: {} ({}, {}%), its object says {object}",
            t.id, t.kind, t.address, t.state, t.step, t.percent
        ));
    }
    out.join("; ")
}

/// A thread that ends the process with a report when the test stops making progress: the
/// per-call bounds need the test's runtime to run, and this does not.
struct Watchdog {
    beat: Option<mpsc::Sender<usize>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    fn start(db: std::path::PathBuf) -> Watchdog {
        let (beat, beats) = mpsc::channel::<usize>();
        let thread = std::thread::spawn(move || {
            let mut round = 0;
            loop {
                match beats.recv_timeout(WATCHDOG_BOUND) {
                    Ok(r) => round = r,
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        eprintln!(
                            "stress watchdog: round {round} made no progress for {WATCHDOG_BOUND:?} \
                             (the test's runtime is stuck); latest tasks: {}",
                            tasks_in_store(&db)
                        );
                        std::process::abort();
                    }
                }
            }
        });
        Watchdog {
            beat: Some(beat),
            thread: Some(thread),
        }
    }

    fn beat(&self, round: usize) {
        if let Some(b) = &self.beat {
            let _ = b.send(round);
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.beat.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn task_id(path: &OwnedObjectPath) -> i64 {
    path.as_str()
        .rsplit('/')
        .next()
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("not a task path: {path}"))
}

async fn get_all(h: &Harness, path: &str, iface: &str) -> Props {
    let reply = tokio::time::timeout(
        CALL_BOUND,
        h.client
            .call_method(Some(BUS_NAME), path, Some(PROPERTIES), "GetAll", &(iface,)),
    )
    .await
    .unwrap_or_else(|_| panic!("GetAll {iface} on {path}: no reply within {CALL_BOUND:?}"))
    .unwrap_or_else(|e| panic!("GetAll {iface} on {path}: {e}"));
    reply.body().deserialize().unwrap()
}

/// Fires one burst; returns the tasks the accepted Apply/SetMode calls started. Fails on a call
/// over its bound (naming it, the round and the stuck tasks) or an unexpected reply.
async fn fire(h: &Harness, clients: &[zbus::Connection], round: usize) -> Vec<i64> {
    let calls = burst();
    let replies = futures_util::future::join_all(calls.iter().enumerate().map(|(i, kind)| {
        let reply = send(&clients[i % clients.len()], *kind);
        async move {
            let t0 = Instant::now();
            (tokio::time::timeout(CALL_BOUND, reply).await, t0.elapsed())
        }
    }))
    .await;
    let late: Vec<String> = calls
        .iter()
        .zip(&replies)
        .enumerate()
        .filter(|(_, (_, (r, _)))| r.is_err())
        .map(|(i, (k, _))| format!("#{i} {k:?}"))
        .collect();
    if !late.is_empty() {
        panic!(
            "round {round}: {} of {} calls got no reply within {CALL_BOUND:?} (first: {}); \
             latest tasks in the store: {}; over D-Bus: {}",
            late.len(),
            calls.len(),
            late.join(", "),
            tasks_in_store(h.store().path()),
            tasks_over_dbus(h).await,
        );
    }
    let mut tasks = Vec::new();
    for (i, (kind, (reply, took))) in calls.iter().zip(replies).enumerate() {
        let reply = reply.expect("checked above");
        let what = format!("round {round}, call #{i} {kind:?} ({took:?})");
        match (kind, reply) {
            (Kind::Apply(_) | Kind::SetMode(_), Ok(m)) => {
                tasks.push(task_id(&m.body().deserialize::<OwnedObjectPath>().unwrap()))
            }
            (Kind::Apply(_) | Kind::SetMode(_), Err(e))
                if error_name(&e).as_deref() == Some("org.vfiod.Vfiod1.Error.Busy") =>
            {
                // Another task holds the group: the expected answer of most of them.
                let message = e.to_string();
                assert!(
                    !message.contains("until an operator resets it"),
                    "{what}: a task on the group failed: {message}"
                );
            }
            (Kind::GetAll(a), Ok(m)) => {
                let props: Props = m.body().deserialize().unwrap();
                assert_eq!(prop_str(&props, "Address").as_deref(), Some(*a), "{what}");
            }
            (Kind::GetManagedObjects, Ok(m)) => {
                let objects: HashMap<OwnedObjectPath, HashMap<String, Props>> =
                    m.body().deserialize().unwrap();
                for a in [GPU, AUDIO] {
                    let path = OwnedObjectPath::try_from(device_path(a)).unwrap();
                    assert!(objects.contains_key(&path), "{what}: {a} missing");
                }
            }
            (_, Ok(_)) => {}
            (_, Err(e)) => panic!("{what}: {e}"),
        }
    }
    // Every call was answered within CALL_BOUND (a deadline against a deadlock, above): no
    // bound on the whole burst's time, which only added a race with the machine's load.
    tasks
}

/// After a round: no task active, every task of the round final (and in error only if refused),
/// and sysfs, the store and D-Bus agreeing on the group's drivers and task states.
async fn check_agreement(h: &Harness, round: usize, after_id: i64) {
    let store = h.store();
    let within = Duration::from_secs(60);
    let tasks: Vec<TaskRecord> = eventually(within, &format!("round {round}: tasks end"), || {
        let tasks: Vec<TaskRecord> = store
            .tasks(None, 1000)
            .unwrap()
            .into_iter()
            .filter(|t| t.id > after_id)
            .collect();
        let idle = [GPU, AUDIO]
            .iter()
            .all(|a| store.blocking_task(addr(a)).unwrap().is_none());
        (idle && tasks.iter().all(|t| t.state.is_final())).then_some(tasks)
    })
    .await;
    for t in &tasks {
        assert!(
            t.state == TaskState::Success || t.reset_by.as_deref() == Some(REFUSED_BY),
            "round {round}: a task failed: {t:?}"
        );
    }

    // Each task object shows what the store holds.
    for t in &tasks {
        let path = vfiod::dbus::task::task_path(t.id).to_string();
        eventually_async(
            within,
            &format!("round {round}: task {} on D-Bus", t.id),
            || {
                let path = path.clone();
                async move {
                    let p = get_all(h, &path, TASK).await;
                    (prop_str(&p, "State").as_deref() == Some(t.state.as_str())
                        && prop_str(&p, "Kind").as_deref() == Some(t.kind.as_str()))
                    .then_some(())
                }
            },
        )
        .await;
    }

    // Drivers: the kernel's files, the simulated kernel's model, the store and the bus agree.
    for (a, _) in NATIVE {
        let path = device_path(a);
        let last = store.last_result(addr(a)).unwrap().map(|t| t.id);
        let deadline = Instant::now() + within;
        loop {
            let files = h.kernel.sysfs().read_function(addr(a)).unwrap().driver;
            let model = h.kernel.driver_of(addr(a));
            let stored = store.device(addr(a)).unwrap().unwrap().driver;
            let p = get_all(h, &path, DEVICE).await;
            let shown = prop_str(&p, "Driver").filter(|d| !d.is_empty());
            let task_state = prop_str(&p, "TaskState").unwrap_or_default();
            let last_shown = prop_str(&p, "LastResult").unwrap_or_default();
            let last_ok = match last {
                Some(id) => last_shown.starts_with(&format!("task {id} ")),
                None => last_shown.is_empty(),
            };
            if files == model
                && stored == model
                && shown == model
                && task_state == "idle"
                && last_ok
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: {a} disagrees for {within:?}: driver in the files {files:?}, \
                 in the kernel {model:?}, in the store {stored:?}, on D-Bus {shown:?}; D-Bus \
                 TaskState {task_state:?}, LastResult {last_shown:?} (the store's last task: \
                 {last:?})"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// After the burst the settings in force are the file's: one more Apply (retried while Busy)
/// brings the group where the configuration puts it.
async fn converge(h: &Harness, round: usize, vfio: bool) {
    let gpu = vfiod::client::device(&h.client, GPU).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let path = loop {
        match tokio::time::timeout(CALL_BOUND, gpu.apply()).await {
            Err(_) => panic!("round {round}: the converging Apply got no reply"),
            Ok(Ok(path)) => break path,
            Ok(Err(e)) if error_name(&e).as_deref() == Some("org.vfiod.Vfiod1.Error.Busy") => {
                assert!(
                    Instant::now() < deadline,
                    "round {round}: Busy for 60 s: {e}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Ok(Err(e)) => panic!("round {round}: the converging Apply: {e}"),
        }
    };
    let id = task_id(&path);
    let store = h.store();
    let t = eventually(Duration::from_secs(60), "the converging Apply ends", || {
        store.task(id).unwrap().filter(|t| t.state.is_final())
    })
    .await;
    assert_eq!(t.state, TaskState::Success, "round {round}: {t:?}");
    for (a, native) in NATIVE {
        let want = if vfio { "vfio-pci" } else { native };
        assert_eq!(
            h.kernel.driver_of(addr(a)).as_deref(),
            Some(want),
            "round {round}: {a} is not where the configuration puts it"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_of_calls_on_the_gpu_group_never_hang_the_daemon() {
    let h = Harness::start(STEADY_CONFIG).await;
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(
            zbus::connection::Builder::address(h.bus.address())
                .build()
                .await
                .unwrap(),
        );
    }
    let watchdog = Watchdog::start(h.store().path().to_path_buf());
    let rounds = rounds();
    let started = Instant::now();
    let mut tasks_started = 0;
    for round in 0..rounds {
        watchdog.beat(round);
        let vfio = round % 2 == 0;
        h.replace_config(&common::gpu_group_config(vfio));
        let after = h
            .store()
            .tasks(None, 1)
            .unwrap()
            .first()
            .map_or(0, |t| t.id);
        tasks_started += fire(&h, &clients, round).await.len();
        check_agreement(&h, round, after).await;
        converge(&h, round, vfio).await;
    }
    drop(watchdog);
    eprintln!(
        "stress: {rounds} rounds of 49 calls in {:?}; {tasks_started} Apply/SetMode accepted",
        started.elapsed()
    );
}
