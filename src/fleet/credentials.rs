//! The database credentials: a libpq connection string (`host=... user=... password=...
//! dbname=...` or `postgresql://...`) read from a file that only its owner may read. Never from
//! the configuration or the command line, where other users (`ps`, a world-readable
//! vfiod.toml) would see the password.

use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

/// The longest credentials file: a connection string is a line.
const MAX_BYTES: u64 = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error("cannot read the fleet credentials file {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("refusing the fleet credentials file {path}: {reason}")]
    Refused { path: String, reason: String },
    #[error("the fleet credentials file {path} holds no valid connection string")]
    Invalid {
        path: String,
        #[source]
        source: tokio_postgres::Error,
    },
}

/// Why a file of this type and mode must not hold credentials; `None` when it may.
pub fn refusal(is_file: bool, mode: u32) -> Option<String> {
    if !is_file {
        return Some("not a regular file".into());
    }
    if mode & 0o077 != 0 {
        return Some(format!(
            "its mode {:04o} lets group or others read or write it (chmod 0600)",
            mode & 0o7777
        ));
    }
    None
}

/// Reads and checks the file: a regular file, readable by its owner only, whose first line
/// that is neither empty nor a `#` comment is the connection string.
pub fn read(path: &Path) -> Result<tokio_postgres::Config, CredentialsError> {
    let shown = path.display().to_string();
    let read_err = |source| CredentialsError::Read {
        path: shown.clone(),
        source,
    };
    // The checks are made on the file opened, not on the path (no swap between check and read).
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(read_err)?;
    let meta = file.metadata().map_err(read_err)?;
    if let Some(reason) = refusal(meta.is_file(), meta.permissions().mode()) {
        return Err(CredentialsError::Refused {
            path: shown,
            reason,
        });
    }
    if meta.size() > MAX_BYTES {
        return Err(CredentialsError::Refused {
            path: shown,
            reason: format!("larger than {MAX_BYTES} bytes"),
        });
    }
    let mut text = String::new();
    file.take(MAX_BYTES)
        .read_to_string(&mut text)
        .map_err(read_err)?;
    parse(&text).map_err(|source| CredentialsError::Invalid {
        path: shown,
        source,
    })
}

use std::os::unix::fs::OpenOptionsExt;

/// The connection string in a credentials file's text.
pub fn parse(text: &str) -> Result<tokio_postgres::Config, tokio_postgres::Error> {
    let line = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .unwrap_or("");
    let mut config: tokio_postgres::Config = line.parse()?;
    if config.get_application_name().is_none() {
        config.application_name("vfiod");
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_owner_only_regular_file_may_hold_credentials() {
        for (is_file, mode, refused) in [
            (true, 0o100600, false),
            (true, 0o100400, false),
            (true, 0o100700, false),
            (true, 0o100640, true),
            (true, 0o100604, true),
            (true, 0o100620, true),
            (false, 0o040700, true),
        ] {
            assert_eq!(refusal(is_file, mode).is_some(), refused, "{mode:o}");
        }
    }

    #[test]
    fn files_are_checked_when_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("fleet.conn");
        std::fs::write(
            &p,
            "# the fleet\n\nhost=/run/pg port=5433 user=h1 dbname=fleet\n",
        )
        .unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read(&p).unwrap_err().to_string();
        assert!(e.contains("mode 0644") && e.contains("chmod 0600"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let c = read(&p).unwrap();
        assert_eq!(c.get_user(), Some("h1"));
        assert_eq!(c.get_dbname(), Some("fleet"));
        assert_eq!(c.get_application_name(), Some("vfiod"));
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert!(read(&link).is_err(), "a symlink is not followed");
        std::fs::write(&p, "host=x port=notaport\n").unwrap();
        assert!(matches!(read(&p), Err(CredentialsError::Invalid { .. })));
    }
}
