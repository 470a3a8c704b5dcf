//! The pool service's own store: a SQLite file `<state-dir>/pool.db` (WAL),
//! not vfiod's. It holds the sessions (epochs, owners, quiesce deadlines), the stand-in
//! accelerator's queued items and undelivered results. Every change commits before the HTTP
//! reply, and a completed item moves from the queue to the results in one transaction, so a
//! kill at any point leaves every item either queued or completed, never half-done.
//!
//! Blocking: the service calls it under one mutex, briefly (one statement or transaction).

use std::fs::{DirBuilder, File, OpenOptions};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::{params, Connection, OptionalExtension, Transaction, TransactionBehavior};

use super::state::SessionRecord;
use crate::protocol::{SessionState, WorkItem, WorkResult};

/// File name of the database inside the state directory.
pub const DB_FILE_NAME: &str = "pool.db";
/// The lock file that keeps a second `vfiod-pool` off the same state directory.
pub const LOCK_FILE_NAME: &str = "pool.lock";

/// How long a statement waits for another connection's lock (a `sqlite3` shell, a backup).
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The schema, one step per version (`PRAGMA user_version` counts the steps applied).
const MIGRATIONS: &[&str] = &[
    "
    CREATE TABLE sessions (
        id TEXT PRIMARY KEY,
        num INTEGER NOT NULL UNIQUE,
        device TEXT NOT NULL,
        host TEXT NOT NULL,
        vm TEXT NOT NULL,
        epoch INTEGER NOT NULL,
        state TEXT NOT NULL,
        moving_to TEXT,
        quiesce_deadline_ms INTEGER,
        last_note TEXT,
        resumed_from INTEGER,
        last_seq INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX sessions_device ON sessions(device, state);
    CREATE TABLE items (
        session TEXT NOT NULL REFERENCES sessions(id),
        seq INTEGER NOT NULL,
        payload INTEGER NOT NULL,
        PRIMARY KEY (session, seq)
    ) WITHOUT ROWID;
    CREATE TABLE results (
        session TEXT NOT NULL REFERENCES sessions(id),
        seq INTEGER NOT NULL,
        value INTEGER NOT NULL,
        PRIMARY KEY (session, seq)
    ) WITHOUT ROWID;
",
    "
    -- The lease clock and the start read live sessions only, through this index: their cost
    -- does not grow with the released sessions kept for history (issue 24).
    CREATE INDEX sessions_state ON sessions(state, quiesce_deadline_ms);
",
];

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot create the state directory {}", .path.display())]
    StateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the state directory {} is in use by another vfiod-pool", .path.display())]
    Locked { path: PathBuf },
    #[error("cannot lock {}", .path.display())]
    Lock {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} was written by a newer vfiod-pool (schema {found}, this one knows {known})", .path.display())]
    NewerSchema {
        path: PathBuf,
        found: u32,
        known: u32,
    },
    #[error("pool database {}", .path.display())]
    Sqlite {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("pool database {}: bad row for session {id}: {what}", .path.display())]
    BadRow {
        path: PathBuf,
        id: String,
        what: String,
    },
}

/// The open store. Holds the directory lock for as long as it lives.
pub struct Store {
    conn: Connection,
    path: PathBuf,
    /// Whether `synchronous` is FULL now (see [`Store::durable`]).
    sync_full: bool,
    _lock: nix::fcntl::Flock<File>,
}

/// SQLite keeps integers signed; epochs, numbers and payloads are u64 on the wire. The bit
/// pattern is stored (payloads use all 64 bits); ordering only matters for `seq`, which the
/// core keeps below 2^63 ([`super::core::MAX_SEQ`]), where the bit pattern is the number.
fn to_db(v: u64) -> i64 {
    v as i64
}

fn from_db(v: i64) -> u64 {
    v as u64
}

