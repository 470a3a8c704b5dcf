//! Retention (`[history]`, `src/store/retention.rs`) against real SQLite files: a workload that
//! records far more events and tasks than the limits keeps the database within them, row counts
//! and file size (after a checkpoint) alike, while the same workload without retention grows
//! past them; what is never pruned stays; the store reopens with its acknowledged mark intact;
//! and reading the history after an id that is gone still works.

use rusqlite::Connection;
use std::path::Path;
use std::time::Duration;
use vfiod::config::HistorySettings;
use vfiod::model::event::EventKind;
use vfiod::model::pci::PciAddress;
use vfiod::model::task::TaskKind;
use vfiod::store::{NewEvent, Store, TaskState, DB_FILE_NAME};

const DEVICES: [&str; 4] = [
    "0000:3b:00.0",
    "0000:3b:00.1",
    "0000:af:00.0",
    "0000:d8:00.0",
];
const MAX_EVENTS: u64 = 200;
const MAX_TASKS: u64 = 10;

fn addr(s: &str) -> PciAddress {
    s.parse().unwrap()
}

fn small_limits() -> HistorySettings {
    HistorySettings {
        events_max_age: None,
        events_max_count: Some(MAX_EVENTS),
        tasks_max_age: None,
        tasks_max_count: Some(MAX_TASKS),
        prune_interval: Duration::from_secs(1),
    }
}

/// One round of a busy host: a task on each device, with progress reports (each an event),
/// ending in success; and a burst of other events with messages of some length.
fn round(store: &Store, n: usize) {
    for a in DEVICES {
        let t = store
            .create_task(addr(a), TaskKind::Split, r#"{"num_vfs":8}"#, "test")
            .unwrap();
        for p in [10, 50, 90] {
            store
                .task_progress(t.id, &format!("step {p} of round {n}"), p)
                .unwrap();
        }
        store.task_succeeded(t.id, "split into 8 VFs").unwrap();
    }
    for i in 0..20 {
        store
            .record_event(NewEvent::new(
                Some(addr(DEVICES[i % DEVICES.len()])),
                EventKind::Changed,
                format!("round {n}, change {i}: {}", "x".repeat(200)),
            ))
            .unwrap();
    }
}

/// The database file's size once the log is checkpointed into it.
fn file_size(store: &Store, dir: &Path) -> u64 {
    assert!(store.checkpoint().unwrap(), "the log must be emptied");
    std::fs::metadata(dir.join(DB_FILE_NAME)).unwrap().len()
}

fn finished_tasks(dir: &Path) -> u64 {
    let conn = Connection::open(dir.join(DB_FILE_NAME)).unwrap();
    conn.query_row(
        "SELECT count(*) FROM tasks WHERE state = 'success' OR reset_ms IS NOT NULL",
        [],
        |r| r.get::<_, i64>(0),
    )
    .unwrap()
    .unsigned_abs()
}

const ROUNDS: usize = 60;
/// What the limits allow in the file: 200 events of some 300 bytes, 14 tasks, the devices'
/// rows and the schema fit in well under this, with room for SQLite's pages half used.
const MAX_FILE_BYTES: u64 = 512 * 1024;

#[test]
fn without_retention_the_same_workload_grows_past_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    for n in 0..ROUNDS {
        round(&store, n);
    }
    let (events, tasks) = store.history_counts().unwrap();
    // The bound below is only a bound if this workload exceeds it without retention.
    assert!(events > 4 * MAX_EVENTS, "{events} events");
    assert!(tasks > 4 * MAX_TASKS, "{tasks} tasks");
    assert!(
        file_size(&store, dir.path()) > MAX_FILE_BYTES,
        "the workload must outgrow the file bound without retention"
    );
}

