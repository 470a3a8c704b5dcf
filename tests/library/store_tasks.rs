//! The durable side of the task engine against real SQLite files in temporary directories: the
//! task life cycle and its events, errors that block until reset, the state machine enforced by
//! the store, racing creators, recovery after a crash, the migration from schema version 1, and
//! the original-driver memory.

use rusqlite::Connection;
use std::path::Path;
use std::sync::{Arc, Barrier};
use vfiod::model::pci::PciAddress;
use vfiod::model::task::TaskKind;
use vfiod::store::{Store, StoreError, TaskRecord, TaskState, DB_FILE_NAME, SCHEMA_VERSION};

const PF: &str = "0000:3b:00.0";

fn addr(s: &str) -> PciAddress {
    s.parse().unwrap()
}

/// A second connection to the same file, as another process (or an operator's `sqlite3`) has.
fn raw(store_dir: &Path) -> Connection {
    Connection::open(store_dir.join(DB_FILE_NAME)).unwrap()
}

/// The messages of the task events about `address`, oldest first.
fn task_events(store: &Store, address: &str) -> Vec<String> {
    store
        .events(Some(addr(address)), 0, usize::MAX)
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "task")
        .map(|e| e.message)
        .collect()
}

fn split(store: &Store, address: &str) -> TaskRecord {
    store
        .create_task(
            addr(address),
            TaskKind::Split,
            r#"{"num_vfs":64}"#,
            "uid 1000",
        )
        .unwrap()
}

/// The task that blocked, from a `Busy` error; panics on anything else.
fn blocker(result: Result<TaskRecord, StoreError>) -> TaskRecord {
    match result {
        Err(StoreError::Busy { address, task }) => {
            assert_eq!(address, task.address);
            *task
        }
        other => panic!("expected Busy, got {other:?}"),
    }
}

#[test]
fn a_task_runs_from_prepare_to_success_and_frees_its_device() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let pf = addr(PF);
    assert_eq!(store.active_task(pf).unwrap(), None);
    assert_eq!(store.last_result(pf).unwrap(), None);

    let created = split(&store, PF);
    assert_eq!(created.address, pf);
    assert_eq!(created.kind, "split");
    assert_eq!(created.state, TaskState::Prepare);
    assert_eq!(
        (created.step.as_str(), created.percent),
        ("", 0),
        "{created:?}"
    );
    assert_eq!(created.params, r#"{"num_vfs":64}"#);
    assert_eq!(created.requested_by, "uid 1000");
    assert!(created.created_ms > 0);
    assert_eq!(
        (created.started_ms, created.finished_ms, created.reset_ms),
        (None, None, None)
    );
    assert_eq!(store.task(created.id).unwrap(), Some(created.clone()));
    assert_eq!(store.active_task(pf).unwrap(), Some(created.clone()));

    let first = store.task_progress(created.id, "disable VFs", 10).unwrap();
    assert_eq!(first.state, TaskState::Running);
    let started = first.started_ms.expect("running sets started_ms");
    assert!(started >= created.created_ms);
    let second = store.task_progress(created.id, "enable VFs", 40).unwrap();
    assert_eq!(
        (second.step.as_str(), second.percent, second.started_ms),
        ("enable VFs", 40, Some(started)),
        "a later step keeps the start time"
    );
    assert_eq!(store.active_task(pf).unwrap(), Some(second.clone()));

    let done = store.task_succeeded(created.id, "64 VFs enabled").unwrap();
    assert_eq!(done.state, TaskState::Success);
    assert_eq!(done.message, "64 VFs enabled");
    assert_eq!(done.percent, 100);
    assert_eq!(done.step, "enable VFs", "the last step stays visible");
    assert!(done.finished_ms.unwrap() >= started);
    assert_eq!(store.task(created.id).unwrap(), Some(done.clone()));
    assert_eq!(store.active_task(pf).unwrap(), None, "idle after success");
    assert_eq!(store.last_result(pf).unwrap(), Some(done.clone()));

    assert_eq!(
        task_events(&store, PF),
        [
            format!(
                "task {} split on {PF}: prepare (requested by uid 1000, params {{\"num_vfs\":64}})",
                created.id
            ),
            format!(
                "task {} split on {PF}: running (disable VFs, 10%)",
                created.id
            ),
            format!(
                "task {} split on {PF}: running (enable VFs, 40%)",
                created.id
            ),
            format!(
                "task {} split on {PF}: success (64 VFs enabled)",
                created.id
            ),
        ]
    );

    // Idle again: the next request is accepted, and the history keeps both, newest first.
    let next = store
        .create_task(pf, TaskKind::Restore, "{}", ":1.42")
        .expect("a device is idle after success");
    assert!(next.id > done.id);
    assert_eq!(store.last_result(pf).unwrap(), Some(done.clone()));
    assert_eq!(
        store.tasks(Some(pf), 10).unwrap(),
        [next.clone(), done.clone()]
    );
    assert_eq!(
        store.tasks(Some(pf), 1).unwrap(),
        std::slice::from_ref(&next)
    );
    assert_eq!(store.tasks(Some(addr("0000:3b:00.1")), 10).unwrap(), []);

    // All of it is on disk.
    drop(store);
    let store = Store::open(dir.path()).unwrap();
    assert_eq!(store.task(done.id).unwrap(), Some(done));
    assert_eq!(store.active_task(pf).unwrap(), Some(next));
}

