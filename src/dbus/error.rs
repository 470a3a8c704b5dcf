//! The one place engine errors become named D-Bus errors (`org.vfiod.Vfiod1.Error.*`). An error
//! that is the daemon's fault (a store that failed, a worker that died) is `Failed` with its
//! cause, never `InvalidArgument`: that name tells a caller to change its request.

use crate::claim::choice::Policy;
use crate::config::ConfigError;
use crate::engine::{EngineError, JobError};
use crate::model::image_source::SourceError;
use crate::store::StoreError;

/// Errors as clients see them. Messages carry the whole cause chain on one line.
#[derive(Debug, zbus::DBusError)]
#[zbus(prefix = "org.vfiod.Vfiod1.Error")]
pub enum Error {
    #[zbus(error)]
    ZBus(zbus::Error),
    NoSuchDevice(String),
    InvalidArgument(String),
    NotAuthorized(String),
    Busy(String),
    InUse(String),
    Protected(String),
    /// The configuration does not select the device: vfiod does not change it.
    NotManaged(String),
    NoDeviceAvailable(String),
    NoSuchClaim(String),
    NoSuchImage(String),
    /// libvirt did not attach the claim's devices; the claim was released.
    AttachFailed(String),
    /// The claim's devices did not leave the domain (libvirt or the guest refused, or the guest
    /// did not let go in time); the claim and its records stay.
    DetachFailed(String),
    HardwareFailed(String),
    /// A download did not give the image: the server's HTTP status, a deadline, a broken
    /// connection or TLS. Nothing was kept.
    DownloadFailed(String),
    /// The work was stopped at a caller's request (`Images.CancelDownload`), or because its
    /// caller went away; nothing was kept.
    Cancelled(String),
    /// A source the caller gave did not deliver in time: a passed descriptor that sent nothing
    /// within `[images] read_timeout_seconds`, or not all of it within `timeout_seconds`.
    /// Nothing was kept.
    TimedOut(String),
    InvalidConfig(String),
    /// The host has no IOMMU: nothing is bound to vfio-pci, claimed or attached. The message
    /// says how to turn it on.
    NoIommu(String),
    Failed(String),
}

/// A caller's text as an error quotes it (at most 64 characters): one rule for every layer.
pub use crate::model::text::quote;

impl From<zbus::fdo::Error> for Error {
    fn from(e: zbus::fdo::Error) -> Self {
        Error::ZBus(zbus::Error::from(e))
    }
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        match e {
            busy @ StoreError::Busy { .. } => Error::Busy(busy.to_string()),
            // A reset of a device that has nothing to reset: the request is wrong for the state.
            not @ StoreError::NotInError { .. } => Error::InvalidArgument(not.to_string()),
            // A claim for a named device that only a task holds: Busy, naming the task.
            StoreError::Unclaimable(u) if u.busy_task().is_some() => Error::Busy(u.to_string()),
            // A named device that policy refuses: the policy's own error, as Apply and SetMode
            // give it (the message still says how to change it).
            StoreError::Unclaimable(u) => match u.policy() {
                Some(Policy::Protected) => Error::Protected(u.to_string()),
                Some(Policy::NotManaged) => Error::NotManaged(u.to_string()),
                // Claiming a split PF whole is a mode change: the caller asks for a VF, or for
                // the mode change first.
                Some(Policy::Split) => Error::InvalidArgument(u.to_string()),
                None => Error::NoDeviceAvailable(u.to_string()),
            },
            // The database's own refusal of a double booking: another claim got there first.
            c @ StoreError::ClaimConflict(_) => Error::NoDeviceAvailable(c.to_string()),
            e @ (StoreError::NoSuchClaim(_) | StoreError::ClaimReleased(_)) => {
                Error::NoSuchClaim(e.to_string())
            }
            StoreError::ClaimStep(r) => {
                use crate::claim::lifecycle::Refusal;
                use crate::model::claim::ClaimState;
                let text = r.to_string();
                match r {
                    Refusal::Busy { .. } => Error::Busy(text),
                    // Its domain has (or may still have) the device.
                    Refusal::Wrong {
                        state: ClaimState::Attached | ClaimState::Detaching,
                        ..
                    } => Error::InUse(text),
                    Refusal::Wrong { .. } => Error::InvalidArgument(text),
                }
            }
            other => Error::Failed(format!("state store: {}", crate::error_chain(&other))),
        }
    }
}

impl From<JobError> for Error {
    fn from(e: JobError) -> Self {
        let chain = crate::error_chain(&e);
        match e {
            JobError::NoSuchDevice(_) => Error::NoSuchDevice(chain),
            JobError::NotManaged(_) => Error::NotManaged(chain),
            JobError::Protected { .. } => Error::Protected(chain),
            JobError::Invalid { .. } => Error::InvalidArgument(chain),
            JobError::Broken { .. } | JobError::Hardware { .. } => Error::HardwareFailed(chain),
            JobError::InUse { .. } => Error::InUse(chain),
            JobError::Cleaning { .. } => Error::Busy(chain),
            JobError::NoIommu { .. } => Error::NoIommu(chain),
            JobError::Unavailable { .. }
            | JobError::Libvirt { .. }
            | JobError::Plan { .. }
            | JobError::Internal(_) => Error::Failed(chain),
            JobError::Store(s) => s.into(),
        }
    }
}

