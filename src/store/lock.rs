//! One vfiod per state directory: an exclusive `flock` on `<state_dir>/vfiod.lock`, held for
//! the life of the daemon, with the holder's pid written in the file for the error message.
//!
//! Two daemons on one store would each take the other's running tasks for interrupted ones.
//! `flock` (not the pid in the file) is what excludes: the kernel drops it when the holder's
//! last descriptor closes, so the file of a killed vfiod is no obstacle and needs no cleanup.
//! The lock is taken by whoever starts a daemon, not by `Store::open`: a second `Store` on the
//! same file in one process is legitimate (readers, the tests' races).

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The lock file's name inside the directory it guards.
pub const LOCK_FILE_NAME: &str = "vfiod.lock";

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("cannot create the state directory {dir}")]
    Dir {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot open the lock file {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("state directory {} is in use by {} (lock {})", .dir.display(), holder(*.pid), .path.display())]
    InUse {
        dir: PathBuf,
        path: PathBuf,
        /// The holder's pid as it wrote it; `None` when it had not written it yet.
        pid: Option<u32>,
    },
    #[error("cannot lock {path}")]
    Lock {
        path: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("cannot record this process's pid in {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn holder(pid: Option<u32>) -> String {
    match pid {
        Some(p) => format!("vfiod pid {p}"),
        None => "another vfiod (pid not recorded yet)".into(),
    }
}

/// The held lock; dropping it (or the process dying) releases it.
#[derive(Debug)]
pub struct StateDirLock {
    _file: Flock<File>,
    path: PathBuf,
}

impl StateDirLock {
    /// Takes the lock of `dir` (created, mode 0700, if missing), without waiting: if another
    /// process, or another `StateDirLock` of this process, holds it, fails with
    /// [`LockError::InUse`] naming the holder's pid.
    pub fn acquire(dir: &Path) -> Result<StateDirLock, LockError> {
        // Same mode as Store::open, which would otherwise be the one to create it.
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| LockError::Dir {
                dir: dir.to_path_buf(),
                source,
            })?;
        let path = dir.join(LOCK_FILE_NAME);
        // Not truncated on open: until we hold the lock, the pid in it is the holder's.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(&path)
            .map_err(|source| LockError::Open {
                path: path.clone(),
                source,
            })?;
        let mut file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(f) => f,
            Err((mut f, Errno::EWOULDBLOCK)) => {
                return Err(LockError::InUse {
                    dir: dir.to_path_buf(),
                    pid: read_pid(&mut f),
                    path,
                })
            }
            Err((_, source)) => return Err(LockError::Lock { path, source }),
        };
        let write = |f: &mut File| -> io::Result<()> {
            f.set_len(0)?;
            f.seek(SeekFrom::Start(0))?;
            f.write_all(format!("{}\n", std::process::id()).as_bytes())?;
            f.sync_all()
        };
        write(&mut file).map_err(|source| LockError::Write {
            path: path.clone(),
            source,
        })?;
        Ok(StateDirLock { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn read_pid(f: &mut File) -> Option<u32> {
    let mut text = String::new();
    f.seek(SeekFrom::Start(0)).ok()?;
    f.read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_lock_names_the_holder_and_a_released_lock_is_free() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let first = StateDirLock::acquire(&state).unwrap();
        assert_eq!(first.path(), state.join(LOCK_FILE_NAME));
        let e = StateDirLock::acquire(&state).unwrap_err();
        let LockError::InUse { pid, .. } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(*pid, Some(std::process::id()));
        assert_eq!(
            e.to_string(),
            format!(
                "state directory {} is in use by vfiod pid {} (lock {})",
                state.display(),
                std::process::id(),
                state.join(LOCK_FILE_NAME).display()
            )
        );
        drop(first);
        // The file stays, with a pid that no longer holds it: no obstacle.
        assert!(state.join(LOCK_FILE_NAME).exists());
        let again = StateDirLock::acquire(&state).unwrap();
        drop(again);
    }

    #[test]
    fn a_stale_pid_in_the_file_is_not_an_obstacle() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(LOCK_FILE_NAME), "999999999\n").unwrap();
        let lock = StateDirLock::acquire(dir.path()).unwrap();
        let text = std::fs::read_to_string(lock.path()).unwrap();
        assert_eq!(text, format!("{}\n", std::process::id()));
    }
}
