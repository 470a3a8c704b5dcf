//! Stage 1: finding and reading the configuration files. The only module of `config` that
//! touches the file system.
//!
//! Reading configuration must neither block nor starve the daemon: a reload runs while the
//! daemon serves, and a FIFO named `vfiod.toml` would block `read` until someone writes to it
//! (and SIGTERM waits behind it). So a file is read only when it is a regular file (symlinks to
//! one are fine), opened without blocking, judged by `fstat` of the opened descriptor, and read
//! up to a size bound. The number of drop-ins and the bytes of all files together are bounded
//! too.

use super::error::{file_error, ConfigError, FileRefusal};
use std::fs::{self, File, Metadata, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Largest file accepted: a real configuration is a few kilobytes.
pub const MAX_FILE_BYTES: u64 = 1 << 20;
/// Most `*.toml` drop-ins accepted in the drop-in directory.
pub const MAX_DROPINS: usize = 128;
/// Largest sum of all files read at one load, so that the bound on memory does not grow with
/// the number of drop-ins.
pub const MAX_TOTAL_BYTES: u64 = 4 << 20;

/// One file's bytes and where they came from.
#[derive(Debug)]
pub(crate) struct SourceFile {
    pub path: PathBuf,
    pub bytes: Vec<u8>,
}

/// The main file (when present, or `main_required`) then the drop-ins, in the order they apply.
pub(crate) fn read_all(
    main: &Path,
    dropin_dir: Option<&Path>,
    main_required: bool,
) -> Result<Vec<SourceFile>, ConfigError> {
    let mut files = Vec::new();
    let mut total = 0;
    match read_regular(main) {
        Ok(bytes) => {
            total += bytes.len() as u64;
            files.push(SourceFile {
                path: main.to_path_buf(),
                bytes,
            });
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound && !main_required => {
            tracing::debug!(file = %main.display(), "no config file, using defaults");
        }
        Err(e) => return Err(file_error(main, "cannot read config file", e)),
    }
    if let Some(dir) = dropin_dir {
        for path in dropin_paths(dir)? {
            let bytes = read_regular(&path)
                .map_err(|e| file_error(&path, "cannot read drop-in file", e))?;
            total += bytes.len() as u64;
            if total > MAX_TOTAL_BYTES {
                let refusal = FileRefusal::TotalTooLarge {
                    limit: MAX_TOTAL_BYTES,
                };
                return Err(file_error(
                    &path,
                    "cannot read drop-in file",
                    refusal.into_io(),
                ));
            }
            files.push(SourceFile { path, bytes });
        }
    }
    Ok(files)
}

/// The `*.toml` files of the drop-in directory in byte order of their names, like `LC_ALL=C ls`.
/// Hidden files are skipped as a shell glob would, so editor and package-manager leftovers
/// (`.foo.toml.swp`, `foo.toml.rpmnew`) never take effect. What each name is (file, FIFO,
/// directory) is judged when it is read, so that a non-file named `*.toml` is an error rather
/// than silently skipped.
fn dropin_paths(dir: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(file_error(dir, "cannot read drop-in directory", e)),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| file_error(dir, "cannot read drop-in directory", e))?;
        let name = entry.file_name();
        let hidden = name.as_encoded_bytes().starts_with(b".");
        if !hidden
            && Path::new(&name)
                .extension()
                .is_some_and(|ext| ext == "toml")
        {
            names.push(name);
            if names.len() > MAX_DROPINS {
                return Err(ConfigError::File {
                    file: dir.to_path_buf(),
                    message: format!("more than {MAX_DROPINS} drop-in files (*.toml)"),
                    source: None,
                });
            }
        }
    }
    names.sort();
    Ok(names.into_iter().map(|name| dir.join(name)).collect())
}

/// The bytes of a regular file of at most [`MAX_FILE_BYTES`]; anything else is refused with a
/// [`FileRefusal`] inside the `io::Error`.
fn read_regular(path: &Path) -> io::Result<Vec<u8>> {
    // Judge the name before opening it: opening a device node can have effects of its own (a
    // watchdog arms, a tape rewinds), so only what looks like a regular file is opened at all.
    ensure_regular(&fs::metadata(path)?)?;
    // O_NONBLOCK: if the name was swapped for a FIFO since, open returns at once instead of
    // waiting for a writer. O_NOCTTY: a terminal never becomes our controlling one.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    // What was opened is what counts (the name may have changed between stat and open).
    let metadata = file.metadata()?;
    ensure_regular(&metadata)?;
    read_bounded(file, metadata.len())
}

