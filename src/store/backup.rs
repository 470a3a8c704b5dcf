//! A consistent copy of the state database while vfiod runs (`vfioctl backup FILE`), with
//! SQLite's online backup API.
//!
//! Who takes it: the caller, opening `<state_dir>/vfiod.db` read-only itself, not the daemon. A
//! daemon method that wrote to a path its (root) client names would be a confused deputy: any
//! caller polkit admitted could make vfiod overwrite a file of its choosing as root. Reading the
//! database needs what reading the file needs (root on a real host, the state directory being
//! 0700), and the copy is written with the caller's own rights. In WAL mode a reader never
//! blocks the daemon's writes; the whole copy is one step of the backup API, so one read
//! transaction: a snapshot of one moment, never a mix of before and after a commit.
//!
//! The copy is one self-contained file in rollback-journal mode (no `-wal` to carry along) that
//! holds everything the acknowledged mark is checked against at start: the change counter and
//! the ids handed out (`sqlite_sequence`). It is written beside FILE under a temporary name,
//! checked (`quick_check`), synced and renamed into place: FILE is a whole backup or absent.
//!
//! Restoring (docs/operations.md): stop vfiod, remove `vfiod.db-wal` and `vfiod.db-shm`, put the
//! copy in place as `vfiod.db`, start. The state directory's `vfiod.acknowledged` remembers
//! what vfiod acknowledged since the copy: vfiod refuses to start and names what the copy lacks
//! (`StoreError::Lost`) until the operator accepts it with `vfiod --accept-store-loss`.

use super::integrity::{self, Mark};
use super::DB_FILE_NAME;
use rusqlite::backup::{Backup, StepResult};
use rusqlite::{Connection, OpenFlags};
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Errors of a backup. Each names the file it is about.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error(
        "no state database at {}: is the state directory right (state_dir in the \
         configuration, or --state-dir)?",
        .0.display()
    )]
    NoDatabase(PathBuf),
    #[error("cannot read the state database {}", .path.display())]
    Source {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("{} exists; choose another name, or pass --force to replace it", .0.display())]
    Exists(PathBuf),
    /// FILE is the live store or one of its companions: a copy renamed onto it would replace
    /// the daemon's database under its feet.
    #[error(
        "{} is one of vfiod's own state files; write the backup outside the state directory's \
         vfiod.* files",
        .0.display()
    )]
    OntoTheStore(PathBuf),
    #[error("cannot write the backup {}", .path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot copy the state database into {}", .path.display())]
    Copy {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("the copy {} failed its check ({detail}); nothing was written", .path.display())]
    Damaged { path: PathBuf, detail: String },
}

/// What a backup holds.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct BackupReport {
    pub path: PathBuf,
    pub bytes: u64,
    pub schema_version: u32,
    /// The row changes it holds, as the acknowledged mark counts them.
    pub changes: Option<i64>,
    /// The last claim, task and event ids handed out when it was taken.
    pub last_claim: i64,
    pub last_task: i64,
    pub last_event: i64,
    pub events: i64,
    pub tasks: i64,
    pub claims: i64,
}

