//! Store integrity: what keeps the state database whole when its write-ahead log is not.
//!
//! SQLite keeps recent commits in `vfiod.db-wal` until a checkpoint copies them into
//! `vfiod.db`. At recovery it silently ignores a log's damaged tail (a bad frame checksum ends
//! the log there), so a truncated or damaged log, or one removed while vfiod had it open, loses
//! acknowledged changes without an error. Three defences, in the order a change meets them:
//!
//! - **Checkpoints**: the log is copied into the main file as it grows (`wal_autocheckpoint`,
//!   set at open) and emptied at a clean stop ([`super::Store::checkpoint`]), so the log only
//!   ever holds the last few changes.
//! - **The log watch** ([`WalWatch`]): after each use of the connection, a `stat` of the
//!   `-wal` path against the log the connection has open. A log unlinked or replaced under
//!   vfiod's feet would take every change written to it since along when vfiod stops (its
//!   inode is freed): it is checkpointed at once into the main file, and the connection
//!   switched to a new log at the path.
//! - **The acknowledged mark** ([`AckFile`], `vfiod.acknowledged` beside the database): every
//!   row change bumps a counter in the database (schema version 9's triggers); after each
//!   commit, before the reply, the counter (and the last claim, task and event ids) is written
//!   to this small file and fsynced. At the next start a database behind that mark lost
//!   acknowledged changes: vfiod refuses to start ([`super::StoreError::Lost`]) unless the
//!   operator accepts the loss (`vfiod --accept-store-loss`).
//!
//! The mark never runs ahead of the database: it is written only after SQLite's commit returned
//! (with `synchronous = FULL` the commit is on disk by then), so a SIGKILL or a power cut at any
//! moment leaves the database at or ahead of it, never behind, and an ordinary crash is never
//! reported as a loss. The file has two slots, written alternately (by the counter's parity),
//! each with its own checksum: a write torn by a power cut spoils one slot and the other still
//! holds an older mark.

use rusqlite::Connection;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The acknowledged mark's file, beside the database in the state directory.
pub const ACK_FILE_NAME: &str = "vfiod.acknowledged";

/// Bytes of one slot of the mark file; the file holds two.
const SLOT: usize = 256;

/// The first word of a slot, with the format's version.
const MAGIC: &str = "vfiod-acknowledged 1 ";

/// A point in the store's history: how many row changes it has committed, and the last id
/// handed out to a claim, a task and an event (`sqlite_sequence`: ids are never reused).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mark {
    /// Row changes committed, counted by the database's own triggers; `None` in a database of a
    /// schema before the counter (version 8 and older).
    pub changes: Option<i64>,
    pub claims: i64,
    pub tasks: i64,
    pub events: i64,
}

impl Mark {
    /// The mark of a database with nothing in it (a missing or empty file).
    pub const EMPTY: Mark = Mark {
        changes: Some(0),
        claims: 0,
        tasks: 0,
        events: 0,
    };
}

/// Acknowledged changes the database does not hold: what was told to clients, and where the
/// store is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Loss {
    pub acknowledged: Mark,
    pub store: Mark,
}

impl Loss {
    /// What is missing, in words: the counts, then the claims, tasks and events by id.
    pub fn describe(&self) -> String {
        let (a, s) = (self.acknowledged, self.store);
        let mut text = match (a.changes, s.changes) {
            (Some(a), Some(s)) => format!(
                "vfiod acknowledged change {a}, the database holds changes up to {s} ({} lost)",
                a - s
            ),
            (Some(a), None) => format!(
                "vfiod acknowledged change {a}, the database has no change counter (an older \
                 schema)"
            ),
            _ => "the database is behind what vfiod acknowledged".to_string(),
        };
        let mut missing = Vec::new();
        for (name, acked, held) in [
            ("claim", a.claims, s.claims),
            ("task", a.tasks, s.tasks),
            ("event", a.events, s.events),
        ] {
            match acked - held {
                n if n <= 0 => {}
                1 => missing.push(format!("{name} {acked}")),
                _ => missing.push(format!("{name}s {} to {acked}", held + 1)),
            }
        }
        if missing.is_empty() {
            text.push_str(
                "; no claim, task or event is missing whole: changes to existing rows were lost",
            );
        } else {
            text.push_str(&format!(
                "; missing: {}, and possibly changes to other rows",
                missing.join(", ")
            ));
        }
        text
    }
}