#[test]
fn an_error_blocks_the_device_until_an_operator_resets_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let pf = addr(PF);
    let task = split(&store, PF);
    store.task_progress(task.id, "enable VFs", 40).unwrap();
    let failed = store
        .task_failed(task.id, "sriov_numvfs: Device or resource busy")
        .unwrap();
    assert_eq!(failed.state, TaskState::Error);
    assert_eq!(
        (failed.step.as_str(), failed.percent),
        ("enable VFs", 40),
        "where it stopped stays visible"
    );
    assert!(failed.finished_ms.is_some());
    assert_eq!(store.active_task(pf).unwrap(), Some(failed.clone()));
    assert_eq!(store.last_result(pf).unwrap(), Some(failed.clone()));

    // A new request is refused, naming the failed task.
    let err = store
        .create_task(pf, TaskKind::Restore, "{}", "uid 0")
        .unwrap_err();
    let message = err.to_string();
    assert_eq!(blocker(Err(err)), failed);
    assert!(
        message.contains(&format!("task {} split", task.id))
            && message.contains("Device or resource busy")
            && message.contains("until an operator resets it"),
        "{message}"
    );
    assert_eq!(
        store.tasks(Some(pf), 10).unwrap(),
        std::slice::from_ref(&failed)
    );

    let reset = store.reset_task(pf, "uid 0 (root)").unwrap();
    assert_eq!(reset.id, task.id);
    assert_eq!(reset.state, TaskState::Error, "history keeps the outcome");
    assert_eq!(reset.message, failed.message);
    assert_eq!(reset.reset_by.as_deref(), Some("uid 0 (root)"));
    assert!(reset.reset_ms.unwrap() >= failed.finished_ms.unwrap());
    assert_eq!(store.task(task.id).unwrap(), Some(reset.clone()));
    assert_eq!(store.active_task(pf).unwrap(), None, "idle after reset");
    assert_eq!(store.last_result(pf).unwrap(), Some(reset.clone()));
    let events = task_events(&store, PF);
    assert_eq!(
        events.last().unwrap(),
        &format!(
            "task {} split on {PF}: reset by uid 0 (root) (was error: \
             sriov_numvfs: Device or resource busy)",
            task.id
        ),
        "{events:?}"
    );
    assert_eq!(
        events[events.len() - 2],
        format!(
            "task {} split on {PF}: error (sriov_numvfs: Device or resource busy)",
            task.id
        )
    );

    // A second reset finds nothing to reset; neither does an idle device.
    assert!(matches!(
        store.reset_task(pf, "uid 0"),
        Err(StoreError::NotInError { state: None, .. })
    ));
    let next = store
        .create_task(pf, TaskKind::Restore, "{}", "uid 0")
        .unwrap();
    assert_eq!(store.last_result(pf).unwrap(), Some(reset));
    assert_eq!(store.active_task(pf).unwrap(), Some(next));
}

