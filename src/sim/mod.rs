//! The simulation: a kernel that renders a real sysfs tree in a directory and reacts to writes
//! as Linux does ([`kernel`]), a private `dbus-daemon` ([`bus`]), and a recorded host served back
//! ([`replay`], `vfiod --simulate --replay`). `vfiod --simulate` and the tests run the whole daemon
//! on them, with no hardware and nothing written to the real `/sys`.

pub mod bus;
pub mod kernel;
pub mod replay;

use std::path::{Path, PathBuf};

/// The simulation's directory cannot be made private.
#[derive(Debug, thiserror::Error)]
pub enum PrivateDirError {
    #[error("cannot create {}", .dir.display())]
    Create {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{} belongs to uid {owner}, not to uid {uid} who runs this simulation: \
         name a directory of your own (or none, for a temporary one)",
        .dir.display()
    )]
    NotOwned { dir: PathBuf, owner: u32, uid: u32 },
    #[error("cannot make {} private (mode 0700)", .dir.display())]
    Chmod {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Makes `dir` (created if missing) the simulation's own: owned by the user who runs vfiod and
/// mode 0700, so that no other user reads the simulated tree and the store or reaches the bus
/// inside. A simulation gives nobody more than they have: it runs with its user's access, and
/// whoever could reach its bus would act with that access. Returns the mode `dir` had when it
/// let others in (it is then narrowed), else `None`.
pub fn make_private_dir(dir: &Path) -> Result<Option<u32>, PrivateDirError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let create = |source| PrivateDirError::Create {
        dir: dir.to_path_buf(),
        source,
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(create)?;
    let meta = std::fs::metadata(dir).map_err(create)?;
    let uid = nix::unistd::geteuid().as_raw();
    if meta.uid() != uid {
        return Err(PrivateDirError::NotOwned {
            dir: dir.to_path_buf(),
            owner: meta.uid(),
            uid,
        });
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 == 0 {
        return Ok(None);
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(|source| {
        PrivateDirError::Chmod {
            dir: dir.to_path_buf(),
            source,
        }
    })?;
    Ok(Some(mode))
}
