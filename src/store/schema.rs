//! Schema migrations: the ordered SQL steps that build the state database, and the loop that
//! applies the missing ones.
//!
//! `PRAGMA user_version` counts the steps applied. Step N (1-based) takes the schema from version
//! N-1 to N inside one transaction together with the `user_version` bump, so a crash or a failing
//! step leaves the database at the previous version, never half-migrated. Steps are append-only:
//! once released a step is never edited; a change is a new step at the end.
//!
//! The SQL avoids features newer than SQLite 3.34 (no `STRICT` tables, no `RETURNING`): vfiod links
//! the distribution's libsqlite3, and the enterprise distributions that host accelerators ship old
//! ones.

use rusqlite::{Connection, TransactionBehavior};

/// `PRAGMA application_id` of a vfiod database ("vfio" in ASCII), so that `open` can tell a vfiod
/// database from some other program's SQLite file before touching it.
pub(super) const APPLICATION_ID: i32 = 0x7666_696f;

/// Every migration step, oldest first. [`super::SCHEMA_VERSION`] is its length.
pub(super) const MIGRATIONS: &[&str] = &[
    V1_INITIAL,
    V2_TASKS,
    V3_TASK_SCOPE,
    V4_CLAIMS,
    V5_IMAGES,
    V6_IMAGE_SOURCE,
    V7_POOLED,
    V8_CLEANING,
    V9_CHANGE_COUNTER,
];

/// Version 1: the inventory, its history, and the tables claims, tasks and driver restore will
/// fill.
///
/// Enum-valued columns (`kind`, `role`, `mode`, `state`, claim and task states) deliberately carry
/// no `CHECK (x IN (...))`: SQLite cannot alter a constraint without rebuilding the table, and a
/// value this version does not know is reported when the row is decoded instead.
///
/// No foreign key ties `claims`, `tasks`, `events` or `original_drivers` to `devices`: a `devices`
/// row lives only while the function is present, and those records must outlive a function that
/// disappears for a moment (reset, VF re-creation, hot-unplug).
const V1_INITIAL: &str = "
PRAGMA application_id = 1986423151;

-- One row per PCI function currently present; a column per Device field so that queries can
-- filter on them. Timestamps are Unix milliseconds; first_seen_ms is when this presence began,
-- last_seen_ms the last inventory pass that wrote the row.
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

-- Every inventory change and administrative action, never silent. AUTOINCREMENT because clients
-- page through the history by id: an id must never be reused, even after old events are pruned.
CREATE TABLE events (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    time_ms INTEGER NOT NULL,
    address TEXT,
    kind    TEXT NOT NULL CHECK (kind <> ''),
    message TEXT NOT NULL
);
CREATE INDEX events_by_address ON events (address, id);

-- A VM's hold on a device. Rows stay after release as history; only an active claim is unique.
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

-- Long work on a device (split, restore, program). A task in error stays open until someone
-- acknowledges it, so it still blocks a new task on that device. step and message are never
-- NULL because D-Bus strings cannot be.
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

-- The driver a device had before vfiod first rebound it, to put it back on restore. A NULL driver
-- means it had none, which is different from having no row at all.
CREATE TABLE original_drivers (
    address     TEXT PRIMARY KEY NOT NULL,
    driver      TEXT,
    recorded_ms INTEGER NOT NULL
);
";

/// Version 2: what the task engine needs to record about a task, and a reset that frees the device.
///
/// A task in error is closed by an operator's reset, which keeps the row as history (state stays
/// `error`) and stamps who and when; the unique index is rebuilt so that a reset row no longer
/// counts as active. Every statement is additive: rows of version 1 keep their values, get the
/// defaults below, and a version-1 task in error stays active until it is reset.
const V2_TASKS: &str = "
-- The task's parameters as a JSON object (e.g. {\"num_vfs\":64}), and who asked for it (a uid or
-- a D-Bus sender), both shown with the task and in its events.
ALTER TABLE tasks ADD COLUMN params TEXT NOT NULL DEFAULT '{}';
ALTER TABLE tasks ADD COLUMN requested_by TEXT NOT NULL DEFAULT '';
-- Set together when an operator resets a task in error.
ALTER TABLE tasks ADD COLUMN reset_ms INTEGER;
ALTER TABLE tasks ADD COLUMN reset_by TEXT;

