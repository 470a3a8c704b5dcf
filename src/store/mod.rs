//! The state store: vfiod's single source of truth, a SQLite database at `<state_dir>/vfiod.db`.
//!
//! It holds the device inventory (one row per PCI function present), the history of events, the
//! per-device tasks with their state machine (`tasks`, `task_state`), the original drivers that
//! restore puts back (`original_drivers`), and the claims table. The D-Bus API reads from here, and a
//! mutating request commits here before it replies, so what a client was told survives a crash or
//! a power cut.
//!
//! Every call blocks on SQLite (and on fsync when it writes): async code calls it from
//! `spawn_blocking`. One connection behind a mutex serves the whole daemon: vfiod is the only
//! writer, SQLite serialises writers anyway, and one connection keeps the per-connection settings
//! (`synchronous`, `foreign_keys`, `busy_timeout`) in one place.
//!
//! What keeps the history (events, finished tasks) within `[history]`'s limits is
//! [`retention`]'s.
//!
//! What keeps the database whole when its write-ahead log is not (checkpoints, the log watch,
//! the acknowledged mark that makes a lost change an error at the next start) is
//! [`integrity`]'s.

pub mod backup;
mod claim;
mod clean;
mod device_row;
mod event_feed;
pub mod image;
pub mod integrity;
pub mod lock;
mod schema;
mod original_drivers;
mod pool;
pub mod retention;
mod task_state;
mod task;

pub use claim::{ClaimChange, ClaimDetails, ClaimRecord};
pub use clean::{CleanOutcome, CleanPolicy, FunctionClean};
pub use image::{ImageError, ImageRecord, ImageState, NewImage};
pub use integrity::{Loss, Mark, ACK_FILE_NAME};
pub use pool::{NewPooled, PooledStep};
pub use task::{TaskRecord, REFUSED_BY};
pub use task_state::TaskState;

use crate::model::device::{Device, State};
use crate::model::event::EventKind;
use crate::model::pci::PciAddress;
use device_row::{DecodeError, Fields};
use rusqlite::config::DbConfig;
use rusqlite::{params, Connection, ErrorCode, TransactionBehavior};
use serde::Serialize;
use std::fs::DirBuilder;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The schema version this build creates and understands: the number of migration steps.
pub const SCHEMA_VERSION: u32 = schema::MIGRATIONS.len() as u32;
const _: () = assert!(
    SCHEMA_VERSION >= 1,
    "the schema needs at least one migration"
);

/// File name of the database inside the state directory.
pub const DB_FILE_NAME: &str = "vfiod.db";

/// Pages (4 KiB each) the write-ahead log may hold before a commit copies them into the main
/// file (SQLite's automatic PASSIVE checkpoint; its default is 1,000). Changes wait in the log
/// for at most about a megabyte: the log is where a damaged file loses them.
pub const WAL_CHECKPOINT_PAGES: i64 = 256;

/// Bytes the log file is cut back to when a checkpoint lets it start over: a burst that grew
/// it (a checkpoint held back by a reader) does not leave a large file behind.
const WAL_SIZE_LIMIT: i64 = 4 << 20;

