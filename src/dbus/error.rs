//! The one place engine errors become named D-Bus errors (`org.vfiod.Vfiod1.Error.*`).

use crate::config::ConfigError;
use crate::daemon::EngineError;
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
    Protected(String),
    NoDeviceAvailable(String),
    HardwareFailed(String),
    InvalidConfig(String),
    Failed(String),
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        Error::Failed(format!("state store: {}", crate::error_chain(&e)))
    }
}

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Self {
        Error::InvalidConfig(crate::error_chain(&e))
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