/// How far a fresh task is driven before the operation under test.
#[derive(Clone, Copy, Debug)]
enum Start {
    Prepare,
    Running,
    Success,
    Error,
    ResetError,
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Progress,
    Succeed,
    Fail,
    Reset,
}

fn drive(store: &Store, address: &str, start: Start) -> TaskRecord {
    let task = split(store, address);
    let id = task.id;
    match start {
        Start::Prepare => task,
        Start::Running => store.task_progress(id, "enable VFs", 40).unwrap(),
        Start::Success => {
            store.task_progress(id, "enable VFs", 40).unwrap();
            store.task_succeeded(id, "").unwrap()
        }
        Start::Error => store.task_failed(id, "EBUSY").unwrap(),
        Start::ResetError => {
            store.task_failed(id, "EBUSY").unwrap();
            store.reset_task(addr(address), "uid 0").unwrap()
        }
    }
}

fn run(store: &Store, task: &TaskRecord, op: Op) -> Result<TaskRecord, StoreError> {
    match op {
        Op::Progress => store.task_progress(task.id, "bind VFs", 90),
        Op::Succeed => store.task_succeeded(task.id, "ok"),
        Op::Fail => store.task_failed(task.id, "broken"),
        Op::Reset => store.reset_task(task.address, "uid 0"),
    }
}

#[test]
fn the_store_enforces_the_task_state_machine() {
    use Op::*;
    use TaskState as S;
    // Expected outcome: the state reached, or the state the refusal reports. `prepare ->
    // success` is refused on purpose: a success has run at least one step.
    let table: [(Start, Op, Result<S, Option<S>>); 20] = [
        (Start::Prepare, Progress, Ok(S::Running)),
        (Start::Prepare, Succeed, Err(Some(S::Prepare))),
        (Start::Prepare, Fail, Ok(S::Error)),
        (Start::Prepare, Reset, Err(Some(S::Prepare))),
        (Start::Running, Progress, Ok(S::Running)),
        (Start::Running, Succeed, Ok(S::Success)),
        (Start::Running, Fail, Ok(S::Error)),
        (Start::Running, Reset, Err(Some(S::Running))),
        (Start::Success, Progress, Err(Some(S::Success))),
        (Start::Success, Succeed, Err(Some(S::Success))),
        (Start::Success, Fail, Err(Some(S::Success))),
        (Start::Success, Reset, Err(None)),
        (Start::Error, Progress, Err(Some(S::Error))),
        (Start::Error, Succeed, Err(Some(S::Error))),
        (Start::Error, Fail, Err(Some(S::Error))),
        (Start::Error, Reset, Ok(S::Error)),
        (Start::ResetError, Progress, Err(Some(S::Error))),
        (Start::ResetError, Succeed, Err(Some(S::Error))),
        (Start::ResetError, Fail, Err(Some(S::Error))),
        (Start::ResetError, Reset, Err(None)),
    ];
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    for (n, (start, op, expected)) in table.into_iter().enumerate() {
        let address = format!("0000:{:02x}:00.0", n + 1);
        let case = format!("{start:?} then {op:?}");
        let before = drive(&store, &address, start);
        let events_before = task_events(&store, &address);
        match (run(&store, &before, op), expected) {
            (Ok(after), Ok(state)) => {
                assert_eq!(after.state, state, "{case}");
                assert_eq!(store.task(before.id).unwrap(), Some(after), "{case}");
                assert_eq!(
                    task_events(&store, &address).len(),
                    events_before.len() + 1,
                    "{case}"
                );
            }
            (Err(StoreError::IllegalTransition { id, from, to, .. }), Err(Some(state)))
                if !matches!(op, Reset) =>
            {
                assert_eq!((id, from), (before.id, state), "{case}");
                let target = match op {
                    Progress => S::Running,
                    Succeed => S::Success,
                    _ => S::Error,
                };
                assert_eq!(to, target, "{case}");
            }
            (Err(StoreError::NotInError { state, .. }), Err(expected_state))
                if matches!(op, Reset) =>
            {
                assert_eq!(state, expected_state, "{case}");
            }
            (result, expected) => panic!("{case}: got {result:?}, expected {expected:?}"),
        }
        if expected.is_err() {
            // A refusal changes nothing, and records nothing.
            assert_eq!(store.task(before.id).unwrap(), Some(before), "{case}");
            assert_eq!(task_events(&store, &address), events_before, "{case}");
        }
    }
}