/// How long a statement waits for another process's lock (a `sqlite3` shell, a backup, a second
/// vfiod that is starting) before failing with "database is locked".
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors of the store. Each message names the database file; SQLite's own error is the source.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot create state directory {}", .path.display())]
    StateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot open state database {}", .path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error(
        "state database {} is not an SQLite database, or is corrupt; refusing to use it: \
         restore it from a backup",
        .path.display()
    )]
    NotADatabase {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("{} is an SQLite database but not a vfiod state database: {reason}", .path.display())]
    Foreign { path: PathBuf, reason: String },
    /// The file was there but held nothing (0 bytes, or an SQLite file without a table): a
    /// database lost its content (truncated, overwritten), and starting on it would forget
    /// every claim and task. Only an operator who means it starts afresh on it.
    #[error(
        "state database {} exists but is empty (truncated?); refusing to start on it as if it \
         were new: restore it from a backup, or run `vfiod --init-state` once to start with an \
         empty state",
        .path.display()
    )]
    Empty { path: PathBuf },
    /// SQLite's `quick_check` found the file damaged (a truncation at a page boundary reads as
    /// a database until a query reaches the missing pages).
    #[error(
        "state database {} is damaged ({detail}); refusing to use it: restore it from a backup",
        .path.display()
    )]
    Damaged { path: PathBuf, detail: String },
    #[error(
        "state database {} has schema version {found}, newer than the {supported} this vfiod \
         knows; refusing to use it (run the newer vfiod, or restore a backup)",
        .path.display()
    )]
    TooNew {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
    #[error("cannot migrate state database {} to schema version {version}", .path.display())]
    Migration {
        path: PathBuf,
        version: u32,
        #[source]
        source: rusqlite::Error,
    },
    /// The database is behind what vfiod acknowledged (its mark in `vfiod.acknowledged`):
    /// recovery dropped committed changes (a write-ahead log damaged, cut short, or removed
    /// while vfiod ran), or the file was replaced by an older copy.
    #[error(
        "state database {} lacks changes vfiod acknowledged (recorded in {}): {}; its \
         write-ahead log ({}-wal) was damaged, cut short or removed, or the file was replaced \
         by an older copy. Refusing to start on it: restore vfiod.db from a backup (`vfioctl \
         backup`; remove the old -wal and -shm files first), or start once with `vfiod --accept-store-loss` to go on with what it \
         holds (the loss is recorded as an event)",
        .path.display(), .ack_path.display(), .loss.describe(), .path.display()
    )]
    Lost {
        path: PathBuf,
        ack_path: PathBuf,
        /// Boxed: a `Result<_, StoreError>` stays small.
        loss: Box<Loss>,
    },
    /// The database file is gone, but vfiod acknowledged changes to it: a first start would
    /// forget them.
    #[error(
        "state database {} is missing, but vfiod acknowledged changes to it (recorded in {}): \
         {}. Refusing to start with a new, empty store: restore vfiod.db from a backup, or \
         start once with `vfiod --accept-store-loss` (or run `vfiod --init-state`) to start \
         afresh",
        .path.display(), .ack_path.display(), .loss.describe()
    )]
    Missing {
        path: PathBuf,
        ack_path: PathBuf,
        /// Boxed: a `Result<_, StoreError>` stays small.
        loss: Box<Loss>,
    },
    #[error("cannot read or write the acknowledged mark {}", .path.display())]
    AckFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("state database {}: cannot {action}", .path.display())]
    Sqlite {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: rusqlite::Error,
    },
    #[error(
        "state database {}: cannot decode column {column} of {table} row {key}",
        .path.display()
    )]
    Decode {
        path: PathBuf,
        table: &'static str,
        key: String,
        column: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error(
        "state database {}: a change from {old} to {new} is not a change of one device; \
         send Removed and Added",
        .path.display()
    )]
    AddressChanged {
        path: PathBuf,
        old: PciAddress,
        new: PciAddress,
    },
    /// The device already has an active task (prepare, running, or error not yet reset), its
    /// own or one whose scope covers it (another function of its IOMMU group), or its PF's or a VF's of it.
    #[error("device {address} is busy: task {} {}{} is {}", .task.id, .task.kind,
        if .task.address == *.address { String::new() } else { format!(" on {}", .task.address) },
        .task.status())]
    Busy {
        address: PciAddress,
        /// The task that blocks. Boxed: a `Result<_, StoreError>` stays small.
        task: Box<TaskRecord>,
    },
    #[error("no task {0}")]
    NoSuchTask(i64),
    #[error("task {id} {kind} on {address} cannot go from {from} to {to}")]
    IllegalTransition {
        id: i64,
        address: PciAddress,
        kind: crate::model::task::TaskKind,
        from: TaskState,
        to: TaskState,
    },
    /// A reset of a device whose task is not in error; `state` is that of its active task, `None`
    /// when it has none.
    #[error(
        "device {address} has no task in error to reset: {}",
        match .state { None => "it is idle".to_string(), Some(s) => format!("its task is {s}") }
    )]
    NotInError {
        address: PciAddress,
        state: Option<TaskState>,
    },
    /// A request the store refuses before touching the database (empty name, bad JSON, ...).
    #[error("invalid request: {reason}")]
    InvalidArgument { reason: String },
    /// Nothing matching a claim's requirements can be claimed now; says why.
    #[error("{0}")]
    Unclaimable(crate::claim::Unavailable),
    #[error("no claim {0}")]
    NoSuchClaim(i64),
    #[error("claim {0} is already released")]
    ClaimReleased(i64),
    /// The database refused a claim that would hold a function twice (or a PF beside its VFs).
    #[error("the claim conflicts with another claim: {0}")]
    ClaimConflict(String),
    /// The claim's state does not allow the step (see [`crate::claim::lifecycle::next`]).
    #[error(transparent)]
    ClaimStep(crate::claim::lifecycle::Refusal),
}

/// What [`Store::open_with`] does with a database file that is there but empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Existing {
    Refuse,
    Initialize,
}

/// What [`Store::open_with`] does with a database behind the acknowledged mark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Behind {
    Refuse,
    /// The operator accepts the loss (`vfiod --accept-store-loss`): an event records it.
    Accept,
}

/// One entry of the history, as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Event {
    /// Increasing with every event, never reused: the order of the history and the paging cursor
    /// (`time_ms` can go backwards with the wall clock).
    pub id: i64,
    /// Unix time in milliseconds when the event was committed.
    pub time_ms: i64,
    /// The device it is about; `None` for daemon-wide events (configuration, start-up).
    pub address: Option<PciAddress>,
    /// What happened.
    pub kind: EventKind,
    pub message: String,
}

/// An event to record; the store assigns its id and time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewEvent {
    pub address: Option<PciAddress>,
    pub kind: EventKind,
    pub message: String,
}

