//! The state store against real SQLite files in a temporary directory: round trips, atomic
//! inventory passes, persistence, migrations and refusals, durability settings, the claim and task
//! uniqueness rules, and concurrent writers.

use crate::common;

use rusqlite::Connection;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use vfiod::error_chain;
use vfiod::model::device::{Device, Kind, Mode, Role, State};
use vfiod::model::pci::{ClassCode, PciAddress};
use vfiod::store::{
    Counts, DeviceChange, NewEvent, Store, StoreError, DB_FILE_NAME, SCHEMA_VERSION,
};

fn addr(s: &str) -> PciAddress {
    s.parse().unwrap()
}

/// Every field set, at the edges of its range where that catches a narrowing conversion.
fn full_device(address: &str) -> Device {
    Device {
        address: addr(address),
        vendor_id: 0x8086,
        device_id: 0xffff,
        subsystem_vendor_id: 0xfffe,
        subsystem_device_id: 0x0001,
        revision: 0xff,
        class: ClassCode(0xff_ffff),
        vendor_name: "Intel Corporation".into(),
        device_name: "Ethernet «E810» 'quoted' \"name\"".into(),
        kind: Kind::Nic,
        driver: Some("ice".into()),
        driver_override: Some("vfio-pci".into()),
        numa_node: Some(3),
        iommu_group: Some(u32::MAX),
        role: Role::Pf,
        separable: true,
        mode: Mode::Vf,
        total_vfs: u32::MAX,
        num_vfs: 128,
        parent_pf: Some(addr("10000:ff:1f.7")),
        managed: true,
        state: State::Protected,
        state_reason: "host interface eth0 is up".into(),
    }
}

/// Every `Option` field `None`, every string empty.
fn bare_device(address: &str) -> Device {
    Device {
        address: addr(address),
        vendor_id: 0,
        device_id: 0,
        subsystem_vendor_id: 0,
        subsystem_device_id: 0,
        revision: 0,
        class: ClassCode(0),
        vendor_name: String::new(),
        device_name: String::new(),
        kind: Kind::Other,
        driver: None,
        driver_override: None,
        numa_node: None,
        iommu_group: None,
        role: Role::Function,
        separable: false,
        mode: Mode::None,
        total_vfs: 0,
        num_vfs: 0,
        parent_pf: None,
        managed: false,
        state: State::Usable,
        state_reason: String::new(),
    }
}

fn event(address: Option<&str>, kind: &str, message: &str) -> NewEvent {
    NewEvent::new(
        address.map(addr),
        kind.parse().expect("known event kind"),
        message,
    )
}

/// A second connection to the same file, as another process (or an operator's `sqlite3`) has.
fn raw(store_dir: &Path) -> Connection {
    Connection::open(store_dir.join(DB_FILE_NAME)).unwrap()
}

#[test]
fn devices_round_trip_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let full = full_device("0000:3b:00.0");
    let bare = bare_device("0000:3b:00.1");
    store
        .apply_changes(
            &[
                DeviceChange::Added(full.clone()),
                DeviceChange::Added(bare.clone()),
            ],
            &[],
        )
        .unwrap();
    assert_eq!(store.device(full.address).unwrap(), Some(full.clone()));
    assert_eq!(store.device(bare.address).unwrap(), Some(bare.clone()));
    assert_eq!(store.device(addr("0000:3b:00.2")).unwrap(), None);
    assert_eq!(store.devices().unwrap(), vec![full, bare]);

    // Real columns, not a blob: NULLs for None and integers for ids, queryable as such.
    let (driver, numa, group, class): (Option<String>, Option<i64>, Option<i64>, i64) = raw(
        dir.path()
    )
    .query_row(
        "SELECT driver, numa_node, iommu_group, class FROM devices WHERE address = '0000:3b:00.1'",
        [],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
    )
    .unwrap();
    assert_eq!((driver, numa, group, class), (None, None, None, 0));
    let group: i64 = raw(dir.path())
        .query_row(
            "SELECT iommu_group FROM devices WHERE kind = 'nic' AND separable = 1",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(group, i64::from(u32::MAX));
}

