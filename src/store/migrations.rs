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
pub(super) const MIGRATIONS: &[&str] = &[V1_INITIAL];

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