#[test]
fn malformed_requests_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let pf = addr(PF);
    let invalid = |result: Result<TaskRecord, StoreError>| {
        assert!(
            matches!(result, Err(StoreError::InvalidArgument { .. })),
            "{result:?}"
        )
    };
    // An empty kind is no longer representable: TaskKind is a typed enum.
    invalid(store.create_task(pf, TaskKind::Split, "{}", " "));
    invalid(store.create_task(pf, TaskKind::Split, "", "uid 0"));
    invalid(store.create_task(pf, TaskKind::Split, "{num_vfs: 64}", "uid 0"));
    invalid(store.create_task(pf, TaskKind::Split, "[64]", "uid 0"));
    assert_eq!(store.tasks(None, 10).unwrap(), []);

    let task = split(&store, PF);
    invalid(store.task_progress(task.id, "enable VFs", 101));
    invalid(store.task_progress(task.id, "", 10));
    invalid(store.task_failed(task.id, ""));
    store.task_failed(task.id, "EBUSY").unwrap();
    invalid(store.reset_task(pf, ""));
    assert_eq!(store.active_task(pf).unwrap().unwrap().reset_ms, None);
    assert_eq!(task_events(&store, PF).len(), 2);

    let missing = task.id + 1000;
    for result in [
        store.task_progress(missing, "x", 1),
        store.task_succeeded(missing, ""),
        store.task_failed(missing, "x"),
    ] {
        assert!(
            matches!(result, Err(StoreError::NoSuchTask(id)) if id == missing),
            "{result:?}"
        );
    }
    assert_eq!(store.task(missing).unwrap(), None);
}

const THREADS: usize = 8;
const ROUNDS: usize = 10;

/// Each round, every thread asks for a task on the same address at the same moment.
fn race_create_task(stores: Vec<Arc<Store>>) {
    for round in 0..ROUNDS {
        let address = addr(&format!("0000:{:02x}:00.0", round + 1));
        let barrier = Arc::new(Barrier::new(THREADS));
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let store = stores[t % stores.len()].clone();
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    barrier.wait();
                    store.create_task(address, TaskKind::Split, "{}", &format!("thread {t}"))
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let winners: Vec<TaskRecord> = results
            .iter()
            .filter_map(|r| r.as_ref().ok().cloned())
            .collect();
        assert_eq!(winners.len(), 1, "round {round}: {results:?}");
        let winner = &winners[0];
        for result in results.into_iter().filter(Result::is_err) {
            assert_eq!(&blocker(result), winner, "round {round}");
        }
        for store in &stores {
            assert_eq!(
                store.tasks(Some(address), 100).unwrap(),
                std::slice::from_ref(winner)
            );
            assert_eq!(task_events(store, &address.to_string()).len(), 1);
        }
    }
}

#[test]
fn racing_creators_through_one_store_get_one_task() {
    let dir = tempfile::tempdir().unwrap();
    race_create_task(vec![Arc::new(Store::open(dir.path()).unwrap())]);
}

#[test]
fn racing_creators_through_two_stores_on_one_file_get_one_task() {
    // Two stores stand for two processes: only the immediate transaction (and, behind it, the
    // unique index) keeps them from both seeing an idle device.
    let dir = tempfile::tempdir().unwrap();
    let one = Arc::new(Store::open(dir.path()).unwrap());
    let two = Arc::new(Store::open(dir.path()).unwrap());
    race_create_task(vec![one, two]);
}

const GPU: &str = "0000:17:00.0";
const AUDIO: &str = "0000:17:00.1";