#[test]
fn devices_are_ordered_by_address_including_wide_domains() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let addresses = [
        "10000:00:00.0",
        "0000:3b:00.1",
        "ffff:00:00.0",
        "0000:03:00.0",
    ];
    let changes: Vec<_> = addresses
        .iter()
        .map(|a| DeviceChange::Added(bare_device(a)))
        .collect();
    store.apply_changes(&changes, &[]).unwrap();
    let got: Vec<String> = store
        .devices()
        .unwrap()
        .iter()
        .map(|d| d.address.to_string())
        .collect();
    assert_eq!(
        got,
        [
            "0000:03:00.0",
            "0000:3b:00.1",
            "ffff:00:00.0",
            "10000:00:00.0"
        ]
    );
}

#[test]
fn inventory_passes_persist_across_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let a = full_device("0000:01:00.0");
    let b = bare_device("0000:02:00.0");
    let c = bare_device("0000:03:00.0");
    let mut b2 = b.clone();
    b2.driver = Some("vfio-pci".into());
    b2.state = State::Broken;
    b2.state_reason = "config space reads all-ones".into();

    let (first, second, standalone);
    {
        let store = Store::open(dir.path()).unwrap();
        first = store
            .apply_changes(
                &[
                    DeviceChange::Added(a.clone()),
                    DeviceChange::Added(b.clone()),
                    DeviceChange::Added(c.clone()),
                ],
                &[
                    event(Some("0000:01:00.0"), "added", "GPU"),
                    event(Some("0000:02:00.0"), "added", "NVMe"),
                    event(Some("0000:03:00.0"), "added", "NIC"),
                ],
            )
            .unwrap();
        assert_eq!(first.len(), 3);
        assert!(first.windows(2).all(|w| w[0].id < w[1].id), "{first:?}");
        assert_eq!(
            store.counts().unwrap(),
            Counts {
                total: 3,
                usable: 2,
                protected: 1,
                broken: 0,
                cleaning: 0,
            }
        );
        // A change keeps the time the device first appeared and moves its last-seen time.
        let seen = |conn: &Connection| -> (i64, i64) {
            conn.query_row(
                "SELECT first_seen_ms, last_seen_ms FROM devices WHERE address = '0000:02:00.0'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap()
        };
        let (first_seen, last_seen) = seen(&raw(dir.path()));
        assert_eq!(first_seen, last_seen);
        // The store stamps in milliseconds of the wall clock: the change below must come in a
        // later millisecond to show that it moves the last-seen time.
        common::eventually_blocking(
            std::time::Duration::from_secs(1),
            "the wall clock passes the last-seen time",
            || {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_millis() as i64;
                (now > last_seen).then_some(())
            },
        );

        second = store
            .apply_changes(
                &[
                    DeviceChange::Changed {
                        old: b.clone(),
                        new: b2.clone(),
                    },
                    DeviceChange::Removed(c.clone()),
                ],
                &[
                    event(
                        Some("0000:02:00.0"),
                        "broken",
                        "config space reads all-ones",
                    ),
                    event(Some("0000:03:00.0"), "removed", "NIC gone"),
                ],
            )
            .unwrap();
        let (first_seen2, last_seen2) = seen(&raw(dir.path()));
        assert_eq!(first_seen2, first_seen);
        assert!(last_seen2 > last_seen, "{last_seen2} <= {last_seen}");
        standalone = store
            .record_event(event(None, "config", "reloaded"))
            .unwrap();
        assert!(standalone.id > second[1].id);
    }

    let store = Store::open(dir.path()).unwrap();
    assert_eq!(store.devices().unwrap(), vec![a, b2]);
    assert_eq!(store.device(c.address).unwrap(), None);
    assert_eq!(
        store.counts().unwrap(),
        Counts {
            total: 2,
            usable: 0,
            protected: 1,
            broken: 1,
            cleaning: 0,
        }
    );
    let mut expected: Vec<_> = first.into_iter().chain(second).collect();
    expected.push(standalone);
    assert_eq!(store.events(None, 0, 100).unwrap(), expected);

    // Paging and filtering.
    assert_eq!(
        store.events(None, expected[1].id, 2).unwrap(),
        expected[2..4]
    );
    assert_eq!(store.events(None, 0, 0).unwrap(), []);
    assert_eq!(
        store.events(Some(addr("0000:02:00.0")), 0, 100).unwrap(),
        [expected[1].clone(), expected[3].clone()]
    );
    assert_eq!(
        store
            .events(Some(addr("0000:02:00.0")), expected[1].id, 100)
            .unwrap(),
        [expected[3].clone()]
    );
    assert_eq!(store.events(None, expected[5].id, 100).unwrap(), []);
}