impl Store {
    /// Opens (creating it if needed) the store in `dir`, and locks the directory.
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| StoreError::StateDir {
                path: dir.to_owned(),
                source,
            })?;
        let lock_path = dir.join(LOCK_FILE_NAME);
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|source| StoreError::Lock {
                path: lock_path.clone(),
                source,
            })?;
        let lock = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
            .map_err(|(_, errno)| {
                if errno == nix::errno::Errno::EWOULDBLOCK {
                    StoreError::Locked {
                        path: dir.to_owned(),
                    }
                } else {
                    StoreError::Lock {
                        path: lock_path.clone(),
                        source: errno.into(),
                    }
                }
            })?;
        let path = dir.join(DB_FILE_NAME);
        let sql = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let conn = Connection::open(&path).map_err(sql)?;
        // The pragma, not `Connection::busy_timeout`: rusqlite's method needs
        // sqlite3_set_clientdata (SQLite 3.44), newer than Debian 12's library.
        conn.pragma_update(None, "busy_timeout", BUSY_TIMEOUT.as_millis() as i64)
            .map_err(sql)?;
        // WAL: readers never block the writer. FULL: a reply the pool sent survives a power
        // cut, not only a crash (the fencing epoch must never go back).
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(sql)?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(sql)?;
        conn.pragma_update(None, "foreign_keys", "ON")
            .map_err(sql)?;
        let mut store = Store {
            conn,
            path,
            sync_full: true,
            _lock: lock,
        };
        store.migrate()?;
        Ok(store)
    }

    /// A write transaction (taken at once: `BEGIN IMMEDIATE`) at the durability `durable` asks
    /// for (see [`Self::durable`]), and the mapping of its SQLite errors to this file's.
    fn begin(
        &mut self,
        durable: bool,
    ) -> Result<(Transaction<'_>, impl Fn(rusqlite::Error) -> StoreError), StoreError> {
        self.durable(durable)?;
        let path = self.path.clone();
        let sql = move |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(&sql)?;
        Ok((tx, sql))
    }

    fn sql(&self, source: rusqlite::Error) -> StoreError {
        StoreError::Sqlite {
            path: self.path.clone(),
            source,
        }
    }

    /// Session changes are FULL (fsync at every commit): an epoch the pool told a caller
    /// survives a power cut, so fencing never goes back. Work items and results are NORMAL
    /// (synced at WAL checkpoints): a killed process loses none of them, a power cut may lose
    /// the last ones, and the stand-in accelerator does not pay an fsync per item.
    fn durable(&mut self, full: bool) -> Result<(), StoreError> {
        if self.sync_full != full {
            let mode = if full { "FULL" } else { "NORMAL" };
            self.conn
                .pragma_update(None, "synchronous", mode)
                .map_err(|e| self.sql(e))?;
            self.sync_full = full;
        }
        Ok(())
    }

    fn migrate(&mut self) -> Result<(), StoreError> {
        let known = MIGRATIONS.len() as u32;
        let found: u32 = self
            .conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .map_err(|e| self.sql(e))?;
        if found > known {
            return Err(StoreError::NewerSchema {
                path: self.path.clone(),
                found,
                known,
            });
        }
        for (i, step) in MIGRATIONS.iter().enumerate().skip(found as usize) {
            let tx = self
                .conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(|e| StoreError::Sqlite {
                    path: self.path.clone(),
                    source: e,
                })?;
            tx.execute_batch(step)
                .and_then(|()| tx.pragma_update(None, "user_version", i as u32 + 1))
                .and_then(|()| tx.commit())
                .map_err(|e| StoreError::Sqlite {
                    path: self.path.clone(),
                    source: e,
                })?;
        }
        Ok(())
    }

    /// The path of the database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The number for the next session id (`s-N`): one more than any ever made, so an id is
    /// never reused, released sessions included.
    pub fn next_session_number(&self) -> Result<u64, StoreError> {
        let max: Option<i64> = self
            .conn
            .query_row("SELECT max(num) FROM sessions", [], |r| r.get(0))
            .map_err(|e| self.sql(e))?;
        Ok(max.map_or(1, |m| from_db(m) + 1))
    }

    /// Every session, oldest first.
    pub fn sessions(&self) -> Result<Vec<SessionRecord>, StoreError> {
        let mut st = self
            .conn
            .prepare(&format!("SELECT {COLUMNS} FROM sessions ORDER BY num"))
            .map_err(|e| self.sql(e))?;
        let rows = st.query_map([], raw_row).map_err(|e| self.sql(e))?;
        let mut out = Vec::new();
        for r in rows {
            out.push(self.decode(r.map_err(|e| self.sql(e))?)?);
        }
        Ok(out)
    }

    /// The ids of the sessions not released, oldest first (through the state index).
    pub fn live_sessions(&self) -> Result<Vec<String>, StoreError> {
        let mut st = self
            .conn
            .prepare("SELECT id FROM sessions WHERE state IN ('running', 'quiesced') ORDER BY num")
            .map_err(|e| self.sql(e))?;
        let rows = st
            .query_map([], |r| r.get::<_, String>(0))
            .map_err(|e| self.sql(e))?;
        rows.collect::<Result<_, _>>().map_err(|e| self.sql(e))
    }

    /// The quiesced sessions whose lease deadline is at or before `now_ms` (through the state
    /// index: the cost is that of the sessions returned, not of the history).
    pub fn expired_leases(&self, now_ms: u64) -> Result<Vec<SessionRecord>, StoreError> {
        let mut st = self
            .conn
            .prepare(&format!(
                "SELECT {COLUMNS} FROM sessions
                 WHERE state = 'quiesced' AND quiesce_deadline_ms <= ?1 ORDER BY num"
            ))
            .map_err(|e| self.sql(e))?;
        let rows = st
            .query_map([to_db(now_ms.min(i64::MAX as u64))], raw_row)
            .map_err(|e| self.sql(e))?;
        let mut out = Vec::new();
        for r in rows {
            out.push(self.decode(r.map_err(|e| self.sql(e))?)?);
        }
        Ok(out)
    }

    /// One session.
    pub fn session(&self, id: &str) -> Result<Option<SessionRecord>, StoreError> {
        let raw = self
            .conn
            .query_row(
                &format!("SELECT {COLUMNS} FROM sessions WHERE id = ?1"),
                [id],
                raw_row,
            )
            .optional()
            .map_err(|e| self.sql(e))?;
        raw.map(|r| self.decode(r)).transpose()
    }

    /// The session holding `device`, if one does (released sessions hold nothing).
    pub fn session_of_device(&self, device: &str) -> Result<Option<String>, StoreError> {
        self.conn
            .query_row(
                "SELECT id FROM sessions WHERE device = ?1 AND state != 'released'",
                [device],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| self.sql(e))
    }

    /// Adds a new session numbered `num`.
    pub fn insert_session(&mut self, num: u64, rec: &SessionRecord) -> Result<(), StoreError> {
        self.durable(true)?;
        self.conn
            .execute(
                "INSERT INTO sessions (id, num, device, host, vm, epoch, state, moving_to,
                     quiesce_deadline_ms, last_note, resumed_from, last_seq)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
                params![
                    rec.id,
                    to_db(num),
                    rec.device,
                    rec.host,
                    rec.vm,
                    to_db(rec.epoch),
                    rec.state.as_str(),
                    rec.moving_to,
                    rec.quiesce_deadline_ms.map(to_db),
                    rec.last_note,
                    rec.resumed_from.map(to_db),
                    to_db(rec.last_seq),
                ],
            )
            .map_err(|e| self.sql(e))?;
        Ok(())
    }

    /// Writes a session's new state (a transition [`super::state::apply`] decided). A release
    /// also drops the session's queued items and undelivered results.
    pub fn update_session(&mut self, rec: &SessionRecord) -> Result<(), StoreError> {
        let (tx, ref sql) = self.begin(true)?;
        tx.execute(
            "UPDATE sessions SET host = ?2, epoch = ?3, state = ?4, moving_to = ?5,
                 quiesce_deadline_ms = ?6, last_note = ?7, resumed_from = ?8
             WHERE id = ?1",
            params![
                rec.id,
                rec.host,
                to_db(rec.epoch),
                rec.state.as_str(),
                rec.moving_to,
                rec.quiesce_deadline_ms.map(to_db),
                rec.last_note,
                rec.resumed_from.map(to_db),
            ],
        )
        .map_err(sql)?;
        if rec.state == SessionState::Released {
            tx.execute("DELETE FROM items WHERE session = ?1", [&rec.id])
                .map_err(sql)?;
            tx.execute("DELETE FROM results WHERE session = ?1", [&rec.id])
                .map_err(sql)?;
        }
        tx.commit().map_err(sql)
    }

    /// Items queued and results undelivered of a session.
    pub fn counts(&self, id: &str) -> Result<(u64, u64), StoreError> {
        self.conn
            .query_row(
                "SELECT (SELECT count(*) FROM items WHERE session = ?1),
                        (SELECT count(*) FROM results WHERE session = ?1)",
                [id],
                |r| Ok((from_db(r.get(0)?), from_db(r.get(1)?))),
            )
            .map_err(|e| self.sql(e))
    }

    /// Queues the items numbered above the session's `last_seq`; the others are repeats of a
    /// submission already accepted. Returns (accepted, repeated, new last_seq).
    pub fn submit(&mut self, id: &str, items: &[WorkItem]) -> Result<(u64, u64, u64), StoreError> {
        let (tx, ref sql) = self.begin(false)?;
        let mut last: u64 = tx
            .query_row("SELECT last_seq FROM sessions WHERE id = ?1", [id], |r| {
                r.get(0)
            })
            .map(from_db)
            .map_err(sql)?;
        let (mut accepted, mut repeated) = (0, 0);
        for item in items {
            if item.seq <= last {
                repeated += 1;
                continue;
            }
            tx.execute(
                "INSERT INTO items (session, seq, payload) VALUES (?1, ?2, ?3)",
                params![id, to_db(item.seq), to_db(item.payload)],
            )
            .map_err(sql)?;
            last = item.seq;
            accepted += 1;
        }
        tx.execute(
            "UPDATE sessions SET last_seq = ?2 WHERE id = ?1",
            params![id, to_db(last)],
        )
        .map_err(sql)?;
        tx.commit().map_err(sql)?;
        Ok((accepted, repeated, last))
    }

    /// The oldest queued item of a session.
    pub fn next_item(&self, id: &str) -> Result<Option<WorkItem>, StoreError> {
        self.conn
            .query_row(
                "SELECT seq, payload FROM items WHERE session = ?1 ORDER BY seq LIMIT 1",
                [id],
                |r| {
                    Ok(WorkItem {
                        seq: from_db(r.get(0)?),
                        payload: from_db(r.get(1)?),
                    })
                },
            )
            .optional()
            .map_err(|e| self.sql(e))
    }

    /// Completes an item: its result replaces it, in one transaction (the clean point). False
    /// when the item is no longer queued (the session was released meanwhile).
    pub fn complete(&mut self, id: &str, result: WorkResult) -> Result<bool, StoreError> {
        let (tx, ref sql) = self.begin(false)?;
        let n = tx
            .execute(
                "DELETE FROM items WHERE session = ?1 AND seq = ?2",
                params![id, to_db(result.seq)],
            )
            .map_err(sql)?;
        if n == 1 {
            tx.execute(
                "INSERT INTO results (session, seq, value) VALUES (?1, ?2, ?3)",
                params![id, to_db(result.seq), to_db(result.value)],
            )
            .map_err(sql)?;
        }
        tx.commit().map_err(sql)?;
        Ok(n == 1)
    }

    /// Forgets the results numbered `<= ack` (the owner holds them) and returns up to `max`
    /// of the others, oldest first.
    pub fn fetch(&mut self, id: &str, ack: u64, max: u64) -> Result<Vec<WorkResult>, StoreError> {
        let (tx, ref sql) = self.begin(false)?;
        if ack > 0 {
            tx.execute(
                "DELETE FROM results WHERE session = ?1 AND seq <= ?2",
                params![id, to_db(ack.min(i64::MAX as u64))],
            )
            .map_err(sql)?;
        }
        let out = {
            let mut st = tx
                .prepare("SELECT seq, value FROM results WHERE session = ?1 ORDER BY seq LIMIT ?2")
                .map_err(sql)?;
            let rows = st
                .query_map(params![id, to_db(max.min(i64::MAX as u64))], |r| {
                    Ok(WorkResult {
                        seq: from_db(r.get(0)?),
                        value: from_db(r.get(1)?),
                    })
                })
                .map_err(sql)?;
            rows.collect::<Result<Vec<_>, _>>().map_err(sql)?
        };
        tx.commit().map_err(sql)?;
        Ok(out)
    }

    fn decode(&self, raw: RawRow) -> Result<SessionRecord, StoreError> {
        let state = SessionState::parse(&raw.state).ok_or_else(|| StoreError::BadRow {
            path: self.path.clone(),
            id: raw.id.clone(),
            what: format!("unknown state {:?}", raw.state),
        })?;
        Ok(SessionRecord {
            id: raw.id,
            device: raw.device,
            host: raw.host,
            vm: raw.vm,
            epoch: from_db(raw.epoch),
            state,
            moving_to: raw.moving_to,
            quiesce_deadline_ms: raw.quiesce_deadline_ms.map(from_db),
            last_note: raw.last_note,
            resumed_from: raw.resumed_from.map(from_db),
            last_seq: from_db(raw.last_seq),
        })
    }
}