impl NewEvent {
    pub fn new(address: Option<PciAddress>, kind: EventKind, message: impl Into<String>) -> Self {
        NewEvent {
            address,
            kind,
            message: message.into(),
        }
    }
}

/// One difference between the stored inventory and what the kernel shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceChange {
    /// A function appeared. Stored as an upsert, so replaying a pass is harmless.
    Added(Device),
    /// A function's record changed; `old` and `new` have the same address.
    Changed { old: Device, new: Device },
    /// A function is gone. Removing an address the store does not hold is a no-op.
    Removed(Device),
}

impl DeviceChange {
    pub fn address(&self) -> PciAddress {
        match self {
            DeviceChange::Added(d) | DeviceChange::Removed(d) => d.address,
            DeviceChange::Changed { new, .. } => new.address,
        }
    }
}

/// Number of devices present, in total and per state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub total: u32,
    pub usable: u32,
    pub protected: u32,
    pub broken: u32,
    /// Being cleaned after a claim ended: out of the pool until that succeeds.
    pub cleaning: u32,
}

/// Which events a read keeps: all given conditions hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventFilter {
    pub address: Option<PciAddress>,
    pub kind: Option<EventKind>,
}

/// Where a read of the history starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Page {
    /// The entries after this id, oldest first.
    After(i64),
    /// The newest entries before this id.
    Before(i64),
}

/// The open state database. `Send + Sync`: share it as `Arc<Store>`.
#[derive(Debug)]
pub struct Store {
    conn: Mutex<Connection>,
    path: PathBuf,
    /// Bumped after a use of the connection that inserted rows (`event_feed`).
    events: tokio::sync::watch::Sender<u64>,
    /// Which functions a claim's end holds out of the pool for a clean (see `clean`).
    clean_policy: Mutex<clean::CleanPolicy>,
    /// Which PFs the configuration splits: no claim takes them whole (see `claim::choice`).
    split_policy: Mutex<crate::claim::SplitPolicy>,
    /// Woken when a write held functions for a clean: the engine's cleaner starts their tasks.
    clean_wanted: std::sync::Arc<tokio::sync::Notify>,
    /// The checks after each use of the connection: the log watch, the acknowledged mark.
    /// Locked only while `conn` is held.
    integrity: Mutex<integrity::Tracker>,
}

/// The functions the configuration selected, as the daemon last recorded them, read without a
/// running daemon and without changing anything (the database opened read-only): how the
/// libvirt hook tells, when vfiod does not answer, whether a domain has devices vfiod manages.
pub fn managed_functions_read_only(state_dir: &Path) -> Result<Vec<PciAddress>, StoreError> {
    use rusqlite::OpenFlags;
    let path = state_dir.join(DB_FILE_NAME);
    let conn = Connection::open_with_flags(
        &path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|source| StoreError::Open {
        path: path.clone(),
        source,
    })?;
    let _ = conn.execute_batch("PRAGMA busy_timeout = 1000");
    let rows: Vec<String> = conn
        .prepare("SELECT address FROM devices WHERE managed = 1")
        .and_then(|mut stmt| {
            stmt.query_map([], |r| r.get(0))?
                .collect::<rusqlite::Result<_>>()
        })
        .map_err(|source| StoreError::Open { path, source })?;
    Ok(rows.iter().filter_map(|a| a.parse().ok()).collect())
}

impl Store {
    /// Opens `<state_dir>/vfiod.db`, creating the directory (mode 0700) and the database if
    /// missing, and migrates it to [`SCHEMA_VERSION`].
    ///
    /// Refuses, without modifying it, a file that is not SQLite, another program's database, a
    /// vfiod database newer than this build (an older vfiod must never "downgrade" state it does
    /// not understand), a damaged one, and one that lacks changes vfiod acknowledged
    /// ([`StoreError::Lost`], [`StoreError::Missing`]; see [`integrity`]).
    pub fn open(state_dir: &Path) -> Result<Store, StoreError> {
        Self::open_with(state_dir, Existing::Refuse, Behind::Refuse).map(|(store, _)| store)
    }

    /// As [`Store::open`], and an empty database file is taken as a new store (`vfiod
    /// --init-state`): the operator says it is not a database that lost its content. A new
    /// store (the file was missing or empty) starts a new acknowledged mark.
    pub fn init(state_dir: &Path) -> Result<Store, StoreError> {
        Self::open_with(state_dir, Existing::Initialize, Behind::Refuse).map(|(store, _)| store)
    }

    /// As [`Store::open`], and a database behind the acknowledged mark is used as it is (`vfiod
    /// --accept-store-loss`): the loss is logged, recorded as a `store` event, and the mark
    /// starts again from what the database holds. Returns the loss accepted, if there was one.
    pub fn open_accepting_loss(state_dir: &Path) -> Result<(Store, Option<Loss>), StoreError> {
        Self::open_with(state_dir, Existing::Refuse, Behind::Accept)
    }