impl From<crate::engine::ClaimError> for Error {
    fn from(e: crate::engine::ClaimError) -> Self {
        match e {
            crate::engine::ClaimError::Store(s) => s.into(),
            crate::engine::ClaimError::Engine(e) => e.into(),
            e @ crate::engine::ClaimError::NoIommu(_) => Error::NoIommu(crate::error_chain(&e)),
        }
    }
}

impl From<crate::engine::AttachError> for Error {
    fn from(e: crate::engine::AttachError) -> Self {
        use crate::engine::AttachError as A;
        match e {
            A::Refused(j) => j.into(),
            A::AttachFailed(m) => Error::AttachFailed(m),
            A::DetachFailed(m) => Error::DetachFailed(m),
        }
    }
}

impl From<crate::store::ImageError> for Error {
    fn from(e: crate::store::ImageError) -> Self {
        use crate::store::ImageError as I;
        let chain = crate::error_chain(&e);
        match e {
            I::NoSuchImage(_) => Error::NoSuchImage(chain),
            I::Store(s) => s.into(),
            I::Io { .. } => Error::Failed(chain),
            I::Source(SourceError::Abandoned) => Error::Cancelled(chain),
            I::Source(SourceError::Stalled(_) | SourceError::TimedOut(_)) => Error::TimedOut(chain),
            I::InvalidName(_)
            | I::Exists(_)
            | I::BadDigest(_)
            | I::Checksum { .. }
            | I::TooLarge
            | I::Header(_)
            | I::Declared(_) => Error::InvalidArgument(chain),
        }
    }
}

impl From<crate::engine::PooledError> for Error {
    fn from(e: crate::engine::PooledError) -> Self {
        use crate::engine::PooledError as P;
        use crate::pool::client::PoolError;
        use crate::pool::protocol::ErrorCode;
        let chain = crate::error_chain(&e);
        match e {
            P::NoSuchPool(_) | P::Wrong { .. } => Error::InvalidArgument(chain),
            P::NoSuchClaim(_) => Error::NoSuchClaim(chain),
            P::Store(s) => s.into(),
            P::Engine(e) => e.into(),
            P::Pool { source, .. } => match (&source, source.error_code()) {
                (PoolError::Refused { .. }, Some(ErrorCode::DeviceTaken | ErrorCode::Busy)) => {
                    Error::NoDeviceAvailable(chain)
                }
                (PoolError::Refused { .. } | PoolError::NotFound, _) => {
                    Error::InvalidArgument(chain)
                }
                _ => Error::Failed(chain),
            },
        }
    }
}

impl From<crate::host::download::DownloadError> for Error {
    fn from(e: crate::host::download::DownloadError) -> Self {
        use crate::host::download::DownloadError as D;
        let chain = crate::error_chain(&e);
        match e {
            D::BadUrl { .. } | D::Refused { .. } | D::TooLarge { .. } => {
                Error::InvalidArgument(chain)
            }
            D::CaFile { .. } => Error::InvalidConfig(chain),
            D::Client(_) | D::Write { .. } => Error::Failed(chain),
            D::Status { .. } | D::Timeout { .. } | D::Transfer { .. } => {
                Error::DownloadFailed(chain)
            }
        }
    }
}

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Self {
        Error::InvalidConfig(crate::error_chain(&e))
    }
}

impl From<crate::mode::planner::ModeError> for Error {
    fn from(e: crate::mode::planner::ModeError) -> Self {
        use crate::mode::planner::ModeError as M;
        match e {
            M::NoSuchDevice(a) => Error::NoSuchDevice(format!("no PCI function {a} on this host")),
            M::Store(s) => s.into(),
            other @ (M::Snapshot(_) | M::Scan(_)) => {
                Error::HardwareFailed(crate::error_chain(&other))
            }
            other @ M::Plan { .. } => Error::Failed(crate::error_chain(&other)),
        }
    }
}

impl From<EngineError> for Error {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Config(c) => c.into(),
            EngineError::Store(s) => s.into(),
            other @ EngineError::Sysfs(_) => Error::HardwareFailed(crate::error_chain(&other)),
            other @ EngineError::Internal(_) => Error::Failed(crate::error_chain(&other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_argument_is_quoted_short() {
        assert_eq!(quote("vfio"), "\"vfio\"");
        let long = "x".repeat(1 << 20);
        let q = quote(&long);
        assert!(q.len() < 100, "{q}");
        assert!(q.ends_with("(1048576 characters)"), "{q}");
    }
}