/// The Busy error's (blocked function, blocking task); panics on anything else.
fn busy(result: Result<TaskRecord, StoreError>) -> (PciAddress, TaskRecord, String) {
    match result {
        Err(e @ StoreError::Busy { .. }) => {
            let msg = e.to_string();
            let StoreError::Busy { address, task } = e else {
                unreachable!()
            };
            (address, *task, msg)
        }
        other => panic!("expected Busy, got {other:?}"),
    }
}

#[test]
fn a_task_blocks_every_function_in_its_scope_until_it_ends() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    // The GPU's bind moves its audio function too.
    let bind = store
        .create_task_covering(
            addr(GPU),
            &[addr(AUDIO), addr(GPU)],
            TaskKind::Bind,
            "{}",
            "uid 0",
        )
        .unwrap();
    assert_eq!(store.task_scope(bind.id).unwrap(), vec![addr(AUDIO)]);

    // A task on the audio function itself.
    let (blocked, task, msg) = busy(store.create_task(addr(AUDIO), TaskKind::Bind, "{}", "uid 0"));
    assert_eq!((blocked, task.id), (addr(AUDIO), bind.id));
    assert_eq!(
        msg,
        format!(
            "device {AUDIO} is busy: task {} bind on {GPU} is preparing",
            bind.id
        )
    );
    // A task elsewhere whose own scope reaches into the GPU's.
    let (blocked, task, _) = busy(store.create_task_covering(
        addr("0000:18:00.0"),
        &[addr(AUDIO)],
        TaskKind::Bind,
        "{}",
        "uid 0",
    ));
    assert_eq!((blocked, task.id), (addr(AUDIO), bind.id));
    let (blocked, task, _) = busy(store.create_task_covering(
        addr("0000:18:00.0"),
        &[addr(GPU)],
        TaskKind::Bind,
        "{}",
        "uid 0",
    ));
    assert_eq!((blocked, task.id), (addr(GPU), bind.id));
    // Unrelated functions are free, and nothing was created by the refusals.
    let other = split(&store, PF);
    assert_eq!(store.tasks(None, 10).unwrap().len(), 2);

    // The audio function shows the GPU's task as the one keeping it busy.
    assert_eq!(
        store.blocking_task(addr(AUDIO)).unwrap(),
        Some(bind.clone())
    );
    assert_eq!(store.active_task(addr(AUDIO)).unwrap(), None, "not its own");
    assert_eq!(store.blocking_task(addr("0000:18:00.0")).unwrap(), None);

    // An error keeps the whole scope busy until the reset, which the audio function can ask for;
    // then it is free.
    store.task_failed(bind.id, "EIO on unbind").unwrap();
    busy(store.create_task(addr(AUDIO), TaskKind::Bind, "{}", "uid 0"));
    let reset = store.reset_task(addr(AUDIO), "uid 0").unwrap();
    assert_eq!(
        (reset.id, reset.reset_by.as_deref()),
        (bind.id, Some("uid 0"))
    );
    assert_eq!(store.blocking_task(addr(AUDIO)).unwrap(), None);
    assert!(matches!(
        store.reset_task(addr(GPU), "uid 0"),
        Err(StoreError::NotInError { .. })
    ));
    let audio = store
        .create_task(addr(AUDIO), TaskKind::Bind, "{}", "uid 0")
        .unwrap();
    // ... and now the audio task's device blocks a new GPU task that covers it.
    let (blocked, task, _) =
        busy(store.create_task_covering(addr(GPU), &[addr(AUDIO)], TaskKind::Bind, "{}", "uid 0"));
    assert_eq!((blocked, task.id), (addr(AUDIO), audio.id));
    assert!(other.is_active());
}