DROP INDEX tasks_one_open_per_address;
CREATE UNIQUE INDEX tasks_one_open_per_address
    ON tasks (address)
    WHERE state IN ('prepare', 'running') OR (state = 'error' AND reset_ms IS NULL);

-- A device's task history, newest first, and its last result.
CREATE INDEX tasks_by_address ON tasks (address, id);
";

/// Version 3: what a task works on besides its own device.
const V3_TASK_SCOPE: &str = "
-- The other functions a task changes: the rest of its IOMMU group (a GPU's task moves its audio
-- function too), the VFs it creates or removes. A new task is refused while an active task has
-- its device or any of these in its scope, so two tasks never write to one function.
CREATE TABLE task_scope (
    task_id INTEGER NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    address TEXT NOT NULL,
    PRIMARY KEY (task_id, address)
);
CREATE INDEX task_scope_by_address ON task_scope (address);
";

/// Version 4: claims as the claims feature makes them. A claim holds every function of its
/// IOMMU group (`claim_functions`); the database, not a check before the insert, keeps one active
/// claim per function and a PF apart from its VFs. A claim row stays after release as history.
const V4_CLAIMS: &str = "
-- Who asked (a uid or a D-Bus sender); the claimed device's kind ('' for a version-1 row);
-- when an unattached claim lapses (NULL: no lease); whether it outlives the VM's run; when it
-- was released.
ALTER TABLE claims ADD COLUMN requested_by TEXT NOT NULL DEFAULT '';
ALTER TABLE claims ADD COLUMN kind TEXT NOT NULL DEFAULT '';
ALTER TABLE claims ADD COLUMN lease_expires_ms INTEGER;
ALTER TABLE claims ADD COLUMN persistent INTEGER NOT NULL DEFAULT 0 CHECK (persistent IN (0, 1));
ALTER TABLE claims ADD COLUMN released_ms INTEGER;

-- Every state but 'released' holds the claim (attaching and detaching too).
DROP INDEX claims_one_active_per_address;
CREATE UNIQUE INDEX claims_one_active_per_address
    ON claims (address) WHERE state <> 'released';

-- The functions a claim holds: its device and the rest of its IOMMU group. family is the PF's
-- address for a PF and for each of its VFs (NULL for a function without SR-IOV); is_pf marks
-- the PF. active goes to 0 when the claim is released, never back.
CREATE TABLE claim_functions (
    claim_id INTEGER NOT NULL REFERENCES claims (id) ON DELETE CASCADE,
    address  TEXT NOT NULL,
    family   TEXT,
    is_pf    INTEGER NOT NULL CHECK (is_pf IN (0, 1)),
    active   INTEGER NOT NULL DEFAULT 1 CHECK (active IN (0, 1)),
    PRIMARY KEY (claim_id, address)
);
CREATE UNIQUE INDEX claim_functions_one_active_per_address
    ON claim_functions (address) WHERE active = 1;
CREATE INDEX claim_functions_by_family ON claim_functions (family) WHERE active = 1;

-- The leases the daemon checks every second.
CREATE INDEX claims_by_lease ON claims (lease_expires_ms) WHERE state = 'claimed';

-- A PF held whole and one of its VFs held by another claim would give two VMs one device.
CREATE TRIGGER claim_functions_pf_apart_from_vfs
BEFORE INSERT ON claim_functions
WHEN NEW.active = 1 AND NEW.family IS NOT NULL AND EXISTS (
    SELECT 1 FROM claim_functions c
    WHERE c.active = 1 AND c.family = NEW.family AND c.claim_id <> NEW.claim_id
      AND (c.is_pf = 1 OR NEW.is_pf = 1))