/// Whether a database at `store` holds everything `acknowledged` says was committed: `None`
/// when it does (or when nothing was recorded), the loss otherwise.
///
/// A store ahead of the mark is whole (a crash between a commit and the mark's write leaves it
/// so). The ids are compared too, so that a counter missing (an older schema) or reset by hand
/// still lets a missing claim be seen.
pub fn loss(store: Mark, acknowledged: Option<Mark>) -> Option<Loss> {
    let a = acknowledged?;
    let behind = match (a.changes, store.changes) {
        (Some(a), Some(s)) => s < a,
        (Some(a), None) => a > 0,
        (None, _) => false,
    };
    let ids_behind = store.claims < a.claims || store.tasks < a.tasks || store.events < a.events;
    (behind || ids_behind).then_some(Loss {
        acknowledged: a,
        store,
    })
}

/// The store's mark, read from the database: the counter (absent before schema version 9) and
/// the last ids handed out.
pub fn read_mark(conn: &Connection) -> rusqlite::Result<Mark> {
    let has_counter: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'change_counter')",
        [],
        |r| r.get(0),
    )?;
    let has_sequence: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'sqlite_sequence')",
        [],
        |r| r.get(0),
    )?;
    let changes = if has_counter {
        conn.prepare_cached("SELECT changes FROM change_counter WHERE id = 1")?
            .query_row([], |r| r.get(0))
            .map(Some)
            .or_else(|e| match e {
                rusqlite::Error::QueryReturnedNoRows => Ok(Some(0)),
                e => Err(e),
            })?
    } else {
        None
    };
    let last = |table: &str| -> rusqlite::Result<i64> {
        if !has_sequence {
            return Ok(0);
        }
        conn.prepare_cached("SELECT coalesce(max(seq), 0) FROM sqlite_sequence WHERE name = ?1")?
            .query_row([table], |r| r.get(0))
    };
    Ok(Mark {
        changes,
        claims: last("claims")?,
        tasks: last("tasks")?,
        events: last("events")?,
    })
}

/// One slot's bytes: the mark as text (readable with `cat`), its checksum, padded with spaces
/// to [`SLOT`] bytes and ended by a newline.
fn encode_slot(mark: &Mark) -> [u8; SLOT] {
    let body = format!(
        "{MAGIC}changes={} claims={} tasks={} events={}",
        mark.changes.unwrap_or(0),
        mark.claims,
        mark.tasks,
        mark.events
    );
    let line = format!("{body} check={:016x}", fnv1a(body.as_bytes()));
    let mut slot = [b' '; SLOT];
    // At most 21 + 4 * (8 + 20) + 23 bytes: always fits.
    slot[..line.len()].copy_from_slice(line.as_bytes());
    slot[SLOT - 1] = b'\n';
    slot
}

/// The mark in one slot, or `None` when the slot is not a whole, intact one (never written,
/// torn by a crash, damaged).
fn decode_slot(slot: &[u8]) -> Option<Mark> {
    let text = std::str::from_utf8(slot).ok()?.trim_end();
    let (body, check) = text.rsplit_once(" check=")?;
    if u64::from_str_radix(check, 16).ok()? != fnv1a(body.as_bytes()) {
        return None;
    }
    let mut mark = Mark::default();
    let mut seen = 0;
    for word in body.strip_prefix(MAGIC)?.split(' ') {
        let (key, value) = word.split_once('=')?;
        let value: i64 = value.parse().ok()?;
        match key {
            "changes" => mark.changes = Some(value),
            "claims" => mark.claims = value,
            "tasks" => mark.tasks = value,
            "events" => mark.events = value,
            _ => return None,
        }
        seen += 1;
    }
    (seen == 4).then_some(mark)
}

/// The newest intact mark of a file's bytes; `None` when no slot is intact.
fn newest(bytes: &[u8]) -> Option<Mark> {
    bytes
        .chunks(SLOT)
        .take(2)
        .filter_map(decode_slot)
        .max_by_key(|m| (m.changes, m.claims, m.tasks, m.events))
}