const COLUMNS: &str = "id, device, host, vm, epoch, state, moving_to, quiesce_deadline_ms, \
                       last_note, resumed_from, last_seq";

struct RawRow {
    id: String,
    device: String,
    host: String,
    vm: String,
    epoch: i64,
    state: String,
    moving_to: Option<String>,
    quiesce_deadline_ms: Option<i64>,
    last_note: Option<String>,
    resumed_from: Option<i64>,
    last_seq: i64,
}

fn raw_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawRow> {
    Ok(RawRow {
        id: r.get(0)?,
        device: r.get(1)?,
        host: r.get(2)?,
        vm: r.get(3)?,
        epoch: r.get(4)?,
        state: r.get(5)?,
        moving_to: r.get(6)?,
        quiesce_deadline_ms: r.get(7)?,
        last_note: r.get(8)?,
        resumed_from: r.get(9)?,
        last_seq: r.get(10)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::CreateSession;
    use crate::service::state::{create, Rules};

    fn rec(id: &str) -> SessionRecord {
        let req = CreateSession {
            device: "dev0".into(),
            host: "a".into(),
            vm: "vm1".into(),
        };
        create(
            id,
            &req,
            &Rules {
                now_ms: 0,
                lease_ms: 1000,
                hosts: None,
            },
        )
        .unwrap()
    }

    #[test]
    fn sessions_items_and_results_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut s = Store::open(dir.path()).unwrap();
            assert_eq!(s.next_session_number().unwrap(), 1);
            let mut r = rec("s-1");
            s.insert_session(1, &r).unwrap();
            let items: Vec<_> = (1..=3)
                .map(|seq| WorkItem {
                    seq,
                    payload: seq * 10,
                })
                .collect();
            assert_eq!(s.submit("s-1", &items).unwrap(), (3, 0, 3));
            // A retried submission is recognised.
            assert_eq!(s.submit("s-1", &items[1..]).unwrap(), (0, 2, 3));
            assert!(s.complete("s-1", WorkResult { seq: 1, value: 99 }).unwrap());
            assert!(
                !s.complete("s-1", WorkResult { seq: 1, value: 99 }).unwrap(),
                "done once"
            );
            r.epoch = 5;
            r.state = SessionState::Quiesced;
            r.quiesce_deadline_ms = Some(u64::MAX / 2);
            s.update_session(&r).unwrap();
        }
        let mut s = Store::open(dir.path()).unwrap();
        let r = s.session("s-1").unwrap().unwrap();
        assert_eq!(
            (r.epoch, r.state, r.last_seq),
            (5, SessionState::Quiesced, 3)
        );
        assert_eq!(r.quiesce_deadline_ms, Some(u64::MAX / 2));
        assert_eq!(s.counts("s-1").unwrap(), (2, 1));
        assert_eq!(
            s.next_item("s-1").unwrap(),
            Some(WorkItem {
                seq: 2,
                payload: 20
            })
        );
        assert_eq!(
            s.fetch("s-1", 0, 10).unwrap(),
            vec![WorkResult { seq: 1, value: 99 }]
        );
        assert!(
            s.fetch("s-1", 1, 10).unwrap().is_empty(),
            "acknowledged results are gone"
        );
        assert_eq!(s.next_session_number().unwrap(), 2);
    }

    #[test]
    fn a_second_pool_cannot_open_the_same_directory() {
        let dir = tempfile::tempdir().unwrap();
        let _first = Store::open(dir.path()).unwrap();
        assert!(matches!(
            Store::open(dir.path()),
            Err(StoreError::Locked { .. })
        ));
    }

    #[test]
    fn release_drops_the_work() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Store::open(dir.path()).unwrap();
        let mut r = rec("s-1");
        s.insert_session(1, &r).unwrap();
        s.submit("s-1", &[WorkItem { seq: 1, payload: 1 }]).unwrap();
        assert_eq!(s.session_of_device("dev0").unwrap().as_deref(), Some("s-1"));
        r.state = SessionState::Released;
        s.update_session(&r).unwrap();
        assert_eq!(s.counts("s-1").unwrap(), (0, 0));
        assert_eq!(s.session_of_device("dev0").unwrap(), None);
    }
}
