//! What the bus shows, in memory: every device with its task state, and the tasks that have
//! objects. The publisher ([`super::publisher`]) is its only writer, fed by the engine's events;
//! objects read it in their property getters.
//!
//! Why a read model rather than objects that ask the store: a property read runs on the async
//! threads, where SQLite must not block. And why not state inside each object: changing an
//! object's state means taking its interface's write lock, and a writer queued on one object
//! while a method of that object waits for the object server (to add a task object) and
//! `GetManagedObjects` waits for that object is how the whole service once deadlocked. Here the
//! interface locks are only ever taken to read, and this lock is never held across an await.

use crate::engine::{DeviceTasks, DeviceView};
use crate::model::device::{Device, State};
use crate::model::pci::PciAddress;
use crate::store::{Counts, TaskRecord};
use std::collections::{BTreeMap, HashMap};
use std::sync::RwLock;

/// One device as the bus shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceEntry {
    pub device: Device,
    /// The task that holds it (prepare, running, or error until reset): its own or one that
    /// covers it.
    pub task: Option<TaskRecord>,
    /// Its most recent finished task.
    pub last: Option<TaskRecord>,
}

#[derive(Default)]
struct Inner {
    devices: BTreeMap<PciAddress, DeviceEntry>,
    tasks: HashMap<i64, TaskRecord>,
}

#[derive(Default)]
pub struct View {
    inner: RwLock<Inner>,
}

impl View {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    pub fn device(&self, address: PciAddress) -> Option<DeviceEntry> {
        self.read().devices.get(&address).cloned()
    }

    pub fn task(&self, id: i64) -> Option<TaskRecord> {
        self.read().tasks.get(&id).cloned()
    }

    pub fn counts(&self) -> Counts {
        let inner = self.read();
        let mut c = Counts::default();
        for e in inner.devices.values() {
            c.total += 1;
            match e.device.state {
                State::Usable => c.usable += 1,
                State::Protected => c.protected += 1,
                State::Broken => c.broken += 1,
            }
        }
        c
    }

    /// Replaces (or adds) a device; returns what it was.
    pub fn put_device(&self, view: DeviceView) -> Option<DeviceEntry> {
        let entry = DeviceEntry {
            device: view.device,
            task: view.active,
            last: view.last,
        };
        self.write().devices.insert(entry.device.address, entry)
    }

    /// The device's record changed; its task state stays. Returns the old entry and the new.
    pub fn update_device(&self, device: Device) -> Option<(DeviceEntry, DeviceEntry)> {
        let mut inner = self.write();
        let entry = inner.devices.get_mut(&device.address)?;
        let old = entry.clone();
        entry.device = device;
        Some((old, entry.clone()))
    }

    pub fn remove_device(&self, address: PciAddress) -> Option<DeviceEntry> {
        self.write().devices.remove(&address)
    }

    /// A device's task state changed; returns the old entry and the new (None: not shown).
    pub fn set_device_tasks(&self, t: DeviceTasks) -> Option<(DeviceEntry, DeviceEntry)> {
        let mut inner = self.write();
        let entry = inner.devices.get_mut(&t.address)?;
        let old = entry.clone();
        entry.task = t.active;
        entry.last = t.last;
        Some((old, entry.clone()))
    }

    /// Replaces (or adds) a task; returns what it was.
    pub fn put_task(&self, task: TaskRecord) -> Option<TaskRecord> {
        self.write().tasks.insert(task.id, task)
    }
}
