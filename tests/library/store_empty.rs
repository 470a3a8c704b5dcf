//! Issue 24 (12): a 0-byte `vfiod.db` was taken as a new store, and every claim was gone with
//! only an INFO line ("migrated from=0 to=7"). A database file that is there but empty or
//! truncated is refused, untouched, with an error that says what to do; `vfiod --init-state`
//! (`Store::init`) starts afresh on an empty one on purpose; a missing file is a first start.

use std::path::Path;
use std::process::Command;
use vfiod::store::{Store, StoreError, DB_FILE_NAME, SCHEMA_VERSION};

/// A real store with content, closed: its bytes (the WAL checkpointed into the file).
fn a_real_store(dir: &Path) -> Vec<u8> {
    let store = Store::open(dir).unwrap();
    drop(store);
    // Checkpointed on close; the file alone is the database.
    let path = dir.join(DB_FILE_NAME);
    assert!(
        !dir.join(format!("{DB_FILE_NAME}-wal")).exists() || {
            std::fs::metadata(dir.join(format!("{DB_FILE_NAME}-wal")))
                .unwrap()
                .len()
                == 0
        }
    );
    std::fs::read(path).unwrap()
}

#[test]
fn an_empty_or_truncated_database_is_refused_untouched() {
    let model = tempfile::tempdir().unwrap();
    let full = a_real_store(model.path());
    assert!(full.len() > 8192, "{}", full.len());
    let sqlite_without_tables = {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.db");
        let c = rusqlite::Connection::open(&p).unwrap();
        c.execute_batch("CREATE TABLE t (x); DROP TABLE t;")
            .unwrap();
        drop(c);
        std::fs::read(&p).unwrap()
    };
    assert!(!sqlite_without_tables.is_empty());
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("0 bytes", Vec::new()),
        ("an SQLite file without a table", sqlite_without_tables),
        ("50 bytes", full[..50].to_vec()),
        ("one page", full[..4096].to_vec()),
        ("half", full[..full.len() / 2].to_vec()),
        ("all but the last page", full[..full.len() - 4096].to_vec()),
    ];
    for (what, bytes) in cases {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(DB_FILE_NAME);
        std::fs::write(&path, &bytes).unwrap();
        let err = match Store::open(dir.path()) {
            Ok(_) => panic!("{what}: opened as a store"),
            Err(e) => e,
        };
        let text = vfiod::error_chain(&err);
        assert!(
            matches!(
                err,
                StoreError::Empty { .. }
                    | StoreError::NotADatabase { .. }
                    | StoreError::Damaged { .. }
            ),
            "{what}: {text}"
        );
        assert!(text.contains(&path.display().to_string()), "{what}: {text}");
        if matches!(err, StoreError::Empty { .. }) {
            assert!(text.contains("vfiod --init-state"), "{what}: {text}");
        }
        assert_eq!(
            std::fs::read(&path).unwrap(),
            bytes,
            "{what}: the file was changed"
        );
        println!("{what}: {text}");
    }
}

#[test]
fn init_takes_an_empty_file_as_a_new_store_and_a_missing_file_is_a_first_start() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(DB_FILE_NAME), b"").unwrap();
    assert!(matches!(
        Store::open(dir.path()),
        Err(StoreError::Empty { .. })
    ));
    let store = Store::init(dir.path()).unwrap();
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
    drop(store);
    // From now on a plain open works: it is a store.
    Store::open(dir.path()).unwrap();
    // No file at all: the first start creates it.
    let fresh = tempfile::tempdir().unwrap();
    let store = Store::open(fresh.path()).unwrap();
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
}

/// The binary: `vfiod` refuses to start on an empty `vfiod.db` (exit 1, the message on
/// stderr), `vfiod --init-state` makes it a store, and `--init-state` on a real store changes
/// nothing in it.
#[test]
fn vfiod_refuses_an_empty_database_and_init_state_creates_it() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let db = state.join(DB_FILE_NAME);
    std::fs::write(&db, b"").unwrap();
    let config = dir.path().join("vfiod.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = \"{}\"\nsysfs_root = \"{}\"\n",
            state.display(),
            dir.path().join("no-sysfs").display()
        ),
    )
    .unwrap();
    let vfiod = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_vfiod"))
            .arg("--config")
            .arg(&config)
            .arg("--conf-dir")
            .arg(dir.path().join("conf.d"))
            .args(args)
            .env("VFIOD_LOG", "warn")
            .output()
            .unwrap()
    };
    // A private address that nobody serves: the start fails at the store, before the bus.
    let out = vfiod(&["--bus", "unix:path=/nonexistent/bus"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("exists but is empty") && stderr.contains("--init-state"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::metadata(&db).unwrap().len(),
        0,
        "the file was changed"
    );

    let out = vfiod(&["--init-state"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!("schema version {SCHEMA_VERSION}")),
        "{stdout}"
    );
    let store = Store::open(&state).unwrap();
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
    drop(store);
    // Again: a store already, left as it is.
    let before = std::fs::read(&db).unwrap();
    assert!(vfiod(&["--init-state"]).status.success());
    assert_eq!(std::fs::read(&db).unwrap().len(), before.len());
}