/// Group mates requested at the same moment through two stores on one file (two processes):
/// exactly one task is created each round.
#[test]
fn racing_group_mates_get_one_task() {
    let dir = tempfile::tempdir().unwrap();
    let stores = [
        Arc::new(Store::open(dir.path()).unwrap()),
        Arc::new(Store::open(dir.path()).unwrap()),
    ];
    for round in 0..ROUNDS {
        let fns: Vec<PciAddress> = (0..THREADS)
            .map(|f| addr(&format!("0000:{:02x}:00.{}", round + 0x40, f % 8)))
            .collect();
        let barrier = Arc::new(Barrier::new(THREADS));
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let store = stores[t % 2].clone();
                let (barrier, fns) = (barrier.clone(), fns.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    store.create_task_covering(fns[t], &fns, TaskKind::Bind, "{}", "uid 0")
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let winners: Vec<&TaskRecord> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        assert_eq!(winners.len(), 1, "round {round}: {results:?}");
        let winner = winners[0].clone();
        for r in results.into_iter().filter(Result::is_err) {
            assert_eq!(busy(r).1, winner, "round {round}");
        }
    }
}

#[test]
fn tasks_cut_short_by_a_crash_become_interrupted_errors_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let running = split(&store, PF);
    let running = store.task_progress(running.id, "enable VFs", 40).unwrap();
    let preparing = split(&store, "0000:5e:00.0");
    let finished = drive(&store, "0000:86:00.0", Start::Success);
    let failed = drive(&store, "0000:af:00.0", Start::Error);
    // vfiod dies: nothing more is written.
    drop(store);

    let store = Store::open(dir.path()).unwrap();
    // Opening alone changes nothing: a CLI opening the file must not touch the daemon's tasks.
    assert_eq!(store.task(running.id).unwrap(), Some(running.clone()));

    let interrupted = store.interrupt_unfinished_tasks().unwrap();
    let ids: Vec<i64> = interrupted.iter().map(|t| t.id).collect();
    assert_eq!(ids, [running.id, preparing.id]);
    let [after_running, after_preparing] = <[TaskRecord; 2]>::try_from(interrupted).unwrap();
    assert_eq!(after_running.state, TaskState::Error);
    assert_eq!(
        after_running.message,
        "interrupted (vfiod stopped during step enable VFs)"
    );
    assert_eq!(
        (after_running.step.as_str(), after_running.percent),
        ("enable VFs", 40)
    );
    assert!(after_running.finished_ms.is_some());
    assert_eq!(
        after_preparing.message,
        "interrupted (vfiod stopped during prepare)"
    );
    assert_eq!(store.task(running.id).unwrap(), Some(after_running.clone()));
    assert_eq!(store.task(finished.id).unwrap(), Some(finished));
    assert_eq!(store.task(failed.id).unwrap(), Some(failed));
    assert_eq!(
        task_events(&store, PF).last().unwrap(),
        &format!(
            "task {} split on {PF}: error (interrupted (vfiod stopped during step enable VFs))",
            running.id
        )
    );

    // The device is not idle until an operator looks at it.
    assert_eq!(
        blocker(store.create_task(addr(PF), TaskKind::Split, "{}", "uid 0")),
        after_running
    );
    assert_eq!(store.interrupt_unfinished_tasks().unwrap(), []);
    store.reset_task(addr(PF), "uid 0").unwrap();
    store
        .create_task(addr(PF), TaskKind::Split, "{}", "uid 0")
        .unwrap();
}