/// Copies `<state_dir>/vfiod.db` into `dest` (replacing it only with `force`).
pub fn backup(state_dir: &Path, dest: &Path, force: bool) -> Result<BackupReport, BackupError> {
    let path = state_dir.join(DB_FILE_NAME);
    if !path.exists() {
        return Err(BackupError::NoDatabase(path));
    }
    if is_state_file(state_dir, dest) {
        return Err(BackupError::OntoTheStore(dest.to_path_buf()));
    }
    if !force && std::fs::symlink_metadata(dest).is_ok() {
        return Err(BackupError::Exists(dest.to_path_buf()));
    }
    let source_error = |source| BackupError::Source {
        path: path.clone(),
        source,
    };
    let src = Connection::open_with_flags(
        &path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(source_error)?;
    // Waits for a writer's lock the way the daemon's own readers do.
    src.pragma_update(None, "busy_timeout", 5_000)
        .map_err(source_error)?;

    let dir = match dest.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = dest
        .file_name()
        .map_or_else(|| "backup".into(), |n| n.to_string_lossy().into_owned());
    let temp = dir.join(format!(".{name}.partial-{}", std::process::id()));
    let write_error = |path: &Path| {
        let path = path.to_path_buf();
        move |source| BackupError::Write { path, source }
    };
    // The state holds VM names and who asked for what: readable by its owner only.
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temp)
        .map_err(write_error(&temp))?;
    let result = copy(&src, &temp, dest);
    if result.is_err() {
        let _ = std::fs::remove_file(&temp);
        return result;
    }
    let synced = OpenOptions::new()
        .read(true)
        .open(&temp)
        .and_then(|f| f.sync_all())
        .and_then(|()| std::fs::rename(&temp, dest))
        .and_then(|()| std::fs::File::open(&dir).and_then(|d| d.sync_all()));
    if let Err(e) = synced {
        let _ = std::fs::remove_file(&temp);
        return Err(write_error(dest)(e));
    }
    let bytes = std::fs::metadata(dest).map_err(write_error(dest))?.len();
    result.map(|r| BackupReport { bytes, ..r })
}

/// Whether `dest` names the database, its log, its shared memory or the acknowledged mark in
/// `state_dir` (through any spelling of the directory: compared after resolving it).
fn is_state_file(state_dir: &Path, dest: &Path) -> bool {
    let resolve = |dir: &Path| std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let dir = match dest.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Some(name) = dest.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    let own = [
        DB_FILE_NAME.to_string(),
        format!("{DB_FILE_NAME}-wal"),
        format!("{DB_FILE_NAME}-shm"),
        format!("{DB_FILE_NAME}-journal"),
        integrity::ACK_FILE_NAME.to_string(),
    ];
    resolve(dir) == resolve(state_dir) && own.iter().any(|o| o == name)
}

/// The copy into `temp` (already created, empty), checked; `dest` only names it in the report.
fn copy(src: &Connection, temp: &Path, dest: &Path) -> Result<BackupReport, BackupError> {
    let copy_error = |source| BackupError::Copy {
        path: dest.to_path_buf(),
        source,
    };
    let mut dst = Connection::open(temp).map_err(copy_error)?;
    {
        let backup = Backup::new(src, &mut dst).map_err(copy_error)?;
        // Every page in one step: one read transaction, one moment of the store. (Steps of a
        // few pages would start over whenever the daemon commits in between.)
        loop {
            match backup.step(-1).map_err(copy_error)? {
                StepResult::Done => break,
                // Another process held a lock: try again (busy_timeout waited already).
                StepResult::Busy | StepResult::Locked => {
                    std::thread::sleep(std::time::Duration::from_millis(50))
                }
                StepResult::More => {}
                _ => {}
            }
        }
    }
    // One file: out of WAL mode, so that no -wal belongs to the copy. vfiod puts it back in WAL
    // mode when it opens it.
    let mode: String = dst
        .pragma_update_and_check(None, "journal_mode", "delete", |r| r.get(0))
        .map_err(copy_error)?;
    if !mode.eq_ignore_ascii_case("delete") {
        return Err(BackupError::Damaged {
            path: dest.to_path_buf(),
            detail: format!("its journal mode stayed {mode}"),
        });
    }
    let verdict: String = dst
        .query_row("PRAGMA quick_check(1)", [], |r| r.get(0))
        .map_err(copy_error)?;
    if verdict != "ok" {
        return Err(BackupError::Damaged {
            path: dest.to_path_buf(),
            detail: verdict,
        });
    }
    let mark: Mark = integrity::read_mark(&dst).map_err(copy_error)?;
    let schema_version: u32 = dst
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(copy_error)?;
    let count = |table: &str| -> Result<i64, BackupError> {
        dst.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
            .map_err(copy_error)
    };
    Ok(BackupReport {
        path: dest.to_path_buf(),
        bytes: 0,
        schema_version,
        changes: mark.changes,
        last_claim: mark.claims,
        last_task: mark.tasks,
        last_event: mark.events,
        events: count("events")?,
        tasks: count("tasks")?,
        claims: count("claims")?,
    })
}
