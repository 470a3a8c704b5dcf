//! Bounded sysfs writes. A sysfs store that blocks in a driver (an unbind waiting for a device
//! to be released, a probe stuck in firmware) cannot be interrupted, so writes run off the
//! caller's thread and the caller gives up on them after a timeout; the stuck thread is left to
//! finish on its own.
//!
//! One long-lived thread serves jobs while it is free (a thread per write costs more than the
//! write itself); a job that finds it busy, e.g. still stuck in a driver, gets a thread of its
//! own. Handing every write of a 64-VF split to another thread and back costs two cross-CPU
//! wake-ups each, so a whole program can run as one job ([`super::Sysfs::run_bounded`]) whose
//! writes are made inline on the job's thread and watched from the caller's.

use super::Backend;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A job for the writer thread. It calls `release` when its work is done and before it
/// replies, so that the caller's next job finds the long-lived thread free.
pub(super) type Job = Box<dyn FnOnce(&dyn Fn()) + Send>;

pub(super) struct Writer {
    jobs: Mutex<Option<Sender<Job>>>,
    busy: Arc<AtomicBool>,
}

impl Writer {
    pub(super) fn new() -> Writer {
        Writer {
            jobs: Mutex::new(None),
            busy: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Hands the job to the long-lived thread if it is free, else to a new thread.
    pub(super) fn submit(&self, job: Job) -> std::io::Result<()> {
        if self
            .busy
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            std::thread::Builder::new()
                .name("sysfs-write".into())
                .spawn(move || job(&|| {}))?;
            return Ok(());
        }
        let mut slot = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            let (tx, rx) = std::sync::mpsc::channel::<Job>();
            let busy = Arc::clone(&self.busy);
            std::thread::Builder::new()
                .name("sysfs-writer".into())
                .spawn(move || {
                    for job in rx {
                        let release = || busy.store(false, Ordering::Release);
                        let run = std::panic::AssertUnwindSafe(|| job(&release));
                        // A job that panics drops its reply (its caller sees that) and must
                        // not take the thread, or the busy flag, with it.
                        if std::panic::catch_unwind(run).is_err() {
                            release();
                        }
                    }
                })?;
            *slot = Some(tx);
        }
        slot.as_ref()
            .expect("writer started")
            .send(job)
            .map_err(|_| {
                // The thread died (a job panicked): start a new one next time.
                *slot = None;
                self.busy.store(false, Ordering::Release);
                std::io::Error::other("sysfs writer thread is gone")
            })
    }
}

/// What an inline job is writing right now, and since when: the caller's watchdog reads it.
#[derive(Default)]
pub(super) struct Watch {
    current: Mutex<Option<(PathBuf, String, Instant)>>,
    /// Set when the caller gave up on the job: its later writes fail instead of running after
    /// the caller has moved on (rolled back, reported).
    abandoned: AtomicBool,
}

impl Watch {
    pub(super) fn write(
        &self,
        backend: &dyn Backend,
        path: &std::path::Path,
        value: &str,
    ) -> std::io::Result<()> {
        if self.abandoned.load(Ordering::Acquire) {
            return Err(std::io::Error::other(
                "not written: an earlier write of this program timed out and it was abandoned",
            ));
        }
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((path.to_path_buf(), value.to_string(), Instant::now()));
        let r = backend.write(path, value.as_bytes());
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = None;
        r
    }

    /// The write that has been running for `timeout` or longer, if any.
    fn overdue(&self, timeout: Duration) -> Option<(PathBuf, String)> {
        let cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        cur.as_ref()
            .filter(|(_, _, since)| since.elapsed() >= timeout)
            .map(|(p, v, _)| (p.clone(), v.clone()))
    }

    fn abandon(&self) {
        self.abandoned.store(true, Ordering::Release);
    }
}

/// What an inline job sends to its caller.
pub(super) enum Msg<T, M> {
    Post(M),
    Done(T),
}

/// How a watched job ended, seen from the caller.
pub(super) enum Outcome<T> {
    Done(T),
    /// This write did not finish within the timeout; the job was abandoned.
    Overdue(PathBuf, String),
    /// The job's thread ended without a result (it panicked).
    Lost,
}

/// Waits for an inline job, handing its posts to `on_post`, and gives up when one of its writes
/// has been running for `timeout`.
pub(super) fn watch<T, M>(
    rx: Receiver<Msg<T, M>>,
    watch: &Watch,
    timeout: Duration,
    on_post: &mut dyn FnMut(M),
) -> Outcome<T> {
    // Wake up often enough that a hung write is noticed soon after its deadline, rarely enough
    // to cost nothing while a long program runs.
    let tick = (timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    loop {
        match rx.recv_timeout(tick) {
            Ok(Msg::Post(m)) => on_post(m),
            Ok(Msg::Done(t)) => return Outcome::Done(t),
            Err(RecvTimeoutError::Timeout) => {
                if let Some((path, value)) = watch.overdue(timeout) {
                    watch.abandon();
                    return Outcome::Overdue(path, value);
                }
            }
            Err(RecvTimeoutError::Disconnected) => return Outcome::Lost,
        }
    }
}