/// FNV-1a, 64 bits: enough to tell a torn or damaged slot from a written one.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// What the mark file held when the store was opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recorded {
    /// No file: a first start, or the first start of a vfiod that keeps one.
    None,
    /// A file without an intact slot: nothing can be checked.
    Unreadable,
    Mark(Mark),
}

impl Recorded {
    pub fn mark(self) -> Option<Mark> {
        match self {
            Recorded::Mark(m) => Some(m),
            _ => None,
        }
    }
}

/// Reads the mark file at `path`.
pub fn read_ack(path: &Path) -> io::Result<Recorded> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(newest(&bytes).map_or(Recorded::Unreadable, Recorded::Mark)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Recorded::None),
        Err(e) => Err(e),
    }
}

/// The mark file, open for the life of the store.
#[derive(Debug)]
pub struct AckFile {
    file: File,
    path: PathBuf,
}

impl AckFile {
    /// Opens (creating, mode 0600) the mark file at `path`.
    pub fn open(path: &Path) -> io::Result<AckFile> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)?;
        Ok(AckFile {
            file,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records `mark` in the slot of its counter's parity and waits until it is on disk.
    pub fn record(&self, mark: &Mark) -> io::Result<()> {
        let slot = mark.changes.unwrap_or(0).rem_euclid(2) as u64;
        self.file
            .write_all_at(&encode_slot(mark), slot * SLOT as u64)?;
        self.file.sync_data()
    }

    /// Records `mark` in both slots: a new file, or the operator accepted a loss and the
    /// older marks must go.
    pub fn reset(&self, mark: &Mark) -> io::Result<()> {
        let slot = encode_slot(mark);
        self.file.write_all_at(&slot, 0)?;
        self.file.write_all_at(&slot, SLOT as u64)?;
        self.file.set_len(2 * SLOT as u64)?;
        self.file.sync_all()
    }
}

/// The identity of a file: device and inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    /// The identity of the file at `path`; `None` when there is none.
    pub fn of(path: &Path) -> io::Result<Option<FileId>> {
        match std::fs::symlink_metadata(path) {
            Ok(m) => Ok(Some(FileId {
                dev: m.dev(),
                ino: m.ino(),
            })),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// What the `-wal` path shows against the log the connection has open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WalState {
    /// The same file (or nothing is known of the open one: not in WAL mode).
    Same,
    /// No file at the path: it was unlinked.
    Gone,
    /// Another file at the path.
    Replaced,
}

/// Decides [`WalState`] from the open log's identity and the path's. A file at the path with
/// the open log's identity is that log: its inode cannot be reused while the log is open.
pub fn wal_state(open: Option<FileId>, at_path: Option<FileId>) -> WalState {
    match (open, at_path) {
        (None, _) => WalState::Same,
        (Some(_), None) => WalState::Gone,
        (Some(a), Some(b)) if a == b => WalState::Same,
        (Some(_), Some(_)) => WalState::Replaced,
    }
}

/// `PRAGMA wal_checkpoint(TRUNCATE)`: every frame of the log into the main file, and the log
/// emptied. `Ok(false)` when a reader of another connection kept it from completing.
pub fn checkpoint(conn: &Connection) -> rusqlite::Result<bool> {
    let busy: i64 = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))?;
    Ok(busy == 0)
}

/// Closes the connection's log and opens a new one at its path: out of WAL mode (SQLite
/// checkpoints and deletes the log) and back. Needs the database to itself: fails (busy) at
/// once, without waiting, while another connection has it open.
fn new_log(conn: &Connection) -> rusqlite::Result<()> {
    let timeout: i64 = conn.query_row("PRAGMA busy_timeout", [], |r| r.get(0))?;
    conn.pragma_update(None, "busy_timeout", 0)?;
    let switched = switch_log(conn);
    conn.pragma_update(None, "busy_timeout", timeout)?;
    switched
}

fn switch_log(conn: &Connection) -> rusqlite::Result<()> {
    let mode: String =
        conn.pragma_update_and_check(None, "journal_mode", "delete", |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("delete") {
        return Err(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_BUSY),
            Some(format!("the journal mode stayed {mode}")),
        ));
    }
    conn.pragma_update_and_check(None, "journal_mode", "wal", |r| r.get::<_, String>(0))?;
    // The log is opened by the first transaction.
    conn.query_row("SELECT count(*) FROM sqlite_master", [], |r| {
        r.get::<_, i64>(0)
    })?;
    Ok(())
}