#[test]
fn added_twice_is_an_upsert_and_removing_an_absent_device_is_a_no_op() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let d = bare_device("0000:05:00.0");
    let mut d2 = d.clone();
    d2.driver = Some("nvme".into());
    store
        .apply_changes(&[DeviceChange::Added(d.clone())], &[])
        .unwrap();
    store
        .apply_changes(&[DeviceChange::Added(d2.clone())], &[])
        .unwrap();
    assert_eq!(store.devices().unwrap(), vec![d2]);
    store
        .apply_changes(&[DeviceChange::Removed(bare_device("0000:06:00.0"))], &[])
        .unwrap();
    assert_eq!(store.counts().unwrap().total, 1);
}

#[test]
fn a_change_of_address_is_refused_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let old = bare_device("0000:05:00.0");
    let new = bare_device("0000:06:00.0");
    let err = store
        .apply_changes(
            &[
                DeviceChange::Added(bare_device("0000:07:00.0")),
                DeviceChange::Changed { old, new },
            ],
            &[event(None, "changed", "x")],
        )
        .unwrap_err();
    assert!(matches!(err, StoreError::AddressChanged { .. }), "{err:?}");
    assert_eq!(store.counts().unwrap().total, 0);
    assert_eq!(store.events(None, 0, 10).unwrap(), []);
}

/// The state both atomicity tests start from and must find again after the failed pass.
fn seeded_store(dir: &Path) -> (Store, Vec<vfiod::store::Event>) {
    let store = Store::open(dir).unwrap();
    store
        .apply_changes(
            &[
                DeviceChange::Added(bare_device("0000:01:00.0")),
                DeviceChange::Added(bare_device("0000:02:00.0")),
            ],
            &[event(Some("0000:01:00.0"), "added", "one")],
        )
        .unwrap();
    let events = store.events(None, 0, 100).unwrap();
    (store, events)
}

#[test]
fn a_pass_that_fails_on_an_event_commits_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (store, events_before) = seeded_store(dir.path());
    let devices_before = store.devices().unwrap();
    let mut changed = bare_device("0000:01:00.0");
    changed.state = State::Broken;

    // The device writes and the first event succeed; the database refuses the second event.
    // (Event kinds are typed, so the nameless event this test once used cannot be built; a
    // trigger, as another process could install, fails the insert instead.)
    raw(dir.path())
        .execute_batch(
            "CREATE TRIGGER refuse_event BEFORE INSERT ON events WHEN NEW.message = 'refused' \
             BEGIN SELECT RAISE(ABORT, 'refused by the test trigger'); END;",
        )
        .unwrap();
    let err = store
        .apply_changes(
            &[
                DeviceChange::Changed {
                    old: bare_device("0000:01:00.0"),
                    new: changed,
                },
                DeviceChange::Removed(bare_device("0000:02:00.0")),
                DeviceChange::Added(full_device("0000:03:00.0")),
            ],
            &[
                event(Some("0000:01:00.0"), "broken", "x"),
                event(None, "config", "refused"),
            ],
        )
        .unwrap_err();
    assert!(matches!(err, StoreError::Sqlite { .. }), "{err:?}");
    assert!(
        error_chain(&err).contains("refused by the test trigger"),
        "{}",
        error_chain(&err)
    );
    assert!(
        err.to_string()
            .contains(&store.path().display().to_string()),
        "{err}"
    );

    assert_eq!(store.devices().unwrap(), devices_before);
    assert_eq!(store.events(None, 0, 100).unwrap(), events_before);
    // Not left inside a transaction: the next pass works and is durable.
    store.record_event(event(None, "config", "after")).unwrap();
    drop(store);
    let store = Store::open(dir.path()).unwrap();
    assert_eq!(store.devices().unwrap(), devices_before);
    assert_eq!(
        store.events(None, 0, 100).unwrap().len(),
        events_before.len() + 1
    );
}

