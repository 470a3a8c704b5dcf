//! `org.vfiod.Vfiod1.Task`: one object per task at `/org/vfiod/Vfiod1/task/N`, its state kept
//! in step with the store and announced with PropertiesChanged.

use crate::store::TaskRecord;
use std::collections::HashMap;
use zbus::{interface, OwnedVariant};

pub const INTERFACE: &str = "org.vfiod.Vfiod1.Task";

pub fn task_path(id: i64) -> zbus::OwnedObjectPath {
    zbus::OwnedObjectPath::try_from(format!("{}/task/{id}", super::ROOT_PATH))
        .expect("valid object path")
}

/// The D-Bus face of one task: its id and the view it reads from.
pub struct TaskObject {
    pub id: i64,
    pub objects: super::Objects,
}

impl TaskObject {
    fn task(&self) -> zbus::fdo::Result<TaskRecord> {
        self.objects
            .view
            .task(self.id)
            .ok_or_else(|| zbus::fdo::Error::UnknownObject(format!("no task {}", self.id)))
    }
}

pub fn properties(t: &TaskRecord) -> Vec<(&'static str, OwnedVariant)> {
    use super::variant as v;
    vec![
        ("Kind", v(t.kind.as_str())),
        ("State", v(t.state.as_str())),
        ("Step", v(t.step.clone())),
        ("Percent", v(t.percent)),
        ("Started", v(t.started_ms.unwrap_or(0))),
        ("Finished", v(t.finished_ms.unwrap_or(0))),
        ("Result", v(t.message.clone())),
        ("ResetBy", v(t.reset_by.clone().unwrap_or_default())),
    ]
}

pub fn changed_properties(
    old: &TaskRecord,
    new: &TaskRecord,
) -> HashMap<&'static str, OwnedVariant> {
    super::changed(properties(old), properties(new))
}

#[interface(name = "org.vfiod.Vfiod1.Task")]
impl TaskObject {
    #[zbus(property(emits_changed_signal = "const"))]
    fn id(&self) -> zbus::fdo::Result<i64> {
        let t = self.task()?;
        Ok(t.id)
    }
    /// check, split, restore, resplit, rebind, bind, unbind (program, verify, migrate to come).
    /// A mode task learns its kind while it prepares, so it may change once.
    #[zbus(property)]
    fn kind(&self) -> zbus::fdo::Result<String> {
        let t = self.task()?;
        Ok(t.kind.as_str().into())
    }
    /// The device's object (`/org/vfiod/Vfiod1/device/pci_...`): a device is always an object
    /// path, as `Claim.Device` is.
    #[zbus(property(emits_changed_signal = "const"))]
    fn device(&self) -> zbus::fdo::Result<zbus::OwnedObjectPath> {
        let t = self.task()?;
        Ok(super::device_path(t.address))
    }
    /// The device's PCI address.
    #[zbus(property(emits_changed_signal = "const"))]
    fn address(&self) -> zbus::fdo::Result<String> {
        let t = self.task()?;
        Ok(t.address.to_string())
    }
    /// Deprecated: `Device`, which is now the object path too.
    #[zbus(property(emits_changed_signal = "const"))]
    fn device_path(&self) -> zbus::fdo::Result<zbus::OwnedObjectPath> {
        let t = self.task()?;
        Ok(super::device_path(t.address))
    }
    /// prepare, running, success or error.
    #[zbus(property)]
    fn state(&self) -> zbus::fdo::Result<String> {
        let t = self.task()?;
        Ok(t.state.as_str().into())
    }
    #[zbus(property)]
    fn step(&self) -> zbus::fdo::Result<String> {
        let t = self.task()?;
        Ok(t.step.clone())
    }
    #[zbus(property)]
    fn percent(&self) -> zbus::fdo::Result<u8> {
        let t = self.task()?;
        Ok(t.percent)
    }
    #[zbus(property(emits_changed_signal = "const"))]
    fn parameters(&self) -> zbus::fdo::Result<super::wire::Dict> {
        let t = self.task()?;
        Ok(super::wire::task_parameters(&t))
    }
    #[zbus(property(emits_changed_signal = "const"))]
    fn requested_by(&self) -> zbus::fdo::Result<String> {
        let t = self.task()?;
        Ok(t.requested_by.clone())
    }
    /// Unix milliseconds; 0 when not yet.
    #[zbus(property(emits_changed_signal = "const"))]
    fn created(&self) -> zbus::fdo::Result<i64> {
        let t = self.task()?;
        Ok(t.created_ms)
    }
    #[zbus(property)]
    fn started(&self) -> zbus::fdo::Result<i64> {
        let t = self.task()?;
        Ok(t.started_ms.unwrap_or(0))
    }
    #[zbus(property)]
    fn finished(&self) -> zbus::fdo::Result<i64> {
        let t = self.task()?;
        Ok(t.finished_ms.unwrap_or(0))
    }
    /// What it achieved, or why it failed.
    #[zbus(property)]
    fn result(&self) -> zbus::fdo::Result<String> {
        let t = self.task()?;
        Ok(t.message.clone())
    }
    /// Who force-reset it from error ("" if nobody).
    #[zbus(property)]
    fn reset_by(&self) -> zbus::fdo::Result<String> {
        let t = self.task()?;
        Ok(t.reset_by.clone().unwrap_or_default())
    }
}