/// The checks after each use of the store's connection ([`super::event_feed::Guard`]).
#[derive(Debug)]
pub struct Tracker {
    wal_path: PathBuf,
    /// The log the connection has open; `None` when not in WAL mode.
    wal: Option<FileId>,
    /// A missing or replaced log was reported and is not yet behind a new one.
    rescuing: bool,
    ack: AckFile,
    /// The counter the mark file holds.
    acknowledged: Option<i64>,
    /// The last write of the mark failed and was reported.
    ack_failing: bool,
}

impl Tracker {
    /// For the store at `db`, whose connection has just opened it and whose mark `ack` holds.
    pub fn new(db: &Path, ack: AckFile, mark: Mark) -> Tracker {
        let wal_path = wal_path(db);
        let wal = FileId::of(&wal_path).unwrap_or(None);
        Tracker {
            wal_path,
            wal,
            rescuing: false,
            ack,
            acknowledged: mark.changes,
            ack_failing: false,
        }
    }

    /// After a use of `conn` (its transaction ended): the log watch, then, if rows changed,
    /// the mark. Never fails: the change is committed, and a check that cannot be made is
    /// logged (a mark left behind only weakens the next start's check; it never raises a false
    /// alarm).
    pub fn after_use(&mut self, conn: &Connection, wrote: bool) {
        self.watch_wal(conn);
        if wrote {
            self.acknowledge(conn);
        }
    }

    fn watch_wal(&mut self, conn: &Connection) {
        let Ok(at_path) = FileId::of(&self.wal_path) else {
            return;
        };
        let state = wal_state(self.wal, at_path);
        if state == WalState::Same {
            return;
        }
        let path = self.wal_path.display();
        if !self.rescuing {
            let what = match state {
                WalState::Gone => "was removed",
                _ => "was replaced by another file",
            };
            tracing::warn!(
                wal = %path,
                "the state database's write-ahead log {path} {what} while vfiod had it open; \
                 checkpointing every change in it into the database file now, so that none is \
                 lost when vfiod stops"
            );
            self.rescuing = true;
        }
        match checkpoint(conn) {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                wal = %path,
                "the checkpoint of the write-ahead log {path} was held back by another reader of \
                 the database; trying again after the next use"
            ),
            Err(e) => tracing::warn!(
                wal = %path,
                "cannot checkpoint the write-ahead log {path}: {}; trying again after the next use",
                crate::error_chain(&e)
            ),
        }
        match new_log(conn) {
            Ok(()) => {
                self.wal = FileId::of(&self.wal_path).unwrap_or(None);
                self.rescuing = false;
                tracing::warn!(
                    wal = %path,
                    "the database file holds every change again; a new write-ahead log {path} is in use"
                );
            }
            // Another connection has the database open: the checkpoints after each use go on
            // until it lets go.
            Err(e) => tracing::debug!(
                wal = %path,
                "cannot start a new write-ahead log yet: {}",
                crate::error_chain(&e)
            ),
        }
    }

    fn acknowledge(&mut self, conn: &Connection) {
        let mark = match read_mark(conn) {
            Ok(m) => m,
            Err(e) => return self.ack_failed(&e),
        };
        if mark.changes <= self.acknowledged {
            return;
        }
        match self.ack.record(&mark) {
            Ok(()) => {
                self.acknowledged = mark.changes;
                if self.ack_failing {
                    self.ack_failing = false;
                    tracing::info!(
                        "the acknowledged mark {} is written again",
                        self.ack.path().display()
                    );
                }
            }
            Err(e) => self.ack_failed(&e),
        }
    }

    fn ack_failed(&mut self, e: &dyn std::error::Error) {
        if !self.ack_failing {
            self.ack_failing = true;
            tracing::warn!(
                "cannot record the acknowledged mark in {}: {}; the changes are committed, but \
                 the next start cannot tell whether it lost the latest ones",
                self.ack.path().display(),
                crate::error_chain(e)
            );
        }
    }
}