fn read_bounded(file: File, announced: u64) -> io::Result<Vec<u8>> {
    let too_large = || {
        FileRefusal::TooLarge {
            limit: MAX_FILE_BYTES,
        }
        .into_io()
    };
    if announced > MAX_FILE_BYTES {
        return Err(too_large());
    }
    // One byte more than allowed tells a file that grew past the bound since fstat.
    let mut bytes = Vec::with_capacity(announced as usize);
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(too_large());
    }
    Ok(bytes)
}

fn ensure_regular(metadata: &Metadata) -> io::Result<()> {
    let file_type = metadata.file_type();
    if file_type.is_file() {
        return Ok(());
    }
    let what = if file_type.is_dir() {
        "a directory"
    } else if file_type.is_fifo() {
        "a FIFO (named pipe)"
    } else if file_type.is_socket() {
        "a socket"
    } else if file_type.is_char_device() {
        "a character device"
    } else if file_type.is_block_device() {
        "a block device"
    } else {
        "of an unknown type"
    };
    Err(FileRefusal::NotRegular { what }.into_io())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_chain;

    fn refusal(e: &io::Error) -> Option<&FileRefusal> {
        e.get_ref().and_then(|inner| inner.downcast_ref())
    }

    #[test]
    fn regular_files_and_links_to_them_are_read() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("a.toml");
        fs::write(&file, "x = 1\n").unwrap();
        let link = tmp.path().join("link.toml");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert_eq!(read_regular(&file).unwrap(), b"x = 1\n");
        assert_eq!(read_regular(&link).unwrap(), b"x = 1\n");
    }

    #[test]
    fn directories_fifos_and_sockets_are_refused_by_what_they_are() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("d.toml");
        fs::create_dir(&dir).unwrap();
        let fifo = tmp.path().join("f.toml");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let socket = tmp.path().join("s.toml");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        for (path, what) in [
            (&dir, "a directory"),
            (&fifo, "a FIFO (named pipe)"),
            (&socket, "a socket"),
            (&PathBuf::from("/dev/null"), "a character device"),
        ] {
            let e = read_regular(path).unwrap_err();
            assert!(
                matches!(refusal(&e), Some(FileRefusal::NotRegular { what: w }) if *w == what),
                "{}: {e:?}",
                path.display()
            );
            assert_eq!(e.to_string(), format!("is {what}, not a regular file"));
        }
    }

    #[test]
    fn a_file_over_the_bound_is_refused_and_one_at_the_bound_is_read() {
        let tmp = tempfile::tempdir().unwrap();
        let at = tmp.path().join("at.toml");
        fs::write(&at, vec![b'#'; MAX_FILE_BYTES as usize]).unwrap();
        assert_eq!(read_regular(&at).unwrap().len() as u64, MAX_FILE_BYTES);
        let over = tmp.path().join("over.toml");
        fs::write(&over, vec![b'#'; MAX_FILE_BYTES as usize + 1]).unwrap();
        let e = read_regular(&over).unwrap_err();
        assert!(
            matches!(refusal(&e), Some(FileRefusal::TooLarge { .. })),
            "{e:?}"
        );
        // A file that grows after fstat is caught by the extra byte read.
        let file = File::open(&over).unwrap();
        let e = read_bounded(file, 10).unwrap_err();
        assert!(
            matches!(refusal(&e), Some(FileRefusal::TooLarge { .. })),
            "{e:?}"
        );
    }

    #[test]
    fn too_many_dropins_or_bytes_in_all_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("conf.d");
        fs::create_dir(&dir).unwrap();
        for i in 0..=MAX_DROPINS {
            fs::write(dir.join(format!("{i:04}.toml")), "").unwrap();
        }
        let main = tmp.path().join("none.toml");
        let err = read_all(&main, Some(&dir), false).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "{}: more than {MAX_DROPINS} drop-in files (*.toml)",
                dir.display()
            )
        );

        fs::remove_dir_all(&dir).unwrap();
        fs::create_dir(&dir).unwrap();
        let big = vec![b'#'; MAX_FILE_BYTES as usize];
        let files = (MAX_TOTAL_BYTES / MAX_FILE_BYTES) as usize;
        for i in 0..=files {
            fs::write(dir.join(format!("{i:02}.toml")), &big).unwrap();
        }
        let err = read_all(&main, Some(&dir), false).unwrap_err();
        let last = dir.join(format!("{files:02}.toml"));
        assert_eq!(
            error_chain(&err),
            format!(
                "{}: cannot read drop-in file: the configuration files together are larger \
                 than {MAX_TOTAL_BYTES} bytes",
                last.display()
            )
        );
    }
}
