//! Issue 33 (3): the whole store lived in the write-ahead log, and a damaged log lost it
//! silently. Against real SQLite files: the faults of the issue on the files a crash leaves (a
//! copy of `vfiod.db`, `vfiod.db-wal` and `vfiod.acknowledged` taken while the store is open,
//! as a SIGKILL leaves them; no `-shm`, so the next open recovers from the log): a log cut to
//! half, 512 bytes of it flipped, the log removed while the store runs. After each, every
//! acknowledged claim is there, or the open refuses with an error that names what is missing.
//! And no ordinary crash is ever taken for a loss.

use std::path::{Path, PathBuf};
use vfiod::claim::{Owner, Requirements};
use vfiod::model::device::{Device, Kind, Mode, Role, State};
use vfiod::model::pci::{ClassCode, PciAddress};
use vfiod::store::{DeviceChange, Store, DB_FILE_NAME};

/// The mark file's name (`vfiod::store::ACK_FILE_NAME`), spelled out so that the crash images
/// of this file are the same before and after the fix.
const ACK: &str = "vfiod.acknowledged";

fn addr(s: &str) -> PciAddress {
    s.parse().unwrap()
}

fn device(address: &str, role: Role, group: u32) -> Device {
    Device {
        address: addr(address),
        vendor_id: 0x8086,
        device_id: if role == Role::Vf { 0x154c } else { 0x1572 },
        subsystem_vendor_id: 0,
        subsystem_device_id: 0,
        revision: 2,
        class: ClassCode(0x020000),
        vendor_name: "Intel Corporation".into(),
        device_name: String::new(),
        kind: Kind::Nic,
        driver: Some("vfio-pci".into()),
        driver_override: None,
        numa_node: Some(0),
        iommu_group: Some(group),
        role,
        separable: role == Role::Pf,
        mode: if role == Role::Vf {
            Mode::None
        } else {
            Mode::Vf
        },
        total_vfs: if role == Role::Pf { 64 } else { 0 },
        num_vfs: if role == Role::Pf { 16 } else { 0 },
        parent_pf: (role == Role::Vf).then(|| addr("0000:3b:00.0")),
        managed: true,
        state: State::Usable,
        state_reason: String::new(),
    }
}

/// A store with one PF and 16 VFs.
fn host(dir: &Path) -> Store {
    let store = Store::open(dir).unwrap();
    let mut changes = vec![DeviceChange::Added(device("0000:3b:00.0", Role::Pf, 1))];
    for i in 0..16u32 {
        changes.push(DeviceChange::Added(device(
            &format!("0000:3b:{:02x}.{}", 2 + i / 8, i % 8),
            Role::Vf,
            100 + i,
        )));
    }
    store.apply_changes(&changes, &[]).unwrap();
    store
}

/// Claims a VF for `vm`; the claim's id (acknowledged: the call returned).
fn claim(store: &Store, vm: &str) -> i64 {
    let req = Requirements {
        role: Some(Role::Vf),
        ..Default::default()
    };
    let owner = Owner::new(Some(vm), None, 0, false).unwrap();
    store.claim(&req, &owner, "test").unwrap().id
}

fn wal(dir: &Path) -> PathBuf {
    dir.join(format!("{DB_FILE_NAME}-wal"))
}