/// The schema of version 1 as released, frozen here on purpose: migrations must keep working on
/// files that version wrote, whatever happens to the code later.
const V1_SCHEMA: &str = "
PRAGMA application_id = 1986423151;
CREATE TABLE devices (
    address             TEXT PRIMARY KEY NOT NULL,
    vendor_id           INTEGER NOT NULL,
    device_id           INTEGER NOT NULL,
    subsystem_vendor_id INTEGER NOT NULL,
    subsystem_device_id INTEGER NOT NULL,
    revision            INTEGER NOT NULL,
    class               INTEGER NOT NULL,
    vendor_name         TEXT NOT NULL,
    device_name         TEXT NOT NULL,
    kind                TEXT NOT NULL,
    driver              TEXT,
    driver_override     TEXT,
    numa_node           INTEGER,
    iommu_group         INTEGER,
    role                TEXT NOT NULL,
    separable           INTEGER NOT NULL CHECK (separable IN (0, 1)),
    mode                TEXT NOT NULL,
    total_vfs           INTEGER NOT NULL,
    num_vfs             INTEGER NOT NULL,
    parent_pf           TEXT,
    managed             INTEGER NOT NULL CHECK (managed IN (0, 1)),
    state               TEXT NOT NULL,
    state_reason        TEXT NOT NULL,
    first_seen_ms       INTEGER NOT NULL,
    last_seen_ms        INTEGER NOT NULL
);
CREATE TABLE events (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    time_ms INTEGER NOT NULL,
    address TEXT,
    kind    TEXT NOT NULL CHECK (kind <> ''),
    message TEXT NOT NULL
);
CREATE INDEX events_by_address ON events (address, id);
CREATE TABLE claims (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    address       TEXT NOT NULL,
    vm_name       TEXT,
    vm_uuid       TEXT,
    guest_address TEXT,
    state         TEXT NOT NULL,
    created_ms    INTEGER NOT NULL,
    updated_ms    INTEGER NOT NULL
);
CREATE UNIQUE INDEX claims_one_active_per_address
    ON claims (address) WHERE state IN ('claimed', 'attached');
CREATE TABLE tasks (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    address     TEXT NOT NULL,
    kind        TEXT NOT NULL,
    state       TEXT NOT NULL,
    step        TEXT NOT NULL DEFAULT '',
    percent     INTEGER NOT NULL DEFAULT 0 CHECK (percent BETWEEN 0 AND 100),
    message     TEXT NOT NULL DEFAULT '',
    created_ms  INTEGER NOT NULL,
    started_ms  INTEGER,
    finished_ms INTEGER
);
CREATE UNIQUE INDEX tasks_one_open_per_address
    ON tasks (address) WHERE state IN ('prepare', 'running', 'error');
CREATE TABLE original_drivers (
    address     TEXT PRIMARY KEY NOT NULL,
    driver      TEXT,
    recorded_ms INTEGER NOT NULL
);
PRAGMA user_version = 1;
";

/// Table and index definitions, whitespace-normalised so that comments and indentation of the
/// SQL that built them do not matter.
fn schema(dir: &Path) -> Vec<(String, String)> {
    raw(dir)
        .prepare("SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL ORDER BY name")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get::<_, String>(1)?)))
        .unwrap()
        .map(|r| {
            let (name, sql) = r.unwrap();
            (name, sql.split_whitespace().collect::<Vec<_>>().join(" "))
        })
        .collect()
}

