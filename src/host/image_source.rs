//! Where an image added from this host comes from: a descriptor the caller passed
//! (`Images.Add`) or a path root named (`Images.AddFromPath`), read on a blocking thread.
//!
//! Neither may hold that thread for good: a pipe whose writer stays open, a FIFO nobody writes,
//! a caller that sends a byte a minute. [`open_regular`] refuses anything but a regular file
//! before a byte is read (a FIFO is opened with `O_NONBLOCK`, so that the open itself cannot
//! wait for a writer), and [`Source`] reads with a deadline between reads and one in total,
//! and stops when told (its caller went away).

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::model::image_source::SourceError;

/// The deadlines of one read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadlines {
    /// Between two reads that give data (and before the first).
    pub idle: Duration,
    /// For the whole source.
    pub total: Duration,
}

/// How long one wait lasts at most before the stop flag is looked at again: a caller that went
/// away frees its thread this soon.
const SLICE: Duration = Duration::from_millis(100);

/// A file, pipe or socket read within [`Deadlines`], stopped when `stop` is set.
pub struct Source {
    file: File,
    deadlines: Deadlines,
    started: Instant,
    last_data: Instant,
    stop: Arc<AtomicBool>,
}

impl Source {
    /// Puts `file` in non-blocking mode: a wait happens in `poll`, bounded, never in `read` (a
    /// caller that kept its own copy of a pipe's read end and takes the bytes first cannot leave
    /// a read blocked after `poll` said there were some). Regular files ignore the flag.
    pub fn new(file: File, deadlines: Deadlines, stop: Arc<AtomicBool>) -> io::Result<Source> {
        use nix::fcntl::{fcntl, FcntlArg, OFlag};
        let flags = fcntl(&file, FcntlArg::F_GETFL).map_err(io::Error::from)?;
        let flags = OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK;
        fcntl(&file, FcntlArg::F_SETFL(flags)).map_err(io::Error::from)?;
        let now = Instant::now();
        Ok(Source {
            file,
            deadlines,
            started: now,
            last_data: now,
            stop,
        })
    }

    fn stopped(e: SourceError) -> io::Error {
        let kind = match e {
            // Not `Interrupted`: readers retry that one.
            SourceError::Abandoned => io::ErrorKind::Other,
            _ => io::ErrorKind::TimedOut,
        };
        io::Error::new(kind, e)
    }
}

impl Read for Source {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        loop {
            if self.stop.load(Ordering::Acquire) {
                return Err(Self::stopped(SourceError::Abandoned));
            }
            match self.file.read(buf) {
                Ok(n) => {
                    self.last_data = Instant::now();
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                // A signal, not the source: try again (the stop flag first).
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            let now = Instant::now();
            let Some(total_left) = self.deadlines.total.checked_sub(now - self.started) else {
                return Err(Self::stopped(SourceError::TimedOut(self.deadlines.total)));
            };
            let Some(idle_left) = self.deadlines.idle.checked_sub(now - self.last_data) else {
                return Err(Self::stopped(SourceError::Stalled(self.deadlines.idle)));
            };
            let wait = SLICE.min(total_left).min(idle_left);
            // At most SLICE (100 ms): fits in the u16 of milliseconds; at least 1 ms, so that
            // a deadline a fraction of a millisecond away is not a busy loop.
            let ms = (wait.as_millis() as u16).max(1);
            let mut fds = [PollFd::new(self.file.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::from(ms)) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(io::Error::from(e)),
            }
        }
    }
}

/// Why a path cannot be read as an image.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("cannot open {path}")]
    Open {
        path: String,
        #[source]
        source: io::Error,
    },
    /// A FIFO, a device, a socket, a directory: a read could wait for ever or never end.
    #[error("{path} is not a regular file but {kind}")]
    NotRegular { path: String, kind: &'static str },
}

fn kind_of(t: std::fs::FileType) -> &'static str {
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a file"
    }
}