BEGIN
    SELECT RAISE(ABORT, 'a PF and its VFs cannot be held by different claims');
END;

CREATE TRIGGER claim_functions_never_held_again
BEFORE UPDATE OF active ON claim_functions
WHEN NEW.active = 1 AND OLD.active = 0
BEGIN
    SELECT RAISE(ABORT, 'a released claim cannot hold its functions again');
END;

-- Claims of version 1 (none were made) would hold their one address.
INSERT INTO claim_functions (claim_id, address, family, is_pf, active)
    SELECT id, address, NULL, 0, 1 FROM claims WHERE state IN ('claimed', 'attached');
";

/// Version 5: the FPGA image catalog. Ids are 32 lowercase hex digits; `afu_ids` is a JSON array
/// of them, `metadata` the header's JSON. `path` is the file under `<state_dir>/images`.
const V5_IMAGES: &str = "
CREATE TABLE images (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    name         TEXT NOT NULL UNIQUE CHECK (name <> ''),
    format       TEXT NOT NULL,
    sha256       TEXT NOT NULL,
    size         INTEGER NOT NULL,
    path         TEXT NOT NULL,
    interface_id TEXT,
    afu_ids      TEXT NOT NULL DEFAULT '[]',
    metadata     TEXT NOT NULL DEFAULT '{}',
    state        TEXT NOT NULL,
    added_by     TEXT NOT NULL,
    added_ms     INTEGER NOT NULL
);
";

/// Version 6: where an image was downloaded from (`Images.AddFromUrl`): NULL for an image
/// passed by descriptor or path. The program task fetches the image again from it when the
/// local copy is gone; the SHA-256 recorded with the image still decides.
const V6_IMAGE_SOURCE: &str = "
ALTER TABLE images ADD COLUMN source_url TEXT;
";

/// Version 7: pooled claims, a remote pool's session leased to a VM (issue 11). A table of its
/// own: a pooled device is no PCI function of this host, and the PCI claims' constraints
/// (`claim_functions`, one active claim per address) do not apply to it. Rows stay as history.
const V7_POOLED: &str = "
CREATE TABLE pooled_claims (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    pool         TEXT NOT NULL CHECK (pool <> ''),
    session      TEXT NOT NULL CHECK (session <> ''),
    device       TEXT NOT NULL,
    epoch        INTEGER NOT NULL CHECK (epoch >= 0),
    state        TEXT NOT NULL,
    reason       TEXT NOT NULL DEFAULT '',
    vm_name      TEXT,
    vm_uuid      TEXT,
    peer_host    TEXT,
    requested_by TEXT NOT NULL,
    created_ms   INTEGER NOT NULL,
    updated_ms   INTEGER NOT NULL
);
-- One standing claim per session on this host (history rows aside).
CREATE UNIQUE INDEX pooled_claims_one_per_session
    ON pooled_claims (pool, session) WHERE state NOT IN ('released', 'forgotten');
";

/// Version 8: cleaning between tenants (issue 23). `cleaning` holds a function out of the pool
/// from the end of its claim until a clean succeeds (`pending`), or until an operator clears a
/// quarantine (`quarantined`); a row is written in the transaction that ends the claim, so no
/// claim can take the function in between. `reset_health` is each function's reset history; it
/// outlives the function (a VF comes back with the same address).
const V8_CLEANING: &str = "
CREATE TABLE cleaning (
    address  TEXT PRIMARY KEY,
    state    TEXT NOT NULL,
    reason   TEXT NOT NULL,
    claim_id INTEGER,
    since_ms INTEGER NOT NULL
);
CREATE TABLE reset_health (
    address         TEXT PRIMARY KEY,
    method          TEXT,
    duration_ms     INTEGER,
    ok_ms           INTEGER,
    failure         TEXT,
    failure_ms      INTEGER,
    failures_in_row INTEGER NOT NULL DEFAULT 0 CHECK (failures_in_row >= 0),
    cleans          INTEGER NOT NULL DEFAULT 0 CHECK (cleans >= 0)
);
";

