//! Proxies the tests observe vfiod through: a device's and a task's state, uncached, with the
//! properties tests read (vfioctl's proxies in `vfiod::client` carry only what it needs).

use super::{addr, Harness};
use zbus::OwnedObjectPath;

#[zbus::proxy(
    interface = "org.vfiod.Vfiod1.Device",
    default_service = "org.vfiod.Vfiod1"
)]
pub trait Device {
    fn set_mode(
        &self,
        mode: &str,
        options: vfiod::dbus::wire::Dict,
    ) -> zbus::Result<OwnedObjectPath>;
    fn apply(&self) -> zbus::Result<OwnedObjectPath>;
    fn reset_task(&self) -> zbus::Result<()>;
    #[zbus(property)]
    fn task_state(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn current_task(&self) -> zbus::Result<OwnedObjectPath>;
    #[zbus(property)]
    fn last_result(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn num_vfs(&self) -> zbus::Result<u32>;
    #[zbus(property)]
    fn driver(&self) -> zbus::Result<String>;
}

#[zbus::proxy(
    interface = "org.vfiod.Vfiod1.Task",
    default_service = "org.vfiod.Vfiod1"
)]
pub trait Task {
    #[zbus(property)]
    fn state(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn kind(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn device(&self) -> zbus::Result<zbus::OwnedObjectPath>;
    #[zbus(property)]
    fn address(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn result(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn percent(&self) -> zbus::Result<u8>;
}

/// A device object's proxy, reading properties on each access.
pub async fn device<'a>(h: &'a Harness, a: &str) -> DeviceProxy<'a> {
    DeviceProxy::builder(&h.client)
        .path(format!(
            "/org/vfiod/Vfiod1/device/{}",
            addr(a).nodedev_name()
        ))
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await
        .unwrap()
}