    fn open_with(
        state_dir: &Path,
        empty: Existing,
        behind: Behind,
    ) -> Result<(Store, Option<Loss>), StoreError> {
        // An existing directory keeps its mode: systemd's StateDirectory= or the packager chose it.
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(state_dir)
            .map_err(|source| StoreError::StateDir {
                path: state_dir.to_path_buf(),
                source,
            })?;
        let path = state_dir.join(DB_FILE_NAME);
        let ack_path = state_dir.join(ACK_FILE_NAME);
        let ack_error = {
            let path = ack_path.clone();
            move |source| StoreError::AckFile {
                path: path.clone(),
                source,
            }
        };
        // What vfiod acknowledged before this start, read before anything is created.
        let recorded = integrity::read_ack(&ack_path).map_err(&ack_error)?;
        // Whether a file was there before SQLite opens (and so creates) it: a new store only
        // where there was none. Any other failure to look is SQLite's to report.
        let existed = !matches!(
            std::fs::symlink_metadata(&path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound
        );
        // A new store where one was acknowledged: refused before the file is created.
        let mut accepted = None;
        if !existed && empty == Existing::Refuse {
            if let Some(loss) = integrity::loss(Mark::EMPTY, recorded.mark()) {
                if behind == Behind::Refuse {
                    return Err(StoreError::Missing {
                        path,
                        ack_path,
                        loss: Box::new(loss),
                    });
                }
                accepted = Some(loss);
            }
        }
        let mut conn = Connection::open(&path).map_err(|source| StoreError::Open {
            path: path.clone(),
            source,
        })?;
        // A refused database stays as it was, its log included: SQLite's checkpoint when the
        // last connection closes would copy a damaged log's intact frames into the file and
        // delete the log, the evidence of what was lost. Back on once the store is open.
        conn.set_db_config(DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true)
            .map_err(|source| open_error(&path, source))?;
        // Before the first read, so that even that read waits for another process's lock. The
        // pragma, not `Connection::busy_timeout`: rusqlite's method also calls
        // sqlite3_set_clientdata, which needs SQLite 3.44 and does not link against the 3.40 of
        // the distributions vfiod targets.
        conn.pragma_update(None, "busy_timeout", BUSY_TIMEOUT.as_millis() as i64)
            .map_err(|source| open_error(&path, source))?;

        // Identify the file before changing anything in it, so that a refused file stays as is.
        let found = schema::user_version(&conn).map_err(|source| open_error(&path, source))?;
        check_identity(&conn, &path, found)?;
        if existed && found == 0 && empty == Existing::Refuse {
            // An empty file where changes were acknowledged: say what is missing.
            match integrity::loss(Mark::EMPTY, recorded.mark()) {
                None => return Err(StoreError::Empty { path }),
                Some(loss) if behind == Behind::Refuse => {
                    return Err(StoreError::Lost {
                        path,
                        ack_path,
                        loss: Box::new(loss),
                    })
                }
                // Accepted: the empty file becomes a new store.
                Some(loss) => accepted = Some(loss),
            }
        }
        if found > 0 {
            // Before anything writes: a damaged file stays as it was for whoever repairs it. It
            // reads every page once (milliseconds for the few megabytes vfiod keeps).
            let verdict: String = conn
                .query_row("PRAGMA quick_check(1)", [], |row| row.get(0))
                .map_err(|source| open_error(&path, source))?;
            if verdict != "ok" {
                return Err(StoreError::Damaged {
                    path,
                    detail: verdict,
                });
            }
            // Whole, but is it all there? Also before anything writes.
            let held = integrity::read_mark(&conn).map_err(|source| open_error(&path, source))?;
            if let Some(loss) = integrity::loss(held, recorded.mark()) {
                if behind == Behind::Refuse {
                    return Err(StoreError::Lost {
                        path,
                        ack_path,
                        loss: Box::new(loss),
                    });
                }
                accepted = Some(loss);
            }
        }

        // WAL: readers (vfioctl, a backup) do not block the daemon's writes. It is a property
        // of the file, kept across opens; SQLite falls back silently where WAL is impossible
        // (some network filesystems), so read back what is in effect.
        let mode: String = conn
            .pragma_update_and_check(None, "journal_mode", "wal", |row| row.get(0))
            .map_err(|source| open_error(&path, source))?;
        if !mode.eq_ignore_ascii_case("wal") {
            tracing::warn!(path = %path.display(), %mode, "state database is not in WAL mode");
        }
        configure(&conn).map_err(|source| open_error(&path, source))?;

        let (before, after) =
            schema::migrate(&mut conn, schema::MIGRATIONS).map_err(|e| StoreError::Migration {
                path: path.clone(),
                version: e.version,
                source: e.source,
            })?;
        if before != after {
            tracing::info!(path = %path.display(), from = before, to = after, "migrated state database");
        }
        let sqlite = |action, source| StoreError::Sqlite {
            path: path.clone(),
            action,
            source,
        };
        if let Some(loss) = &accepted {
            let message = format!(
                "vfiod started on a state database that lacks changes it acknowledged, as the \
                 operator accepted (--accept-store-loss): {}",
                loss.describe()
            );
            tracing::error!(path = %path.display(), "{message}");
            insert_event(
                &conn,
                &NewEvent::new(None, EventKind::Store, message),
                now_ms(),
            )
            .map_err(|e| sqlite("record the accepted loss", e))?;
        }
        let mark = integrity::read_mark(&conn).map_err(|e| sqlite("read the change counter", e))?;
        let ack = integrity::AckFile::open(&ack_path).map_err(&ack_error)?;
        let new_store = !existed || found == 0;
        match recorded {
            // A new mark: a first start, a new store on purpose, a loss accepted, a file that
            // held no intact mark.
            integrity::Recorded::None | integrity::Recorded::Unreadable => {
                if recorded == integrity::Recorded::Unreadable {
                    tracing::warn!(
                        "{} holds no intact mark; the store could not be checked against what \
                         vfiod acknowledged, and a new mark starts now",
                        ack_path.display()
                    );
                }
                ack.reset(&mark).map_err(&ack_error)?;
            }
            integrity::Recorded::Mark(_) if accepted.is_some() || new_store => {
                ack.reset(&mark).map_err(&ack_error)?;
            }
            integrity::Recorded::Mark(_) => ack.record(&mark).map_err(&ack_error)?,
        }
        conn.set_db_config(DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, false)
            .map_err(|e| sqlite("set the checkpoint on close", e))?;
        let integrity = integrity::Tracker::new(&path, ack, mark);
        Ok((
            Store {
                conn: Mutex::new(conn),
                path,
                events: tokio::sync::watch::channel(0).0,
                clean_policy: Mutex::new(clean::CleanPolicy::none()),
                split_policy: Mutex::new(crate::claim::SplitPolicy::none()),
                clean_wanted: std::sync::Arc::default(),
                integrity: Mutex::new(integrity),
            },
            accepted,
        ))
    }

    /// Copies every change in the write-ahead log into the main file and empties the log
    /// (`wal_checkpoint(TRUNCATE)`): at a clean stop, so that `vfiod.db` alone holds the whole
    /// store. Waits up to the busy timeout for another process's reader; returns whether the
    /// log could be emptied (a reader that stays keeps its frames there, which are safe).
    pub fn checkpoint(&self) -> Result<bool, StoreError> {
        let conn = self.lock();
        integrity::checkpoint(&conn).map_err(|e| self.sqlite("checkpoint the write-ahead log", e))
    }

    /// A receiver that changes after a write that may have added events: read the events
    /// after the last one seen (`events`). Its value is only a counter.
    pub fn subscribe_events(&self) -> tokio::sync::watch::Receiver<u64> {
        self.events.subscribe()
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The schema version recorded in the file (`PRAGMA user_version`).
    pub fn schema_version(&self) -> Result<u32, StoreError> {
        schema::user_version(&self.lock()).map_err(|e| self.sqlite("read the schema version", e))
    }

    /// Every device present, ordered by address.
    pub fn devices(&self) -> Result<Vec<Device>, StoreError> {
        let conn = self.lock();
        self.devices_in(&conn)
    }

    fn devices_in(&self, conn: &Connection) -> Result<Vec<Device>, StoreError> {
        let action = "read devices";
        let mut stmt = conn
            .prepare_cached(&format!("{} ORDER BY address", device_row::SELECT))
            .map_err(|e| self.sqlite(action, e))?;
        let mut rows = stmt.query([]).map_err(|e| self.sqlite(action, e))?;
        let mut devices = Vec::new();
        while let Some(row) = rows.next().map_err(|e| self.sqlite(action, e))? {
            devices.push(device_row::decode(row).map_err(|e| self.decode(e))?);
        }
        // The text order of the column equals PciAddress's order only while every domain has
        // four digits; sort on the typed address so the promise holds for wide domains too.
        devices.sort_by_key(|d| d.address);
        Ok(devices)
    }

    /// The device at `address`, if present.
    pub fn device(&self, address: PciAddress) -> Result<Option<Device>, StoreError> {
        let conn = self.lock();
        self.device_in(&conn, address)
    }

    fn device_in(
        &self,
        conn: &Connection,
        address: PciAddress,
    ) -> Result<Option<Device>, StoreError> {
        let action = "read a device";
        let mut stmt = conn
            .prepare_cached(&format!("{} WHERE address = ?1", device_row::SELECT))
            .map_err(|e| self.sqlite(action, e))?;
        let mut rows = stmt
            .query([address.to_string()])
            .map_err(|e| self.sqlite(action, e))?;
        match rows.next().map_err(|e| self.sqlite(action, e))? {
            Some(row) => Ok(Some(device_row::decode(row).map_err(|e| self.decode(e))?)),
            None => Ok(None),
        }
    }

    /// Applies one inventory pass atomically: upserts `Added` and `Changed`, deletes `Removed`,
    /// and records `events`, all in one transaction, in order. Returns the recorded events with
    /// their ids. Either everything is committed, durably, or nothing is.
    pub fn apply_changes(
        &self,
        changes: &[DeviceChange],
        events: &[NewEvent],
    ) -> Result<Vec<Event>, StoreError> {
        for change in changes {
            if let DeviceChange::Changed { old, new } = change {
                if old.address != new.address {
                    return Err(StoreError::AddressChanged {
                        path: self.path.clone(),
                        old: old.address,
                        new: new.address,
                    });
                }
            }
        }
        let action = "apply inventory changes";
        let mut conn = self.lock();
        // IMMEDIATE takes the write lock up front, where busy_timeout applies, instead of failing
        // with SQLITE_BUSY when a read transaction later upgrades to write.
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| self.sqlite(action, e))?;
        let now = now_ms();
        for change in changes {
            match change {
                DeviceChange::Added(device) | DeviceChange::Changed { new: device, .. } => {
                    device_row::upsert(&tx, device, now)
                }
                DeviceChange::Removed(device) => tx
                    .prepare_cached("DELETE FROM devices WHERE address = ?1")
                    .and_then(|mut stmt| stmt.execute([device.address.to_string()]))
                    .map(drop),
            }
            .map_err(|e| self.sqlite(action, e))?;
        }
        let recorded = events
            .iter()
            .map(|event| insert_event(&tx, event, now))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.sqlite(action, e))?;
        // On any early return above, dropping `tx` rolls the whole pass back.
        tx.commit().map_err(|e| self.sqlite(action, e))?;
        Ok(recorded)
    }