/// Version 9: the change counter (src/store/integrity.rs). Every row inserted, updated or
/// deleted in any table bumps it, in the change's own transaction, by these triggers; after each
/// commit vfiod writes it to `vfiod.acknowledged`, and a database found behind that mark at the
/// next start lost acknowledged changes. A table added later gets the same three triggers
/// (`tests/library/store_integrity.rs` fails otherwise).
const V9_CHANGE_COUNTER: &str = "
CREATE TABLE change_counter (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    changes INTEGER NOT NULL CHECK (changes >= 0)
);
INSERT INTO change_counter (id, changes) VALUES (1, 0);
CREATE TRIGGER devices_counted_insert AFTER INSERT ON devices
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER devices_counted_update AFTER UPDATE ON devices
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER devices_counted_delete AFTER DELETE ON devices
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER events_counted_insert AFTER INSERT ON events
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER events_counted_update AFTER UPDATE ON events
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER events_counted_delete AFTER DELETE ON events
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER claims_counted_insert AFTER INSERT ON claims
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER claims_counted_update AFTER UPDATE ON claims
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER claims_counted_delete AFTER DELETE ON claims
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER tasks_counted_insert AFTER INSERT ON tasks
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER tasks_counted_update AFTER UPDATE ON tasks
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER tasks_counted_delete AFTER DELETE ON tasks
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER original_drivers_counted_insert AFTER INSERT ON original_drivers
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER original_drivers_counted_update AFTER UPDATE ON original_drivers
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER original_drivers_counted_delete AFTER DELETE ON original_drivers
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER task_scope_counted_insert AFTER INSERT ON task_scope
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER task_scope_counted_update AFTER UPDATE ON task_scope
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER task_scope_counted_delete AFTER DELETE ON task_scope
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER claim_functions_counted_insert AFTER INSERT ON claim_functions
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER claim_functions_counted_update AFTER UPDATE ON claim_functions
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER claim_functions_counted_delete AFTER DELETE ON claim_functions
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER images_counted_insert AFTER INSERT ON images
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER images_counted_update AFTER UPDATE ON images
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER images_counted_delete AFTER DELETE ON images
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER pooled_claims_counted_insert AFTER INSERT ON pooled_claims
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER pooled_claims_counted_update AFTER UPDATE ON pooled_claims
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER pooled_claims_counted_delete AFTER DELETE ON pooled_claims
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER cleaning_counted_insert AFTER INSERT ON cleaning
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER cleaning_counted_update AFTER UPDATE ON cleaning
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER cleaning_counted_delete AFTER DELETE ON cleaning
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER reset_health_counted_insert AFTER INSERT ON reset_health
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER reset_health_counted_update AFTER UPDATE ON reset_health
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
CREATE TRIGGER reset_health_counted_delete AFTER DELETE ON reset_health
    BEGIN UPDATE change_counter SET changes = changes + 1; END;
";

/// Why [`migrate`] stopped: the step that failed (1-based target version) and SQLite's error.
#[derive(Debug)]
pub(super) struct MigrationError {
    pub version: u32,
    pub source: rusqlite::Error,
}

/// Applies the steps of `migrations` the database lacks; returns the version before and after.
///
/// The caller has already refused a database newer than `migrations`. Each step re-reads the
/// version under the write lock (`BEGIN IMMEDIATE`) because another process opening the same file
/// at the same moment may have applied it already.
pub(super) fn migrate(
    conn: &mut Connection,
    migrations: &[&str],
) -> Result<(u32, u32), MigrationError> {
    let before = user_version(conn).map_err(|source| MigrationError { version: 0, source })?;
    for (index, sql) in migrations.iter().enumerate() {
        let target = index as u32 + 1;
        if target <= before {
            continue;
        }
        apply_step(conn, target, sql).map_err(|source| MigrationError {
            version: target,
            source,
        })?;
    }
    let after = user_version(conn).map_err(|source| MigrationError {
        version: migrations.len() as u32,
        source,
    })?;
    Ok((before, after))
}