#[test]
fn a_pass_that_fails_between_device_writes_commits_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (store, events_before) = seeded_store(dir.path());
    let devices_before = store.devices().unwrap();
    // A fault injected by the database itself: the third device write aborts, after the first
    // two have been executed inside the transaction.
    raw(dir.path())
        .execute_batch(
            "CREATE TRIGGER fail_on_09 BEFORE INSERT ON devices \
             WHEN NEW.address = '0000:09:00.0' BEGIN SELECT RAISE(ABORT, 'injected fault'); END;",
        )
        .unwrap();
    let err = store
        .apply_changes(
            &[
                DeviceChange::Removed(bare_device("0000:01:00.0")),
                DeviceChange::Added(full_device("0000:08:00.0")),
                DeviceChange::Added(full_device("0000:09:00.0")),
            ],
            &[event(None, "added", "never recorded")],
        )
        .unwrap_err();
    assert!(
        error_chain(&err).contains("injected fault"),
        "{}",
        error_chain(&err)
    );
    assert_eq!(store.devices().unwrap(), devices_before);
    assert_eq!(store.events(None, 0, 100).unwrap(), events_before);
}

#[test]
fn a_fresh_database_is_at_the_current_schema_and_reopen_is_a_no_op() {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = dir.path().join("var/lib/vfiod");
    let store = Store::open(&state_dir).unwrap();
    assert_eq!(store.path(), state_dir.join("vfiod.db"));
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
    let mode = std::fs::metadata(&state_dir).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700, "state directory mode {mode:o}");

    let schema = |dir: &Path| -> Vec<(String, String)> {
        raw(dir)
            .prepare("SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL ORDER BY name")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    };
    let before = schema(&state_dir);
    let names: Vec<&str> = before.iter().map(|(n, _)| n.as_str()).collect();
    for table in ["devices", "events", "claims", "tasks", "original_drivers"] {
        assert!(names.contains(&table), "{table} missing from {names:?}");
    }
    store.record_event(event(None, "config", "kept")).unwrap();
    drop(store);

    let store = Store::open(&state_dir).unwrap();
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
    assert_eq!(schema(&state_dir), before);
    assert_eq!(store.events(None, 0, 10).unwrap().len(), 1);
}

#[test]
fn a_newer_database_is_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    drop(Store::open(dir.path()).unwrap());
    raw(dir.path())
        .pragma_update(None, "user_version", SCHEMA_VERSION + 1)
        .unwrap();

    let err = Store::open(dir.path()).unwrap_err();
    assert!(
        matches!(err, StoreError::TooNew { found, supported, .. }
            if found == SCHEMA_VERSION + 1 && supported == SCHEMA_VERSION),
        "{err:?}"
    );
    let message = err.to_string();
    let path = dir.path().join(DB_FILE_NAME).display().to_string();
    assert!(message.contains(&path), "{message}");
    assert!(
        message.contains(&format!("schema version {}", SCHEMA_VERSION + 1)),
        "{message}"
    );
    let version: u32 = raw(dir.path())
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .unwrap();
    assert_eq!(
        version,
        SCHEMA_VERSION + 1,
        "the newer database was downgraded"
    );
}