#[test]
fn with_retention_the_database_stays_under_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let limits = small_limits();
    // Never pruned: a released claim, and a task in error that nobody has reset, however old.
    let conn = Connection::open(dir.path().join(DB_FILE_NAME)).unwrap();
    conn.execute(
        "INSERT INTO claims (address, state, created_ms, updated_ms) \
         VALUES ('0000:5e:00.0', 'released', 0, 0)",
        [],
    )
    .unwrap();
    drop(conn);
    let stuck = store
        .create_task(addr("0000:5e:00.0"), TaskKind::Split, "{}", "test")
        .unwrap();
    store.task_failed(stuck.id, "interrupted").unwrap();

    let mut sizes = Vec::new();
    let mut pruned_events = 0;
    for n in 0..ROUNDS {
        round(&store, n);
        let p = store.prune_history(&limits, vfiod_now_ms()).unwrap();
        pruned_events += p.events;
        let (events, _) = store.history_counts().unwrap();
        assert!(events <= MAX_EVENTS, "round {n}: {events} events");
        // The newest finished tasks, plus at most each device's last result.
        let finished = finished_tasks(dir.path());
        assert!(
            finished <= MAX_TASKS + DEVICES.len() as u64,
            "round {n}: {finished} finished tasks"
        );
        sizes.push(file_size(&store, dir.path()));
    }
    assert!(pruned_events > 0);
    let last = *sizes.last().unwrap();
    assert!(last <= MAX_FILE_BYTES, "{last} bytes");
    // Freed pages are reused: the file stopped growing once the limits were reached.
    let middle = sizes[ROUNDS / 2];
    assert!(
        last <= middle + 8 * 4096,
        "the file kept growing: {middle} bytes at round {}, {last} at the end",
        ROUNDS / 2
    );

    // Every device's last result is the task that just succeeded, as `vfioctl task` shows it.
    for a in DEVICES {
        let last = store.last_result(addr(a)).unwrap().expect("a last result");
        assert_eq!(last.state, TaskState::Success);
        assert_eq!(store.tasks(Some(addr(a)), 1).unwrap()[0].id, last.id);
    }
    // The stuck task and the claim stay.
    let still = store
        .task(stuck.id)
        .unwrap()
        .expect("a task in error is never pruned");
    assert_eq!(still.state, TaskState::Error);
    assert_eq!(
        store
            .active_task(addr("0000:5e:00.0"))
            .unwrap()
            .map(|t| t.id),
        Some(stuck.id)
    );
    let conn = Connection::open(dir.path().join(DB_FILE_NAME)).unwrap();
    let claims: i64 = conn
        .query_row("SELECT count(*) FROM claims", [], |r| r.get(0))
        .unwrap();
    assert_eq!(claims, 1);
    drop(conn);

    // Reading after an id that was pruned gives what is left, from the oldest kept.
    let kept = store.events(None, 0, usize::MAX).unwrap();
    let oldest = kept.first().unwrap().id;
    assert!(oldest > 1, "the oldest events are gone");
    let after = store.events(None, 1, 5).unwrap();
    assert_eq!(after.first().map(|e| e.id), Some(oldest));
    let newest = store.recent_events(None, None, 3).unwrap();
    assert_eq!(newest.last().map(|e| e.id), kept.last().map(|e| e.id));

    // The deletes were acknowledged like any write: the store reopens without a loss.
    drop(store);
    let store = Store::open(dir.path()).expect("the mark matches the pruned store");
    let (events, _) = store.history_counts().unwrap();
    assert!(events <= MAX_EVENTS);
}

#[test]
fn events_go_by_age_and_limits_of_zero_keep_everything() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    for i in 0..10 {
        store
            .record_event(NewEvent::new(None, EventKind::Config, format!("e{i}")))
            .unwrap();
    }
    // Nothing is older than a day, and nothing beyond a count: all stay.
    let mut limits = HistorySettings::default();
    assert_eq!(
        store.prune_history(&limits, vfiod_now_ms()).unwrap().events,
        0
    );
    // A day from now, with an age limit of a day less a second, every one is too old.
    limits.events_max_age = Some(Duration::from_secs(86_399));
    let tomorrow = vfiod_now_ms() + 86_400_000;
    assert_eq!(store.prune_history(&limits, tomorrow).unwrap().events, 10);
    assert_eq!(store.history_counts().unwrap().0, 0);
}

fn vfiod_now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

#[test]
fn a_backlog_is_deleted_in_batches_that_each_let_the_store_go() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    // A history from before retention: 1,600 events, written in one go by another connection.
    let mut conn = Connection::open(dir.path().join(DB_FILE_NAME)).unwrap();
    let tx = conn.transaction().unwrap();
    for i in 0..1_600 {
        tx.execute(
            "INSERT INTO events (time_ms, address, kind, message) VALUES (?1, NULL, 'config', 'old')",
            [i],
        )
        .unwrap();
    }
    tx.commit().unwrap();
    drop(conn);
    let limits = HistorySettings {
        // By count alone: these events are from 1970.
        events_max_age: None,
        events_max_count: Some(100),
        ..HistorySettings::default()
    };
    let p = store.prune_history(&limits, vfiod_now_ms()).unwrap();
    assert_eq!(p.events, 1_500);
    // 500 rows per transaction: three of them, the connection free between each.
    assert_eq!(
        p.batches,
        1_500_u64.div_ceil(vfiod::store::retention::BATCH as u64)
    );
    assert_eq!(store.history_counts().unwrap().0, 100);
    // Those it kept are the newest.
    let kept = store.events(None, 0, usize::MAX).unwrap();
    assert_eq!(kept.first().unwrap().id, 1_501);
}