    /// Records one event on its own, durably.
    pub fn record_event(&self, event: NewEvent) -> Result<Event, StoreError> {
        let action = "record an event";
        let conn = self.lock();
        // A single INSERT is its own transaction; no explicit one needed.
        insert_event(&conn, &event, now_ms()).map_err(|e| self.sqlite(action, e))
    }

    /// Events with an id above `after_id` (0 for the start), about `address` if given, oldest
    /// first, at most `limit`.
    pub fn events(
        &self,
        address: Option<PciAddress>,
        after_id: i64,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        self.select_events(
            &EventFilter {
                address,
                kind: None,
            },
            Page::After(after_id),
            limit,
        )
    }

    /// The newest `limit` events (of `address`, or of every device), before event id `before`
    /// when given: a page back through the history. Oldest first, like [`Store::events`].
    pub fn recent_events(
        &self,
        address: Option<PciAddress>,
        before: Option<i64>,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        let filter = EventFilter {
            address,
            kind: None,
        };
        self.select_events(&filter, Page::Before(before.unwrap_or(i64::MAX)), limit)
    }

    /// The events `filter` keeps: after an id (oldest first, the first `limit`) or before one
    /// (the newest `limit`, returned oldest first).
    pub fn select_events(
        &self,
        filter: &EventFilter,
        page: Page,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        let action = "read events";
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        // One statement per combination, each with plain equalities: `?3 IS NULL OR address =
        // ?3` would defeat the index.
        let mut sql = String::from("SELECT id, time_ms, address, kind, message FROM events WHERE ");
        let (id, order) = match page {
            Page::After(after) => (after, "id > ?1 ORDER BY id"),
            Page::Before(before) => (before, "id < ?1 ORDER BY id DESC"),
        };
        let mut args: Vec<Box<dyn rusqlite::ToSql>> = vec![Box::new(id), Box::new(limit)];
        if let Some(a) = filter.address {
            args.push(Box::new(a.to_string()));
            sql.push_str(&format!("address = ?{} AND ", args.len()));
        }
        if let Some(k) = filter.kind {
            args.push(Box::new(k.as_str()));
            sql.push_str(&format!("kind = ?{} AND ", args.len()));
        }
        sql.push_str(order);
        sql.push_str(" LIMIT ?2");
        let conn = self.lock();
        let mut stmt = conn
            .prepare_cached(&sql)
            .map_err(|e| self.sqlite(action, e))?;
        let mut rows = stmt
            .query(rusqlite::params_from_iter(args.iter()))
            .map_err(|e| self.sqlite(action, e))?;
        let mut events = Vec::new();
        while let Some(row) = rows.next().map_err(|e| self.sqlite(action, e))? {
            events.push(decode_event(row).map_err(|e| self.decode(e))?);
        }
        if matches!(page, Page::Before(_)) {
            events.reverse();
        }
        Ok(events)
    }