/// The files a SIGKILL of the store's process would leave now, copied into a new directory:
/// the database, its log and the mark (each if present), not the shared-memory index.
fn crash_image(dir: &Path) -> tempfile::TempDir {
    let image = tempfile::tempdir().unwrap();
    for name in [
        DB_FILE_NAME.to_string(),
        format!("{DB_FILE_NAME}-wal"),
        ACK.into(),
    ] {
        match std::fs::read(dir.join(&name)) {
            Ok(bytes) => std::fs::write(image.path().join(&name), bytes).unwrap(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => panic!("{name}: {e}"),
        }
    }
    image
}

/// Opens the store in `dir`: every claim of `ids` must be there, or the open must refuse,
/// leaving the database file as it was, with an error that says acknowledged changes are
/// missing, which claims, and how to go on.
fn acknowledged_claims_kept_or_named(dir: &Path, ids: &[i64], what: &str) -> Option<String> {
    let db = dir.join(DB_FILE_NAME);
    let before = std::fs::read(&db).ok();
    match Store::open(dir) {
        Ok(store) => {
            for id in ids {
                assert!(
                    store.claim_record(*id).unwrap().is_some(),
                    "{what}: claim {id} was acknowledged and is gone, and the store opened \
                     without a word"
                );
            }
            None
        }
        Err(e) => {
            let text = vfiod::error_chain(&e);
            assert!(
                text.contains("lacks changes vfiod acknowledged")
                    || text.contains("is missing, but vfiod acknowledged"),
                "{what}: refused, but not for a loss: {text}"
            );
            let last = ids.iter().max().unwrap();
            assert!(
                text.contains(&format!("claim {last}")) || text.contains(&format!("to {last}")),
                "{what}: the refusal does not name the lost claims (up to {last}): {text}"
            );
            assert!(text.contains("--accept-store-loss"), "{what}: {text}");
            assert!(text.contains(&db.display().to_string()), "{what}: {text}");
            assert!(
                std::fs::read(&db).ok() == before,
                "{what}: the refused file was changed"
            );
            Some(text)
        }
    }
}

/// A log damaged in the crash image: cut to half, 512 bytes flipped in its middle or at its
/// start (its header), or gone.
#[test]
fn a_damaged_log_never_loses_acknowledged_claims_silently() {
    type Fault = fn(&Path);
    let faults: [(&str, Fault); 4] = [
        ("the log cut to half", |p| {
            let len = std::fs::metadata(p).unwrap().len();
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .unwrap()
                .set_len(len / 2)
                .unwrap();
        }),
        ("512 bytes flipped in the middle of the log", |p| {
            let mut bytes = std::fs::read(p).unwrap();
            let mid = bytes.len() / 2;
            bytes[mid..mid + 512].iter_mut().for_each(|b| *b = !*b);
            std::fs::write(p, bytes).unwrap();
        }),
        ("512 bytes flipped at the start of the log", |p| {
            let mut bytes = std::fs::read(p).unwrap();
            bytes[..512].iter_mut().for_each(|b| *b = !*b);
            std::fs::write(p, bytes).unwrap();
        }),
        ("the log removed", |p| std::fs::remove_file(p).unwrap()),
    ];
    for (what, fault) in faults {
        let dir = tempfile::tempdir().unwrap();
        let store = host(dir.path());
        let ids: Vec<i64> = (0..3).map(|i| claim(&store, &format!("vm{i}"))).collect();
        let image = crash_image(dir.path());
        drop(store);
        let log = wal(image.path());
        assert!(
            std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0) > 4096,
            "{what}: the claims are not in the log: the fault would test nothing"
        );
        fault(&log);
        match acknowledged_claims_kept_or_named(image.path(), &ids, what) {
            Some(refusal) => println!("{what}: refused: {refusal}"),
            None => println!("{what}: every claim kept"),
        }
    }
}

/// The log unlinked (or replaced by a copy) while the store runs, then two more claims
/// acknowledged: the files a crash leaves then hold all three.
#[test]
fn a_log_removed_or_replaced_while_the_store_runs_loses_nothing() {
    type Fault = fn(&Path);
    let faults: [(&str, Fault); 2] = [
        ("removed", |p| std::fs::remove_file(p).unwrap()),
        ("replaced by a copy", |p| {
            let copy = p.with_extension("copy");
            std::fs::copy(p, &copy).unwrap();
            std::fs::rename(&copy, p).unwrap();
        }),
    ];
    for (what, fault) in faults {
        let dir = tempfile::tempdir().unwrap();
        let store = host(dir.path());
        let mut ids = vec![claim(&store, "before")];
        fault(&wal(dir.path()));
        ids.push(claim(&store, "after-1"));
        ids.push(claim(&store, "after-2"));
        let image = crash_image(dir.path());
        drop(store);
        let store = Store::open(image.path())
            .unwrap_or_else(|e| panic!("log {what}: {}", vfiod::error_chain(&e)));
        for id in &ids {
            assert!(
                store.claim_record(*id).unwrap().is_some(),
                "log {what}: claim {id} acknowledged and lost"
            );
        }
        drop(store);
        // And the store in place (its own close) holds them too.
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.active_claim_records().unwrap().len(), 3, "log {what}");
    }
}

/// After [`Store::checkpoint`] (what a clean stop runs) the log is empty and `vfiod.db` alone
/// holds the whole store, even while the store stays open (the daemon's store outlives its
/// stop: other holders of the engine keep it).
#[test]
fn after_a_checkpoint_the_database_file_alone_holds_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = host(dir.path());
    let ids: Vec<i64> = (0..2).map(|i| claim(&store, &format!("vm{i}"))).collect();
    assert!(
        store.checkpoint().unwrap(),
        "the checkpoint did not complete"
    );
    assert_eq!(std::fs::metadata(wal(dir.path())).unwrap().len(), 0);
    let alone = tempfile::tempdir().unwrap();
    std::fs::copy(
        dir.path().join(DB_FILE_NAME),
        alone.path().join(DB_FILE_NAME),
    )
    .unwrap();
    let copy = Store::open(alone.path()).unwrap();
    for id in ids {
        assert!(copy.claim_record(id).unwrap().is_some(), "claim {id}");
    }
    assert_eq!(copy.devices().unwrap().len(), 17);
    drop(store);
}