/// Applies one step and records `target` as the version, in one transaction.
fn apply_step(conn: &mut Connection, target: u32, sql: &str) -> rusqlite::Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    if user_version(&tx)? >= target {
        return Ok(());
    }
    tx.execute_batch(sql)?;
    tx.pragma_update(None, "user_version", target)?;
    tx.commit()
}

pub(super) fn user_version(conn: &Connection) -> rusqlite::Result<u32> {
    conn.pragma_query_value(None, "user_version", |row| row.get(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn application_id_literal_matches_constant() {
        // The SQL needs a literal; keep it in step with the constant `open` checks.
        assert!(V1_INITIAL.contains(&format!("application_id = {APPLICATION_ID};")));
    }

    #[test]
    fn version_2_keeps_version_1_rows_and_frees_reset_errors() {
        let mut conn = Connection::open_in_memory().unwrap();
        assert_eq!(migrate(&mut conn, &MIGRATIONS[..1]).unwrap(), (0, 1));
        conn.execute_batch(
            "INSERT INTO tasks (address, kind, state, step, percent, message, created_ms) \
             VALUES ('0000:3b:00.0', 'split', 'error', 'enable VFs', 40, 'EBUSY', 7);",
        )
        .unwrap();
        assert_eq!(migrate(&mut conn, &MIGRATIONS[..2]).unwrap(), (1, 2));

        let row: (String, i64, String, String, Option<i64>) = conn
            .query_row(
                "SELECT message, created_ms, params, requested_by, reset_ms FROM tasks",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
            )
            .unwrap();
        assert_eq!(row, ("EBUSY".into(), 7, "{}".into(), String::new(), None));
        let insert = "INSERT INTO tasks (address, kind, state, created_ms) \
                      VALUES ('0000:3b:00.0', 'split', 'prepare', 8)";
        // The version-1 error still blocks; once reset, it does not.
        assert!(conn.execute(insert, []).is_err());
        conn.execute("UPDATE tasks SET reset_ms = 9, reset_by = 'root'", [])
            .unwrap();
        conn.execute(insert, []).unwrap();
    }

    #[test]
    fn version_3_scopes_go_with_their_task() {
        let mut conn = Connection::open_in_memory().unwrap();
        conn.pragma_update(None, "foreign_keys", true).unwrap();
        assert_eq!(
            migrate(&mut conn, MIGRATIONS).unwrap(),
            (0, MIGRATIONS.len() as u32)
        );
        conn.execute_batch(
            "INSERT INTO tasks (id, address, kind, state, created_ms) \
                 VALUES (1, '0000:17:00.0', 'bind', 'success', 1); \
             INSERT INTO task_scope (task_id, address) VALUES (1, '0000:17:00.1');",
        )
        .unwrap();
        // No scope row without its task.
        assert!(conn
            .execute(
                "INSERT INTO task_scope (task_id, address) VALUES (2, '0000:17:00.1')",
                []
            )
            .is_err());
        conn.execute("DELETE FROM tasks WHERE id = 1", []).unwrap();
        let left: i64 = conn
            .query_row("SELECT count(*) FROM task_scope", [], |r| r.get(0))
            .unwrap();
        assert_eq!(left, 0);
    }

    #[test]
    fn the_unique_index_and_active_agree_with_the_state_machine() {
        use super::super::task::active_sql;
        use super::super::task_state::{is_active, TaskState};
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn, MIGRATIONS).unwrap();
        for (n, state) in TaskState::ALL.iter().copied().enumerate() {
            for reset in [false, true] {
                let address = format!("0000:{n:02x}:0{}.0", u8::from(reset));
                let row = |created: i64| {
                    conn.execute(
                        "INSERT INTO tasks (address, kind, state, created_ms, reset_ms) \
                         VALUES (?1, 'split', ?2, ?3, ?4)",
                        rusqlite::params![address, state.as_str(), created, reset.then_some(1)],
                    )
                };
                row(1).unwrap();
                let active: bool = conn
                    .query_row(
                        &format!("SELECT {} FROM tasks WHERE address = ?1", active_sql()),
                        [&address],
                        |r| r.get(0),
                    )
                    .unwrap();
                assert_eq!(active, is_active(state, reset), "{state} reset={reset}");
                // The index refuses a second row exactly when both would be active.
                assert_eq!(
                    row(2).is_err(),
                    is_active(state, reset),
                    "{state} reset={reset}"
                );
            }
        }
    }

    #[test]
    fn version_4_holds_a_function_once_and_a_pf_apart_from_its_vfs() {
        let mut conn = Connection::open_in_memory().unwrap();
        conn.pragma_update(None, "foreign_keys", true).unwrap();
        assert_eq!(
            migrate(&mut conn, MIGRATIONS).unwrap(),
            (0, MIGRATIONS.len() as u32)
        );
        let claim = |id: i64, address: &str| {
            conn.execute(
                "INSERT INTO claims (id, address, vm_name, state, created_ms, updated_ms) \
                 VALUES (?1, ?2, 'vm', 'claimed', 1, 1)",
                rusqlite::params![id, address],
            )
        };
        let hold = |id: i64, address: &str, family: Option<&str>, is_pf: bool| {
            conn.execute(
                "INSERT INTO claim_functions (claim_id, address, family, is_pf) \
                 VALUES (?1, ?2, ?3, ?4)",
                rusqlite::params![id, address, family, is_pf],
            )
        };
        let pf = "0000:3b:00.0";
        claim(1, "0000:3b:02.0").unwrap();
        hold(1, "0000:3b:02.0", Some(pf), false).unwrap();
        claim(2, "0000:3b:02.1").unwrap();
        hold(2, "0000:3b:02.1", Some(pf), false).unwrap();
        // The same function in a second claim, and its active claim row twice.
        claim(3, "0000:17:00.0").unwrap();
        assert!(hold(3, "0000:3b:02.0", Some(pf), false).is_err());
        assert!(claim(4, "0000:3b:02.0").is_err());
        // The PF beside its VFs.
        claim(5, pf).unwrap();
        let e = hold(5, pf, Some(pf), true).unwrap_err();
        assert!(e.to_string().contains("a PF and its VFs"), "{e}");
        // Released, a function is free for a new claim, and never held again by the old one.
        conn.execute_batch(
            "UPDATE claims SET state = 'released' WHERE id IN (1, 2); \
             UPDATE claim_functions SET active = 0 WHERE claim_id IN (1, 2);",
        )
        .unwrap();
        hold(5, pf, Some(pf), true).unwrap();
        // A VF beside its claimed PF.
        claim(6, "0000:3b:02.2").unwrap();
        assert!(hold(6, "0000:3b:02.2", Some(pf), false).is_err());
        assert!(conn
            .execute(
                "UPDATE claim_functions SET active = 1 WHERE claim_id = 1",
                []
            )
            .is_err());
        // A new claim of a released function's address.
        claim(7, "0000:3b:02.0").unwrap();
    }

    #[test]
    fn version_5_keeps_older_rows_and_names_images_once() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn, &MIGRATIONS[..4]).unwrap();
        conn.execute(
            "INSERT INTO tasks (id, address, kind, state, created_ms) \
             VALUES (1, '0000:af:00.0', 'split', 'success', 1)",
            [],
        )
        .unwrap();
        assert_eq!(migrate(&mut conn, &MIGRATIONS[..5]).unwrap(), (4, 5));
        let tasks: i64 = conn
            .query_row("SELECT count(*) FROM tasks", [], |r| r.get(0))
            .unwrap();
        assert_eq!(tasks, 1);
        let insert = "INSERT INTO images (name, format, sha256, size, path, state, added_by, \
                      added_ms) VALUES ('a', 'gbs', 'x', 1, '/p', 'active', 'root', 1)";
        conn.execute(insert, []).unwrap();
        assert!(conn.execute(insert, []).is_err(), "a name is unique");
    }

    #[test]
    fn version_6_gives_older_images_no_source() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn, &MIGRATIONS[..5]).unwrap();
        conn.execute(
            "INSERT INTO images (name, format, sha256, size, path, state, added_by, added_ms) \
             VALUES ('a', 'gbs', 'x', 1, '/p', 'active', 'root', 1)",
            [],
        )
        .unwrap();
        assert_eq!(migrate(&mut conn, &MIGRATIONS[..6]).unwrap(), (5, 6));
        let (name, source): (String, Option<String>) = conn
            .query_row("SELECT name, source_url FROM images", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .unwrap();
        assert_eq!((name.as_str(), source), ("a", None));
    }

    #[test]
    fn version_8_holds_a_function_once_and_counts_no_negative_failures() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn, &MIGRATIONS[..7]).unwrap();
        assert_eq!(migrate(&mut conn, &MIGRATIONS[..8]).unwrap(), (7, 8));
        let hold = |address: &str| {
            conn.execute(
                "INSERT INTO cleaning (address, state, reason, claim_id, since_ms) \
                 VALUES (?1, 'pending', 'claim 1 ended', 1, 1)",
                [address],
            )
        };
        hold("0000:01:00.1").unwrap();
        assert!(hold("0000:01:00.1").is_err(), "one hold per function");
        conn.execute(
            "INSERT INTO reset_health (address) VALUES ('0000:01:00.1')",
            [],
        )
        .unwrap();
        let (failures, cleans): (i64, i64) = conn
            .query_row(
                "SELECT failures_in_row, cleans FROM reset_health",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!((failures, cleans), (0, 0));
        assert!(conn
            .execute("UPDATE reset_health SET failures_in_row = -1", [])
            .is_err());
    }

    #[test]
    fn version_7_holds_one_standing_claim_per_pooled_session() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn, &MIGRATIONS[..6]).unwrap();
        assert_eq!(migrate(&mut conn, &MIGRATIONS[..7]).unwrap(), (6, 7));
        let insert = |state: &str| {
            conn.execute(
                "INSERT INTO pooled_claims (pool, session, device, epoch, state, requested_by, \
                 created_ms, updated_ms) VALUES ('gpus', 's-1', 'dev0', 1, ?1, 'root', 1, 1)",
                [state],
            )
        };
        insert("forgotten").unwrap();
        insert("leased").unwrap();
        assert!(insert("moving").is_err(), "one standing claim per session");
        conn.execute("UPDATE pooled_claims SET state = 'released'", [])
            .unwrap();
        insert("moving").unwrap();
        assert!(conn
            .execute(
                "INSERT INTO pooled_claims (pool, session, device, epoch, state, requested_by, \
                 created_ms, updated_ms) VALUES ('gpus', '', 'dev0', 1, 'leased', 'root', 1, 1)",
                [],
            )
            .is_err());
    }

    #[test]
    fn a_failing_step_rolls_back_alone() {
        let mut conn = Connection::open_in_memory().unwrap();
        let steps = [
            "CREATE TABLE one (x INTEGER);",
            "CREATE TABLE two (x INTEGER); INSERT INTO nowhere VALUES (1);",
        ];
        let err = migrate(&mut conn, &steps).unwrap_err();
        assert_eq!(err.version, 2);
        // Step 1 stays committed; step 2's table went with its transaction.
        assert_eq!(user_version(&conn).unwrap(), 1);
        let tables: Vec<String> = conn
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
            .unwrap()
            .query_map([], |row| row.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(tables, ["one"]);
        // Fixed, the remaining step applies and the first is not re-run.
        let fixed = [
            "CREATE TABLE one (x INTEGER);",
            "CREATE TABLE two (x INTEGER);",
        ];
        assert_eq!(migrate(&mut conn, &fixed).unwrap(), (1, 2));
        assert_eq!(migrate(&mut conn, &fixed).unwrap(), (2, 2));
    }
}