/// Opens `path` for reading when it is a regular file. `shown` is how errors name it (the
/// caller's text, quoted). The type is looked at before the open (a device node is not opened
/// at all) and again on the descriptor (the path may have been swapped in between); the open
/// is non-blocking, so that a FIFO put there meanwhile does not wait for a writer.
pub fn open_regular(path: &Path, shown: &str) -> Result<File, OpenError> {
    let open = |source| OpenError::Open {
        path: shown.to_string(),
        source,
    };
    let not_regular = |t| OpenError::NotRegular {
        path: shown.to_string(),
        kind: kind_of(t),
    };
    let before = std::fs::metadata(path).map_err(open)?;
    if !before.file_type().is_file() {
        return Err(not_regular(before.file_type()));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(open)?;
    let after = file.metadata().map_err(open)?;
    if !after.file_type().is_file() {
        return Err(not_regular(after.file_type()));
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn deadlines(idle_ms: u64, total_ms: u64) -> Deadlines {
        Deadlines {
            idle: Duration::from_millis(idle_ms),
            total: Duration::from_millis(total_ms),
        }
    }

    fn read_all(s: &mut Source) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        s.read_to_end(&mut out).map(|_| out)
    }

    #[test]
    fn a_pipe_is_read_to_its_end() {
        let (r, mut w) = std::io::pipe().unwrap();
        let feeder = std::thread::spawn(move || {
            for _ in 0..3 {
                w.write_all(b"abc").unwrap();
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let stop = Arc::new(AtomicBool::new(false));
        let mut s = Source::new(
            File::from(std::os::fd::OwnedFd::from(r)),
            deadlines(2000, 5000),
            stop,
        )
        .unwrap();
        assert_eq!(read_all(&mut s).unwrap(), b"abcabcabc");
        feeder.join().unwrap();
    }

    #[test]
    fn a_silent_open_pipe_stalls_within_the_idle_deadline() {
        let (r, _w) = std::io::pipe().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let mut s = Source::new(
            File::from(std::os::fd::OwnedFd::from(r)),
            deadlines(300, 5000),
            stop,
        )
        .unwrap();
        let t = Instant::now();
        let e = read_all(&mut s).unwrap_err();
        assert_eq!(
            SourceError::of(&e),
            Some(SourceError::Stalled(Duration::from_millis(300)))
        );
        // Not before the idle deadline; the error says which deadline ended it (an upper bound
        // on the time raced a loaded machine).
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn a_trickle_ends_at_the_total_deadline() {
        let (r, mut w) = std::io::pipe().unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let d = Arc::clone(&done);
        let feeder = std::thread::spawn(move || {
            while !d.load(Ordering::Relaxed) {
                if w.write_all(b"x").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let stop = Arc::new(AtomicBool::new(false));
        let mut s = Source::new(
            File::from(std::os::fd::OwnedFd::from(r)),
            deadlines(300, 700),
            stop,
        )
        .unwrap();
        let t = Instant::now();
        let e = read_all(&mut s).unwrap_err();
        done.store(true, Ordering::Relaxed);
        drop(s);
        feeder.join().unwrap();
        assert_eq!(
            SourceError::of(&e),
            Some(SourceError::TimedOut(Duration::from_millis(700)))
        );
        assert!(
            t.elapsed() >= Duration::from_millis(700),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn a_stop_ends_a_wait_within_a_slice() {
        let (r, _w) = std::io::pipe().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let mut s = Source::new(
            File::from(std::os::fd::OwnedFd::from(r)),
            deadlines(60_000, 60_000),
            Arc::clone(&stop),
        )
        .unwrap();
        let stopper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            stop.store(true, Ordering::Release);
        });
        let e = read_all(&mut s).unwrap_err();
        stopper.join().unwrap();
        // Abandoned, with both deadlines a minute away: the stop ended the wait (no bound on
        // how soon, which raced a loaded machine).
        assert_eq!(SourceError::of(&e), Some(SourceError::Abandoned));
    }

    #[test]
    fn only_regular_files_are_opened() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("f");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // Refused without opening it: an open of a FIFO without a writer would never return.
        let e = open_regular(&fifo, "\"f\"").unwrap_err();
        assert_eq!(e.to_string(), "\"f\" is not a regular file but a FIFO");
        let e = open_regular(dir.path(), "\"d\"").unwrap_err();
        assert_eq!(e.to_string(), "\"d\" is not a regular file but a directory");
        let e = open_regular(Path::new("/dev/null"), "\"n\"").unwrap_err();
        assert_eq!(
            e.to_string(),
            "\"n\" is not a regular file but a character device"
        );
        let e = open_regular(&dir.path().join("none"), "\"none\"").unwrap_err();
        assert!(matches!(e, OpenError::Open { .. }), "{e}");
        let file = dir.path().join("image");
        std::fs::write(&file, b"bits").unwrap();
        let mut f = open_regular(&file, "\"image\"").unwrap();
        let mut out = Vec::new();
        f.read_to_end(&mut out).unwrap();
        assert_eq!(out, b"bits");
    }
}