#[test]
fn a_file_that_is_not_sqlite_is_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(DB_FILE_NAME);
    let garbage: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 3) as u8).collect();
    std::fs::write(&path, &garbage).unwrap();

    let err = Store::open(dir.path()).unwrap_err();
    assert!(matches!(err, StoreError::NotADatabase { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "{err}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), garbage);
}

#[test]
fn another_programs_database_is_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(DB_FILE_NAME);
    Connection::open(&path)
        .unwrap()
        .execute_batch("CREATE TABLE devices (name TEXT); INSERT INTO devices VALUES ('x');")
        .unwrap();
    let err = Store::open(dir.path()).unwrap_err();
    assert!(matches!(err, StoreError::Foreign { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "{err}"
    );
    let conn = Connection::open(&path).unwrap();
    let mode: String = conn
        .pragma_query_value(None, "journal_mode", |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "delete", "the refused file was switched to WAL");

    // A versioned file with someone else's application id.
    conn.pragma_update(None, "user_version", 1).unwrap();
    conn.pragma_update(None, "application_id", 42).unwrap();
    drop(conn);
    let err = Store::open(dir.path()).unwrap_err();
    assert!(matches!(err, StoreError::Foreign { .. }), "{err:?}");
}

#[test]
fn wal_and_full_synchronous_are_in_effect() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    store.record_event(event(None, "config", "x")).unwrap();
    // journal_mode is a property of the file: any connection reads it back.
    let mode: String = raw(dir.path())
        .pragma_query_value(None, "journal_mode", |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    assert!(dir.path().join("vfiod.db-wal").exists());
    // synchronous is per connection; the store's own connection is checked in its unit tests.
}

#[test]
fn an_undecodable_row_names_its_address_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    store
        .apply_changes(&[DeviceChange::Added(full_device("0000:3b:00.0"))], &[])
        .unwrap();
    let cases = [
        (
            "UPDATE devices SET kind = 'tpu'",
            "kind",
            "unknown kind \"tpu\"",
        ),
        (
            "UPDATE devices SET vendor_id = 70000",
            "vendor_id",
            "out of range",
        ),
        (
            "UPDATE devices SET revision = -1",
            "revision",
            "out of range",
        ),
        (
            "UPDATE devices SET mode = 'split'",
            "mode",
            "unknown mode \"split\"",
        ),
        (
            "UPDATE devices SET parent_pf = 'nonsense'",
            "parent_pf",
            "invalid PCI address",
        ),
        (
            "UPDATE devices SET numa_node = 'zero'",
            "numa_node",
            "Invalid column type",
        ),
    ];
    for (sql, column, cause) in cases {
        raw(dir.path()).execute_batch(sql).unwrap();
        for result in [
            store.devices().map(drop),
            store.device(addr("0000:3b:00.0")).map(drop),
        ] {
            let err = result.unwrap_err();
            let message = err.to_string();
            assert!(matches!(err, StoreError::Decode { .. }), "{sql}: {err:?}");
            assert!(message.contains("0000:3b:00.0"), "{sql}: {message}");
            assert!(
                message.contains(&format!("column {column} ")),
                "{sql}: {message}"
            );
            assert!(
                error_chain(&err).contains(cause),
                "{sql}: {}",
                error_chain(&err)
            );
        }
        // Put the row back for the next case.
        store
            .apply_changes(&[DeviceChange::Added(full_device("0000:3b:00.0"))], &[])
            .unwrap();
        assert!(store.devices().is_ok());
    }
    // Counting does not decode, so it keeps working beside a row from the future.
    raw(dir.path())
        .execute_batch("UPDATE devices SET state = 'quarantined'")
        .unwrap();
    assert_eq!(
        store.counts().unwrap(),
        Counts {
            total: 1,
            usable: 0,
            protected: 0,
            broken: 0,
            cleaning: 0,
        }
    );

    raw(dir.path())
        .execute_batch(
            "INSERT INTO events (time_ms, address, kind, message) VALUES (1, 'bogus', 'added', '')",
        )
        .unwrap();
    let err = store.events(None, 0, 10).unwrap_err();
    assert!(
        err.to_string().contains("column address of events row 1"),
        "{err}"
    );
}

#[test]
fn at_most_one_active_claim_per_address() {
    let dir = tempfile::tempdir().unwrap();
    drop(Store::open(dir.path()).unwrap());
    let conn = raw(dir.path());
    let claim = |address: &str, state: &str| {
        conn.execute(
            "INSERT INTO claims (address, vm_name, state, created_ms, updated_ms) \
             VALUES (?1, 'vm', ?2, 0, 0)",
            [address, state],
        )
    };
    claim("0000:3b:00.0", "claimed").unwrap();
    for state in ["claimed", "attached"] {
        let err = claim("0000:3b:00.0", state).unwrap_err();
        assert!(
            err.to_string().contains("UNIQUE constraint failed"),
            "{state}: {err}"
        );
    }
    // History and other devices are free.
    claim("0000:3b:00.0", "released").unwrap();
    claim("0000:3b:00.0", "released").unwrap();
    claim("0000:3b:00.1", "attached").unwrap();
    // Once the active claim ends, a new one may start.
    conn.execute("UPDATE claims SET state = 'released' WHERE id = 1", [])
        .unwrap();
    claim("0000:3b:00.0", "attached").unwrap();
}

#[test]
fn at_most_one_open_task_per_address() {
    let dir = tempfile::tempdir().unwrap();
    drop(Store::open(dir.path()).unwrap());
    let conn = raw(dir.path());
    let task = |address: &str, state: &str| {
        conn.execute(
            "INSERT INTO tasks (address, kind, state, created_ms) VALUES (?1, 'split', ?2, 0)",
            [address, state],
        )
    };
    task("0000:3b:00.0", "running").unwrap();
    for state in ["prepare", "running", "error"] {
        let err = task("0000:3b:00.0", state).unwrap_err();
        assert!(
            err.to_string().contains("UNIQUE constraint failed"),
            "{state}: {err}"
        );
    }
    task("0000:3b:00.0", "done").unwrap();
    task("0000:3b:00.0", "failed").unwrap();
    task("0000:3b:00.1", "prepare").unwrap();
    // A task left in error still blocks until it is closed.
    conn.execute("UPDATE tasks SET state = 'error' WHERE id = 1", [])
        .unwrap();
    assert!(task("0000:3b:00.0", "prepare").is_err());
    conn.execute("UPDATE tasks SET state = 'failed' WHERE id = 1", [])
        .unwrap();
    task("0000:3b:00.0", "prepare").unwrap();
    assert!(conn
        .execute("UPDATE tasks SET percent = 101 WHERE id = 1", [])
        .unwrap_err()
        .to_string()
        .contains("CHECK constraint failed"));
}

const THREADS: usize = 8;
const PASSES: usize = 25;

/// Each writer adds its own devices with one event per pass, then every event is checked.
fn check_concurrent_writers(stores: Vec<Arc<Store>>, reader: &Store) {
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let store = stores[t % stores.len()].clone();
            std::thread::spawn(move || {
                let mut recorded = Vec::new();
                for p in 0..PASSES {
                    let address = format!("0000:{:02x}:{:02x}.0", t + 1, p);
                    let events = store
                        .apply_changes(
                            &[DeviceChange::Added(bare_device(&address))],
                            &[event(Some(&address), "added", &format!("{t}/{p}"))],
                        )
                        .unwrap();
                    recorded.extend(events);
                    // Readers interleave with the other writers.
                    assert!(store.counts().unwrap().total as usize > p);
                }
                recorded
            })
        })
        .collect();
    let mut recorded: Vec<_> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    recorded.sort_by_key(|e| e.id);

    let stored = reader.events(None, 0, usize::MAX).unwrap();
    assert_eq!(stored.len(), THREADS * PASSES);
    assert_eq!(stored, recorded, "returned ids and stored events disagree");
    assert!(stored.windows(2).all(|w| w[0].id < w[1].id));
    assert_eq!(reader.counts().unwrap().total as usize, THREADS * PASSES);
    for e in &stored {
        let device = reader.device(e.address.unwrap()).unwrap();
        assert!(device.is_some(), "event {} without its device", e.id);
    }
}

#[test]
fn concurrent_writers_through_one_store_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(dir.path()).unwrap());
    check_concurrent_writers(vec![store.clone()], &store);
}

#[test]
fn concurrent_writers_through_two_connections_wait_for_each_other() {
    // Two stores on one file stand for two processes: only the busy timeout and the immediate
    // transactions keep them from failing with "database is locked".
    let dir = tempfile::tempdir().unwrap();
    let one = Arc::new(Store::open(dir.path()).unwrap());
    let two = Arc::new(Store::open(dir.path()).unwrap());
    check_concurrent_writers(vec![one.clone(), two], &one);
}
