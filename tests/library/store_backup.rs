//! `vfioctl backup`'s copy (`src/store/backup.rs`) against real SQLite files: the copy holds
//! every committed row while the store is open, an existing file is kept without --force, no
//! temporary file is left, and no spelling of the live database's path is ever replaced.
//! (The restore through the real binaries is tests/simulated/history.rs.)

use rusqlite::Connection;
use vfiod::model::event::EventKind;
use vfiod::store::{NewEvent, Store, DB_FILE_NAME};

#[test]
fn a_backup_is_a_whole_copy_and_never_lands_on_the_store() {
    use vfiod::store::backup::{backup, BackupError};
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let store = Store::open(&state).unwrap();
    for i in 0..50 {
        store
            .record_event(NewEvent::new(None, EventKind::Config, format!("e{i}")))
            .unwrap();
    }
    // Onto the live database (even through another spelling of its directory), with --force:
    // refused, nothing changed.
    for dest in [
        state.join(DB_FILE_NAME),
        state.join("../state/vfiod.db-wal"),
        state.join("vfiod.acknowledged"),
    ] {
        match backup(&state, &dest, true) {
            Err(BackupError::OntoTheStore(p)) => assert_eq!(p, dest),
            other => panic!("{}: {other:?}", dest.display()),
        }
    }
    assert_eq!(store.history_counts().unwrap().0, 50);
    // Beside it, while the store is open and writing: the copy holds every committed event.
    let copy = dir.path().join("copy.db");
    let report = backup(&state, &copy, false).unwrap();
    assert_eq!(report.events, 50);
    assert_eq!(report.last_event, 50);
    assert!(report.bytes > 0);
    let held: i64 = Connection::open(&copy)
        .unwrap()
        .query_row("SELECT count(*) FROM events", [], |r| r.get(0))
        .unwrap();
    assert_eq!(held, 50);
    assert!(matches!(
        backup(&state, &copy, false),
        Err(BackupError::Exists(_))
    ));
    // No temporary file is left beside it.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}