#[test]
fn a_version_1_database_migrates_and_keeps_its_rows() {
    let dir = tempfile::tempdir().unwrap();
    {
        let conn = raw(dir.path());
        conn.execute_batch(V1_SCHEMA).unwrap();
        conn.execute_batch(&format!(
            "INSERT INTO tasks (address, kind, state, step, percent, message, created_ms, \
                 started_ms, finished_ms) VALUES
                 ('{PF}', 'split', 'error', 'enable VFs', 40, 'EBUSY', 100, 110, 120),
                 ('0000:5e:00.0', 'restore', 'running', 'unbind', 20, '', 200, 210, NULL),
                 ('0000:86:00.0', 'split', 'success', 'enable VFs', 100, 'done', 300, 310, 320);
             INSERT INTO events (time_ms, address, kind, message)
                 VALUES (120, '{PF}', 'task', 'old event');
             INSERT INTO original_drivers (address, driver, recorded_ms)
                 VALUES ('{PF}', 'ice', 90), ('0000:5e:00.0', NULL, 91);"
        ))
        .unwrap();
    }

    let store = Store::open(dir.path()).unwrap();
    assert_eq!(SCHEMA_VERSION, 9);
    assert_eq!(store.schema_version().unwrap(), 9);
    let tasks = store.tasks(None, 10).unwrap();
    assert_eq!(tasks.len(), 3);
    let old_error = &tasks[2];
    assert_eq!(
        (
            old_error.id,
            old_error.address,
            old_error.kind.as_str(),
            old_error.state,
            old_error.step.as_str(),
            old_error.percent,
            old_error.message.as_str()
        ),
        (
            1,
            addr(PF),
            "split",
            TaskState::Error,
            "enable VFs",
            40,
            "EBUSY"
        )
    );
    assert_eq!(
        (
            old_error.created_ms,
            old_error.started_ms,
            old_error.finished_ms
        ),
        (100, Some(110), Some(120))
    );
    // New columns take their defaults.
    assert_eq!(
        (
            old_error.params.as_str(),
            old_error.requested_by.as_str(),
            old_error.reset_ms,
            old_error.reset_by.clone()
        ),
        ("{}", "", None, None)
    );
    assert_eq!(
        store
            .last_result(addr("0000:86:00.0"))
            .unwrap()
            .unwrap()
            .message,
        "done"
    );
    assert_eq!(store.events(None, 0, 10).unwrap()[0].message, "old event");
    assert_eq!(
        store.original_driver(addr(PF)).unwrap(),
        Some(Some("ice".into()))
    );
    assert_eq!(
        store.original_driver(addr("0000:5e:00.0")).unwrap(),
        Some(None)
    );

    // The old rows take part in the new rules: the error blocks until reset, and the running task
    // left by the old vfiod is interrupted.
    assert_eq!(
        blocker(store.create_task(addr(PF), TaskKind::Restore, "{}", "uid 0")).id,
        1
    );
    store.reset_task(addr(PF), "uid 0").unwrap();
    store
        .create_task(addr(PF), TaskKind::Restore, "{}", "uid 0")
        .unwrap();
    let interrupted = store.interrupt_unfinished_tasks().unwrap();
    assert_eq!(interrupted.len(), 2, "{interrupted:?}");
    assert_eq!(
        interrupted[0].message,
        "interrupted (vfiod stopped during step unbind)"
    );

    // The migrated file has exactly the schema of a new one (which also proves this frozen copy
    // of version 1 equals the released step).
    let fresh = tempfile::tempdir().unwrap();
    drop(Store::open(fresh.path()).unwrap());
    assert_eq!(schema(dir.path()), schema(fresh.path()));
}

#[test]
fn the_original_driver_is_recorded_once_and_can_be_forgotten() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let nic = addr(PF);
    let bare = addr("0000:5e:00.0");
    assert_eq!(store.original_driver(nic).unwrap(), None);

    assert!(store.remember_original_driver(nic, Some("ice")).unwrap());
    // After the bind, the current driver is vfio-pci: it must not overwrite the original.
    assert!(!store
        .remember_original_driver(nic, Some("vfio-pci"))
        .unwrap());
    assert!(!store.remember_original_driver(nic, None).unwrap());
    assert_eq!(
        store.original_driver(nic).unwrap(),
        Some(Some("ice".into()))
    );

    // "Had no driver" is a record of its own, distinct from "nothing recorded".
    assert!(store.remember_original_driver(bare, None).unwrap());
    assert!(!store
        .remember_original_driver(bare, Some("vfio-pci"))
        .unwrap());
    assert_eq!(store.original_driver(bare).unwrap(), Some(None));

    assert!(matches!(
        store.remember_original_driver(addr("0000:86:00.0"), Some("")),
        Err(StoreError::InvalidArgument { .. })
    ));
    assert_eq!(store.original_driver(addr("0000:86:00.0")).unwrap(), None);

    drop(store);
    let store = Store::open(dir.path()).unwrap();
    assert_eq!(
        store.original_driver(nic).unwrap(),
        Some(Some("ice".into()))
    );
    assert_eq!(store.original_driver(bare).unwrap(), Some(None));

    store.forget_original_driver(nic).unwrap();
    assert_eq!(store.original_driver(nic).unwrap(), None);
    assert_eq!(store.original_driver(bare).unwrap(), Some(None));
    store.forget_original_driver(nic).unwrap();
    // Forgotten, the next bind records afresh.
    assert!(store.remember_original_driver(nic, Some("ixgbe")).unwrap());
    assert_eq!(
        store.original_driver(nic).unwrap(),
        Some(Some("ixgbe".into()))
    );
}