/// While the store runs, the log is checkpointed as it grows: it stays near
/// `WAL_CHECKPOINT_PAGES` pages however much is written, and the database file grows instead.
#[test]
fn the_log_stays_bounded_while_the_store_runs() {
    use vfiod::store::{NewEvent, WAL_CHECKPOINT_PAGES};
    // Sizes only: the fast (memory) directory, where fsync costs nothing.
    let dir = crate::common::fast_tempdir();
    let store = Store::open(dir.path()).unwrap();
    let bound = 2 * WAL_CHECKPOINT_PAGES as u64 * 4096;
    let message = "x".repeat(20_000);
    let mut largest = 0;
    // About 12 MB of events, one commit each.
    for i in 0..600 {
        store
            .record_event(NewEvent::new(
                None,
                vfiod::model::event::EventKind::Config,
                format!("{i} {message}"),
            ))
            .unwrap();
        if i % 10 == 0 {
            largest = largest.max(std::fs::metadata(wal(dir.path())).unwrap().len());
        }
    }
    assert!(
        largest <= bound,
        "the log grew to {largest} bytes, over {bound}"
    );
    let main = std::fs::metadata(dir.path().join(DB_FILE_NAME))
        .unwrap()
        .len();
    assert!(main > 8 << 20, "the database file holds only {main} bytes");
}

/// No ordinary crash is taken for a loss: the files as a SIGKILL leaves them after each write,
/// with the mark before the write (a crash between the commit and the mark's write), and with
/// a mark slot torn by a power cut, all open with every claim there.
#[test]
fn an_ordinary_crash_is_never_taken_for_a_loss() {
    let dir = tempfile::tempdir().unwrap();
    let store = host(dir.path());
    let mut ids = Vec::new();
    for i in 0..6 {
        let mark_before = std::fs::read(dir.path().join(ACK)).unwrap();
        ids.push(claim(&store, &format!("vm{i}")));
        if i % 2 == 1 {
            store.release_claim(ids[i - 1], "test", "done").unwrap();
        }
        let cases = [
            ("after the write", None),
            ("the mark from before the write", Some(mark_before.clone())),
            ("a mark slot torn", {
                let mut torn = std::fs::read(dir.path().join(ACK)).unwrap();
                let len = torn.len();
                torn[len / 2 - 100..len / 2].fill(0);
                torn[20..100].fill(0);
                Some(torn)
            }),
        ];
        for (what, mark) in cases {
            let image = crash_image(dir.path());
            if let Some(m) = mark {
                std::fs::write(image.path().join(ACK), m).unwrap();
            }
            let reopened = Store::open(image.path())
                .unwrap_or_else(|e| panic!("write {i}, {what}: {}", vfiod::error_chain(&e)));
            for id in &ids {
                assert!(
                    reopened.claim_record(*id).unwrap().is_some(),
                    "write {i}, {what}"
                );
            }
        }
    }
}

/// A loss refused, then accepted by the operator: the store opens with what it holds, the
/// loss is an event of kind `store`, and the next plain open goes on from there.
#[test]
fn a_loss_is_refused_until_the_operator_accepts_it() {
    use vfiod::store::StoreError;
    let dir = tempfile::tempdir().unwrap();
    let store = host(dir.path());
    store.checkpoint().unwrap();
    let kept = claim(&store, "kept");
    store.checkpoint().unwrap();
    let ids: Vec<i64> = (0..2).map(|i| claim(&store, &format!("lost{i}"))).collect();
    let image = crash_image(dir.path());
    drop(store);
    std::fs::remove_file(wal(image.path())).unwrap();
    let err = Store::open(image.path()).unwrap_err();
    let StoreError::Lost { loss, .. } = &err else {
        panic!("{}", vfiod::error_chain(&err))
    };
    assert_eq!(loss.acknowledged.claims, ids[1]);
    assert_eq!(loss.store.claims, kept);
    let text = err.to_string();
    assert!(
        text.contains(&format!("claims {} to {}", ids[0], ids[1])),
        "{text}"
    );
    // Refused again: a refusal changes nothing.
    assert!(matches!(
        Store::open(image.path()),
        Err(StoreError::Lost { .. })
    ));
    let (store, accepted) = Store::open_accepting_loss(image.path()).unwrap();
    assert_eq!(accepted.map(|l| l.acknowledged.claims), Some(ids[1]));
    assert!(store.claim_record(kept).unwrap().is_some());
    let events = store.recent_events(None, None, 10).unwrap();
    let recorded = events
        .iter()
        .find(|e| e.kind.as_str() == "store")
        .unwrap_or_else(|| panic!("no store event in {events:?}"));
    assert!(
        recorded.message.contains("--accept-store-loss")
            && recorded
                .message
                .contains(&format!("claims {} to {}", ids[0], ids[1])),
        "{}",
        recorded.message
    );
    drop(store);
    let store = Store::open(image.path()).unwrap();
    // Nothing left to accept.
    drop(store);
    let (_, again) = Store::open_accepting_loss(image.path()).unwrap();
    assert_eq!(again, None);
}

