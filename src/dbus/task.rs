//! `org.vfiod.Vfiod1.Task`: one object per task at `/org/vfiod/Vfiod1/task/N`, its state kept
//! in step with the store and announced with PropertiesChanged.

use crate::store::TaskRecord;
use std::collections::HashMap;
use zbus::{interface, OwnedVariant, Variant};

pub const INTERFACE: &str = "org.vfiod.Vfiod1.Task";

pub fn task_path(id: i64) -> zbus::OwnedObjectPath {
    zbus::OwnedObjectPath::try_from(format!("{}/task/{id}", super::ROOT_PATH))
        .expect("valid object path")
}

pub struct TaskObject {
    pub task: TaskRecord,
}

pub fn properties(t: &TaskRecord) -> Vec<(&'static str, OwnedVariant)> {
    fn v<'a, T: Into<Variant<'a>>>(x: T) -> OwnedVariant {
        OwnedVariant::try_from(x.into()).expect("plain values convert")
    }
    vec![
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
    let before: HashMap<_, _> = properties(old).into_iter().collect();
    properties(new)
        .into_iter()
        .filter(|(k, v)| before.get(k) != Some(v))
        .collect()
}

#[interface(name = "org.vfiod.Vfiod1.Task")]
impl TaskObject {
    #[zbus(property(emits_changed_signal = "const"))]
    fn id(&self) -> i64 {
        self.task.id
    }
    /// split, restore, resplit, rebind, bind, check.
    #[zbus(property(emits_changed_signal = "const"))]
    fn kind(&self) -> String {
        self.task.kind.clone()
    }
    /// The device's PCI address.
    #[zbus(property(emits_changed_signal = "const"))]
    fn device(&self) -> String {
        self.task.address.to_string()
    }
    #[zbus(property(emits_changed_signal = "const"))]
    fn device_path(&self) -> zbus::OwnedObjectPath {
        super::device_path(self.task.address)
    }
    /// prepare, running, success or error.
    #[zbus(property)]
    fn state(&self) -> String {
        self.task.state.as_str().into()
    }
    #[zbus(property)]
    fn step(&self) -> String {
        self.task.step.clone()
    }
    #[zbus(property)]
    fn percent(&self) -> u8 {
        self.task.percent
    }
    #[zbus(property(emits_changed_signal = "const"))]
    fn parameters(&self) -> String {
        self.task.params.clone()
    }
    #[zbus(property(emits_changed_signal = "const"))]
    fn requested_by(&self) -> String {
        self.task.requested_by.clone()
    }
    /// Unix milliseconds; 0 when not yet.
    #[zbus(property(emits_changed_signal = "const"))]
    fn created(&self) -> i64 {
        self.task.created_ms
    }
    #[zbus(property)]
    fn started(&self) -> i64 {
        self.task.started_ms.unwrap_or(0)
    }
    #[zbus(property)]
    fn finished(&self) -> i64 {
        self.task.finished_ms.unwrap_or(0)
    }
    /// What it achieved, or why it failed.
    #[zbus(property)]
    fn result(&self) -> String {
        self.task.message.clone()
    }
    /// Who force-reset it from error ("" if nobody).
    #[zbus(property)]
    fn reset_by(&self) -> String {
        self.task.reset_by.clone().unwrap_or_default()
    }
}
