//! The one place engine errors become named D-Bus errors (`org.vfiod.Vfiod1.Error.*`).

use crate::config::ConfigError;
use crate::engine::EngineError;
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
    NoDeviceAvailable(String),
    HardwareFailed(String),
    InvalidConfig(String),
    Failed(String),
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        match e {
            busy @ StoreError::Busy { .. } => Error::Busy(busy.to_string()),
            not @ StoreError::NotInError { .. } => Error::InvalidArgument(not.to_string()),
            other => Error::Failed(format!("state store: {}", crate::error_chain(&other))),
        }
    }
}

impl From<crate::engine::tasks::TaskError> for Error {
    fn from(e: crate::engine::tasks::TaskError) -> Self {
        use crate::engine::tasks::TaskError as T;
        match e {
            T::NoSuchDevice(a) => Error::NoSuchDevice(format!("no PCI function {a} on this host")),
            p @ T::Protected { .. } => Error::Protected(p.to_string()),
            n @ T::NotManaged(_) => Error::Protected(n.to_string()),
            r @ T::Refused { .. } => Error::InvalidArgument(r.to_string()),
            u @ T::InUse { .. } => Error::InUse(u.to_string()),
            l @ T::Libvirt { .. } => Error::Failed(crate::error_chain(&l)),
            T::Store(s) => s.into(),
            T::Mode(m) => m.into(),
        }
    }
}

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Self {
        Error::InvalidConfig(crate::error_chain(&e))
    }
}

impl From<crate::modes::planner::ModeError> for Error {
    fn from(e: crate::modes::planner::ModeError) -> Self {
        use crate::modes::planner::ModeError as M;
        match e {
            M::NoSuchDevice(a) => Error::NoSuchDevice(format!("no PCI function {a} on this host")),
            M::Store(s) => s.into(),
            other @ M::Snapshot(_) => Error::HardwareFailed(crate::error_chain(&other)),
            other @ M::Plan { .. } => Error::InvalidArgument(crate::error_chain(&other)),
        }
    }
}

impl From<EngineError> for Error {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Config(c) => c.into(),
            EngineError::Store(s) => s.into(),
            other @ EngineError::Sysfs(_) => Error::HardwareFailed(crate::error_chain(&other)),
            other @ EngineError::Join(_) => Error::Failed(crate::error_chain(&other)),
        }
    }
}