/// `vfiod.db` gone where changes were acknowledged: refused before a new file is created;
/// `--init-state` (Store::init) starts afresh on purpose.
#[test]
fn a_missing_database_with_acknowledged_changes_is_refused() {
    use vfiod::store::StoreError;
    let dir = tempfile::tempdir().unwrap();
    let store = host(dir.path());
    let id = claim(&store, "vm");
    drop(store);
    std::fs::remove_file(dir.path().join(DB_FILE_NAME)).unwrap();
    let _ = std::fs::remove_file(wal(dir.path()));
    let err = Store::open(dir.path()).unwrap_err();
    assert!(matches!(err, StoreError::Missing { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains(&format!("claim {id}")), "{text}");
    assert!(
        !dir.path().join(DB_FILE_NAME).exists(),
        "a new file was created"
    );
    let store = Store::init(dir.path()).unwrap();
    assert!(store.claim_record(id).unwrap().is_none());
    drop(store);
    Store::open(dir.path()).unwrap();
}

/// Every table counts its changes (the triggers of schema version 9): a table added later
/// without them would let its changes be lost unnoticed.
#[test]
fn every_table_counts_its_changes() {
    let dir = tempfile::tempdir().unwrap();
    drop(Store::open(dir.path()).unwrap());
    let conn = rusqlite::Connection::open(dir.path().join(DB_FILE_NAME)).unwrap();
    let names = |sql: &str| -> Vec<String> {
        conn.prepare(sql)
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    };
    let tables = names(
        "SELECT name FROM sqlite_master WHERE type = 'table' \
         AND name NOT LIKE 'sqlite_%' AND name <> 'change_counter' ORDER BY name",
    );
    let triggers = names("SELECT name FROM sqlite_master WHERE type = 'trigger'");
    assert!(tables.len() >= 11, "{tables:?}");
    for t in &tables {
        for op in ["insert", "update", "delete"] {
            let name = format!("{t}_counted_{op}");
            assert!(triggers.contains(&name), "{name} missing");
        }
    }
    // And a change through another connection (an operator's sqlite3) counts too.
    let before: i64 = conn
        .query_row("SELECT changes FROM change_counter", [], |r| r.get(0))
        .unwrap();
    let deleted = conn.execute("DELETE FROM events", []).unwrap() as i64;
    conn.execute(
        "INSERT INTO cleaning (address, state, reason, since_ms) VALUES ('0000:01:00.0', 'pending', '', 0)",
        [],
    )
    .unwrap();
    let after: i64 = conn
        .query_row("SELECT changes FROM change_counter", [], |r| r.get(0))
        .unwrap();
    assert_eq!(after, before + deleted + 1);
}

/// A main file damaged in a page (512 bytes flipped) is refused, untouched, by the check at
/// open.
#[test]
fn a_damaged_database_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = host(dir.path());
    claim(&store, "vm");
    store.checkpoint().unwrap();
    drop(store);
    let db = dir.path().join(DB_FILE_NAME);
    let mut bytes = std::fs::read(&db).unwrap();
    assert!(bytes.len() >= 4 * 4096);
    // The start of the third page (a table's or an index's: its header and cell pointers).
    bytes[2 * 4096..2 * 4096 + 512]
        .iter_mut()
        .for_each(|b| *b = !*b);
    std::fs::write(&db, &bytes).unwrap();
    let err = match Store::open(dir.path()) {
        Ok(_) => panic!("a damaged file opened"),
        Err(e) => e,
    };
    let text = vfiod::error_chain(&err);
    assert!(
        text.contains("is damaged") || text.contains("not an SQLite database, or is corrupt"),
        "{text}"
    );
    assert!(text.contains("restore it from a backup"), "{text}");
    assert!(std::fs::read(&db).unwrap() == bytes, "the file was changed");
}