    /// Whether `address` is present or has any history: what a query about it may ask.
    pub fn knows(&self, address: PciAddress) -> Result<bool, StoreError> {
        let action = "look a device up";
        let conn = self.lock();
        conn.query_row(
            "SELECT EXISTS (SELECT 1 FROM devices WHERE address = ?1) \
             OR EXISTS (SELECT 1 FROM events WHERE address = ?1)",
            params![address.to_string()],
            |r| r.get::<_, bool>(0),
        )
        .map_err(|e| self.sqlite(action, e))
    }

    /// How many devices are present, and how many are usable, protected, broken and cleaning.
    pub fn counts(&self) -> Result<Counts, StoreError> {
        let action = "count devices";
        let conn = self.lock();
        let raw: [i64; 5] = conn
            .query_row(
                "SELECT count(*), coalesce(sum(state = ?1), 0), coalesce(sum(state = ?2), 0), \
                 coalesce(sum(state = ?3), 0), coalesce(sum(state = ?4), 0) FROM devices",
                params![
                    State::Usable.as_str(),
                    State::Protected.as_str(),
                    State::Broken.as_str(),
                    State::Cleaning.as_str()
                ],
                |row| {
                    Ok([
                        row.get(0)?,
                        row.get(1)?,
                        row.get(2)?,
                        row.get(3)?,
                        row.get(4)?,
                    ])
                },
            )
            .map_err(|e| self.sqlite(action, e))?;
        // Counts of rows cannot be negative, and four billion PCI functions do not exist.
        let [total, usable, protected, broken, cleaning] =
            raw.map(|n| u32::try_from(n).unwrap_or(u32::MAX));
        Ok(Counts {
            total,
            usable,
            protected,
            broken,
            cleaning,
        })
    }