/// The write-ahead log's path of the database at `db`.
pub fn wal_path(db: &Path) -> PathBuf {
    let mut p = db.as_os_str().to_owned();
    p.push("-wal");
    PathBuf::from(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(changes: i64, claims: i64, tasks: i64, events: i64) -> Mark {
        Mark {
            changes: Some(changes),
            claims,
            tasks,
            events,
        }
    }

    #[test]
    fn loss_is_a_store_behind_the_mark_and_only_that() {
        let m = mark(100, 5, 7, 40);
        let cases: &[(&str, Mark, Option<Mark>, bool)] = &[
            ("nothing recorded", m, None, false),
            ("equal", m, Some(m), false),
            (
                "store ahead (crash after a commit)",
                mark(101, 6, 7, 41),
                Some(m),
                false,
            ),
            ("fewer changes", mark(99, 5, 7, 40), Some(m), true),
            ("a claim missing", mark(100, 4, 7, 40), Some(m), true),
            ("an event missing", mark(120, 5, 7, 39), Some(m), true),
            (
                "no counter in the store, ids whole",
                Mark { changes: None, ..m },
                Some(mark(0, 5, 7, 40)),
                false,
            ),
            (
                "no counter in the store, changes acknowledged",
                Mark { changes: None, ..m },
                Some(m),
                true,
            ),
            ("an empty store", Mark::EMPTY, Some(m), true),
            (
                "an empty store, nothing acknowledged",
                Mark::EMPTY,
                Some(Mark::EMPTY),
                false,
            ),
        ];
        for (what, store, acked, lost) in cases {
            assert_eq!(loss(*store, *acked).is_some(), *lost, "{what}");
        }
    }

    #[test]
    fn a_loss_names_what_is_missing() {
        let l = Loss {
            acknowledged: mark(120, 14, 30, 460),
            store: mark(100, 11, 30, 459),
        };
        assert_eq!(
            l.describe(),
            "vfiod acknowledged change 120, the database holds changes up to 100 (20 lost); \
             missing: claims 12 to 14, event 460, and possibly changes to other rows"
        );
        let l = Loss {
            acknowledged: mark(120, 14, 30, 460),
            store: mark(119, 14, 30, 460),
        };
        assert!(
            l.describe().contains("changes to existing rows"),
            "{}",
            l.describe()
        );
    }

    #[test]
    fn slots_round_trip_and_a_damaged_slot_is_ignored() {
        let a = mark(7, 1, 2, 3);
        let b = mark(8, 1, 2, 4);
        let big = mark(i64::MAX, i64::MAX, i64::MAX, i64::MAX);
        assert_eq!(decode_slot(&encode_slot(&big)), Some(big));
        let mut file = [encode_slot(&b), encode_slot(&a)].concat();
        assert_eq!(newest(&file), Some(b));
        // A write torn half-way through slot 0: slot 1 still holds the older mark.
        file[40..SLOT].fill(0);
        assert_eq!(newest(&file), Some(a));
        // One bit flipped in a digit: the checksum no longer matches.
        let mut one = encode_slot(&a);
        let at = one.iter().position(|c| *c == b'=').unwrap() + 1;
        one[at] ^= 1;
        assert_eq!(decode_slot(&one), None);
        assert_eq!(newest(&[]), None);
        assert_eq!(newest(&[0u8; 2 * SLOT]), None);
    }

    #[test]
    fn wal_state_compares_identities() {
        let a = FileId { dev: 1, ino: 10 };
        let b = FileId { dev: 1, ino: 11 };
        assert_eq!(wal_state(None, None), WalState::Same);
        assert_eq!(wal_state(None, Some(a)), WalState::Same);
        assert_eq!(wal_state(Some(a), Some(a)), WalState::Same);
        assert_eq!(wal_state(Some(a), None), WalState::Gone);
        assert_eq!(wal_state(Some(a), Some(b)), WalState::Replaced);
    }

    #[test]
    fn the_file_keeps_the_newest_mark_across_writes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(ACK_FILE_NAME);
        assert_eq!(read_ack(&path).unwrap(), Recorded::None);
        let f = AckFile::open(&path).unwrap();
        f.reset(&mark(0, 0, 0, 0)).unwrap();
        for n in 1..=5 {
            f.record(&mark(n, n, 0, n)).unwrap();
        }
        assert_eq!(read_ack(&path).unwrap(), Recorded::Mark(mark(5, 5, 0, 5)));
        std::fs::write(&path, b"garbage").unwrap();
        assert_eq!(read_ack(&path).unwrap(), Recorded::Unreadable);
    }
}
