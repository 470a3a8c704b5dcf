//! The textfile for node_exporter's textfile collector: how it is written, and the task that
//! keeps it fresh.
//!
//! node_exporter reads every `*.prom` file of its directory at each scrape; a file read while
//! it is being written would export half the metrics. So the text goes to a hidden temporary
//! file in the same directory (never `*.prom`, so never read), which a rename then puts in
//! place: a reader sees the old file or the new one, whole.
//!
//! When: at start, then after a change (a committed change of devices, claims or tasks, or an
//! update of a counter), but at most once per [`MIN_GAP`], and at least once per
//! [`HEARTBEAT`]. node_exporter is scraped every 15 to 60 s, so writing more often than every
//! few seconds would show nobody anything, while a burst of changes (a reconcile of many
//! devices) must not rewrite the file for each; the heartbeat keeps the ages (the fleet
//! report's) current and the file's mtime (`node_textfile_mtime_seconds`) young, so that an
//! alert on an old file finds a vfiod that stopped writing.

use futures_util::future::BoxFuture;
use std::io::Write as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{oneshot, watch};

/// The shortest time between two writes.
pub const MIN_GAP: Duration = Duration::from_secs(5);
/// The longest time between two writes.
pub const HEARTBEAT: Duration = Duration::from_secs(30);

/// Why the textfile could not be written.
#[derive(Debug, thiserror::Error)]
pub enum TextfileError {
    #[error("{} has no directory", .0.display())]
    NoDirectory(PathBuf),
    #[error("cannot create a temporary file in {}", dir.display())]
    Create {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {}", tmp.display())]
    Write {
        tmp: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot rename the new metrics onto {}", path.display())]
    Rename {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Replaces `path` with `text` at once (a temporary file in its directory, renamed onto it).
/// Readable by everyone: node_exporter runs as a user of its own. Not synced to disk: after a
/// crash of the machine the file is stale or gone either way, and vfiod writes it again.
pub fn write_atomic(path: &Path, text: &str) -> Result<(), TextfileError> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .ok_or_else(|| TextfileError::NoDirectory(path.to_path_buf()))?;
    let create = |source| TextfileError::Create {
        dir: dir.to_path_buf(),
        source,
    };
    let mut tmp = tempfile::Builder::new()
        .prefix(".vfiod-metrics.")
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(create)?;
    let write = |source, tmp: &tempfile::NamedTempFile| TextfileError::Write {
        tmp: tmp.path().to_path_buf(),
        source,
    };
    if let Err(e) = tmp
        .as_file()
        .set_permissions(std::fs::Permissions::from_mode(0o644))
        .and_then(|()| tmp.write_all(text.as_bytes()))
        .and_then(|()| tmp.flush())
    {
        return Err(write(e, &tmp));
    }
    // On failure the temporary file is removed with `tmp`.
    tmp.persist(path).map_err(|e| TextfileError::Rename {
        path: path.to_path_buf(),
        source: e.error,
    })?;
    Ok(())
}

/// What the writer needs of the daemon.
pub trait Source: Send + Sync + 'static {
    /// The configured textfile, read at each write (a reload may change it); `None`: off.
    fn textfile(&self) -> Option<PathBuf>;
    /// The metrics as text, now.
    fn render(&self) -> BoxFuture<'_, Result<String, String>>;
    /// Counts a failed write.
    fn write_failed(&self);
}

/// What a write's outcome is worth in the log, given whether the previous write failed: the
/// first failure of a run warns, the repeats are debug (a missing directory fails every
/// 30 s), and the recovery is said once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Log {
    Nothing,
    Warn,
    Debug,
    Recovered,
}

fn log_for(failing_before: bool, ok: bool) -> Log {
    match (failing_before, ok) {
        (false, true) => Log::Nothing,
        (false, false) => Log::Warn,
        (true, false) => Log::Debug,
        (true, true) => Log::Recovered,
    }
}

/// The running writer; stopping it (or dropping it) ends its task.
pub struct Writer {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Writer {
    /// Starts writing `source`'s metrics; `changes` and `touched` wake it (their newest value
    /// only matters).
    pub fn start(
        source: Arc<dyn Source>,
        changes: watch::Receiver<u64>,
        touched: watch::Receiver<u64>,
    ) -> Writer {
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(run(source, changes, touched, stopped));
        Writer {
            stop: Some(stop),
            task,
        }
    }