    /// Runs `f` in one immediate transaction and commits if it returns `Ok`; any error rolls it
    /// all back. IMMEDIATE takes the write lock before `f` reads, so what `f` checks still holds
    /// when it writes, even against another process.
    fn write<T>(
        &self,
        action: &'static str,
        f: impl FnOnce(&Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut conn = self.lock();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| self.sqlite(action, e))?;
        let value = f(&tx)?;
        tx.commit().map_err(|e| self.sqlite(action, e))?;
        Ok(value)
    }

    /// Runs `each` on every item, in order, each in its own savepoint of one IMMEDIATE
    /// transaction that commits once: a batch costs one fsync however many items it has. An item
    /// whose `each` fails is rolled back alone and keeps its error; the others stand. If the
    /// transaction cannot begin, is lost midway (SQLite rolls a whole transaction back on some
    /// I/O errors) or cannot commit, nothing of the batch is stored and every item that had
    /// succeeded gets that error instead. One result per item, in order.
    fn write_each<I, T>(
        &self,
        action: &'static str,
        items: Vec<I>,
        mut each: impl FnMut(&Connection, I) -> Result<T, StoreError>,
    ) -> Vec<Result<T, StoreError>> {
        let mut conn = self.lock();
        let mut tx = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
            Ok(tx) => tx,
            Err(e) => return self.batch_failed(action, &e, items.len(), Vec::new()),
        };
        let mut results = Vec::with_capacity(items.len());
        let mut items = items.into_iter();
        while let Some(item) = items.next() {
            let sp = match tx.savepoint() {
                Ok(sp) => sp,
                Err(e) => return self.batch_failed(action, &e, items.len() + 1, results),
            };
            let result = each(&sp, item);
            // Ok: RELEASE keeps the item's changes; Err: ROLLBACK TO undoes them (drop behavior).
            let ended = if result.is_ok() {
                sp.commit()
            } else {
                sp.finish()
            };
            results.push(result);
            if let Err(e) = ended {
                return self.batch_failed(action, &e, items.len(), results);
            }
            if tx.is_autocommit() {
                // The transaction is gone: what the items before this one did is gone with it.
                let e = rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ABORT),
                    Some("the transaction was rolled back".into()),
                );
                return self.batch_failed(action, &e, items.len(), results);
            }
        }
        match tx.commit() {
            Ok(()) => results,
            Err(e) => self.batch_failed(action, &e, 0, results),
        }
    }

    /// The results of a batch that could not commit: the items that had succeeded, and the
    /// `untried` ones after them, fail with `error`; the failures keep their own errors.
    fn batch_failed<T>(
        &self,
        action: &'static str,
        error: &rusqlite::Error,
        untried: usize,
        results: Vec<Result<T, StoreError>>,
    ) -> Vec<Result<T, StoreError>> {
        // rusqlite's error is not Clone: every item gets its own copy of code and message.
        let copy = || match error {
            rusqlite::Error::SqliteFailure(code, message) => {
                rusqlite::Error::SqliteFailure(*code, message.clone())
            }
            other => rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ERROR),
                Some(other.to_string()),
            ),
        };
        results
            .into_iter()
            .map(|r| r.and_then(|_| Err(self.sqlite(action, copy()))))
            .chain((0..untried).map(|_| Err(self.sqlite(action, copy()))))
            .collect()
    }

    fn lock(&self) -> event_feed::Guard<'_> {
        // A panic while the lock was held unwound through the transaction's drop, which rolled
        // it back: the connection is consistent, and poisoning carries no information here.
        event_feed::Guard::new(
            self.conn.lock().unwrap_or_else(PoisonError::into_inner),
            &self.events,
            &self.integrity,
        )
    }

    fn sqlite(&self, action: &'static str, source: rusqlite::Error) -> StoreError {
        StoreError::Sqlite {
            path: self.path.clone(),
            action,
            source,
        }
    }

    fn decode(&self, e: DecodeError) -> StoreError {
        StoreError::Decode {
            path: self.path.clone(),
            table: e.table,
            key: e.key,
            column: e.column,
            source: e.source,
        }
    }
}

/// The per-connection settings, at open and wherever the connection is set up again.
fn configure(conn: &Connection) -> rusqlite::Result<()> {
    // FULL, not WAL's usual NORMAL: NORMAL may lose the last commits on power loss, and a
    // D-Bus reply promises that its change is on disk.
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.pragma_update(None, "foreign_keys", true)?;
    // Checkpoints as the log grows, and a log file cut back after one (see integrity).
    conn.pragma_update(None, "wal_autocheckpoint", WAL_CHECKPOINT_PAGES)?;
    conn.pragma_update(None, "journal_size_limit", WAL_SIZE_LIMIT)?;
    Ok(())
}

/// Maps an error of the opening sequence, telling a file that is not a database apart.
fn open_error(path: &Path, source: rusqlite::Error) -> StoreError {
    match source.sqlite_error_code() {
        Some(ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt) => StoreError::NotADatabase {
            path: path.to_path_buf(),
            source,
        },
        _ => StoreError::Open {
            path: path.to_path_buf(),
            source,
        },
    }
}

/// Refuses a database that is newer than this build or belongs to another program.
fn check_identity(conn: &Connection, path: &Path, version: u32) -> Result<(), StoreError> {
    if version > SCHEMA_VERSION {
        return Err(StoreError::TooNew {
            path: path.to_path_buf(),
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    let foreign = |reason: String| StoreError::Foreign {
        path: path.to_path_buf(),
        reason,
    };
    let application_id: i32 = conn
        .pragma_query_value(None, "application_id", |row| row.get(0))
        .map_err(|source| open_error(path, source))?;
    if version > 0 && application_id != schema::APPLICATION_ID {
        return Err(foreign(format!(
            "schema version {version} with application id {application_id:#x}"
        )));
    }
    if version == 0 {
        // Version 0 is a new, empty file; a file with tables is someone else's.
        let objects: i64 = conn
            .query_row("SELECT count(*) FROM sqlite_master", [], |row| row.get(0))
            .map_err(|source| open_error(path, source))?;
        if objects > 0 || application_id != 0 {
            return Err(foreign(format!(
                "schema version 0 but {objects} schema objects, application id {application_id:#x}"
            )));
        }
    }
    Ok(())
}

fn insert_event(conn: &Connection, event: &NewEvent, now: i64) -> rusqlite::Result<Event> {
    conn.prepare_cached(
        "INSERT INTO events (time_ms, address, kind, message) VALUES (?1, ?2, ?3, ?4)",
    )?
    .execute(params![
        now,
        event.address.map(|a| a.to_string()),
        event.kind.as_str(),
        event.message
    ])?;
    Ok(Event {
        id: conn.last_insert_rowid(),
        time_ms: now,
        address: event.address,
        kind: event.kind,
        message: event.message.clone(),
    })
}

fn decode_event(row: &rusqlite::Row<'_>) -> Result<Event, DecodeError> {
    let id: i64 = row.get("id").unwrap_or_default();
    let f = Fields {
        row,
        table: "events",
        key: id.to_string(),
        columns: &[],
    };
    Ok(Event {
        id,
        time_ms: f.get("time_ms")?,
        address: f.opt_parse("address")?,
        kind: f.parse("kind")?,
        message: f.get("message")?,
    })
}

/// Wall-clock Unix time in milliseconds; a clock before 1970 reads as 0.
fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_settings_are_in_effect() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let conn = store.lock();
        let get = |name: &str| -> String {
            conn.pragma_query_value(None, name, |row| row.get::<_, rusqlite::types::Value>(0))
                .map(|v| match v {
                    rusqlite::types::Value::Integer(i) => i.to_string(),
                    rusqlite::types::Value::Text(t) => t,
                    other => format!("{other:?}"),
                })
                .unwrap()
        };
        assert_eq!(get("journal_mode"), "wal");
        assert_eq!(get("synchronous"), "2", "synchronous must be FULL");
        assert_eq!(get("foreign_keys"), "1");
        assert_eq!(get("busy_timeout"), BUSY_TIMEOUT.as_millis().to_string());
    }

    #[test]
    fn store_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Store>();
    }

    #[test]
    fn a_poisoned_lock_leaves_a_usable_store() {
        let dir = tempfile::tempdir().unwrap();
        let store = std::sync::Arc::new(Store::open(dir.path()).unwrap());
        let inner = store.clone();
        let panicked = std::thread::spawn(move || {
            let mut conn = inner.lock();
            let tx = conn.transaction().unwrap();
            tx.execute(
                "INSERT INTO events (time_ms, address, kind, message) VALUES (0, NULL, 'config', '')",
                [],
            )
            .unwrap();
            panic!("simulated bug while holding the store");
        })
        .join();
        assert!(panicked.is_err());
        // The half-done transaction was rolled back and the store still works.
        assert!(store.events(None, 0, 10).unwrap().is_empty());
        store
            .record_event(NewEvent::new(None, EventKind::Config, "after"))
            .unwrap();
        assert_eq!(store.events(None, 0, 10).unwrap().len(), 1);
    }
}