    /// Ends the task; a write under way finishes on the blocking pool (whole, or not at all).
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), &mut self.task).await;
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn write_once(source: &dyn Source, path: PathBuf) -> Result<(), String> {
    let text = source.render().await?;
    tokio::task::spawn_blocking(move || write_atomic(&path, &text))
        .await
        .map_err(|e| format!("the write did not finish: {e}"))?
        .map_err(|e| crate::error_chain(&e))
}

async fn run(
    source: Arc<dyn Source>,
    mut changes: watch::Receiver<u64>,
    mut touched: watch::Receiver<u64>,
    mut stopped: oneshot::Receiver<()>,
) {
    // The file this writer last wrote: when the configuration names another (or none), the
    // old one goes, or node_exporter would export its frozen values forever.
    let mut written: Option<PathBuf> = None;
    let mut failing = false;
    loop {
        // Changes from here on wake the next turn, also those made while this one writes.
        changes.borrow_and_update();
        touched.borrow_and_update();
        let path = source.textfile();
        if let Some(old) = written.take_if(|old| Some(&*old) != path.as_ref()) {
            match std::fs::remove_file(&old) {
                Ok(()) => {
                    tracing::info!("metrics: removed {} (no longer configured)", old.display())
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!("metrics: cannot remove {}: {e}", old.display()),
            }
        }
        if let Some(path) = path {
            let outcome = write_once(&*source, path.clone()).await;
            if outcome.is_err() {
                source.write_failed();
            }
            match (log_for(failing, outcome.is_ok()), &outcome) {
                (Log::Warn, Err(e)) => tracing::warn!(
                    "metrics: cannot write the textfile: {e}; vfiod goes on and tries again \
                     at the next change, within {HEARTBEAT:?} at most"
                ),
                (Log::Debug, Err(e)) => tracing::debug!("metrics: cannot write the textfile: {e}"),
                (Log::Recovered, _) => {
                    tracing::info!("metrics: the textfile {} is written again", path.display())
                }
                _ => {}
            }
            failing = outcome.is_err();
            if outcome.is_ok() {
                written = Some(path);
            }
        }
        tokio::select! {
            _ = &mut stopped => return,
            _ = tokio::time::sleep(MIN_GAP) => {}
        }
        tokio::select! {
            _ = &mut stopped => return,
            r = changes.changed() => if r.is_err() { return },
            r = touched.changed() => if r.is_err() { return },
            _ = tokio::time::sleep(HEARTBEAT - MIN_GAP) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_warns_once_per_run_of_failures() {
        for (before, ok, wanted) in [
            (false, true, Log::Nothing),
            (false, false, Log::Warn),
            (true, false, Log::Debug),
            (true, true, Log::Recovered),
        ] {
            assert_eq!(log_for(before, ok), wanted, "{before} {ok}");
        }
    }

    #[test]
    fn a_write_replaces_the_file_whole_and_leaves_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vfiod.prom");
        write_atomic(&path, "a 1\n").unwrap();
        write_atomic(&path, "a 2\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "a 2\n");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o644);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("vfiod.prom")]);
    }

    #[test]
    fn a_missing_directory_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent").join("vfiod.prom");
        let e = write_atomic(&path, "a 1\n").unwrap_err();
        let text = crate::error_chain(&e);
        assert!(
            text.contains("cannot create a temporary file in") && text.contains("absent"),
            "{text}"
        );
    }
}
