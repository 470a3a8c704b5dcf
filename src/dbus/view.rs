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
use crate::store::{ClaimRecord, Counts, TaskRecord};
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
    /// How its resets have gone, when it was ever cleaned.
    pub health: Option<crate::model::clean::ResetHealth>,
}

#[derive(Default)]
struct Inner {
    devices: BTreeMap<PciAddress, DeviceEntry>,
    tasks: HashMap<i64, TaskRecord>,
    /// Claims with objects: the active ones, and a released one until its object is gone.
    claims: BTreeMap<i64, ClaimRecord>,
    /// Function -> the active claim that holds it.
    holders: HashMap<PciAddress, i64>,
    /// Pooled claims with objects: the standing ones, and an ended one until its object goes.
    pooled: BTreeMap<i64, crate::model::pool::PooledClaim>,
}

/// `e` with its task brought up to date from `inner.tasks` (see [`View::device`]).
fn shown(inner: &Inner, e: &DeviceEntry) -> DeviceEntry {
    let mut e = e.clone();
    let Some(latest) = e.task.as_ref().and_then(|t| inner.tasks.get(&t.id)) else {
        return e;
    };
    if latest.is_active() {
        e.task = Some(latest.clone());
    } else {
        if latest.state.is_final() && e.last.as_ref().is_none_or(|l| l.id <= latest.id) {
            e.last = Some(latest.clone());
        }
        e.task = None;
    }
    e
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

    /// A device as the bus shows it: with the newest record of the task that holds it, and idle
    /// once that task no longer holds it (finished, or reset), whether or not an event said so
    /// for this device. A task's own record is the one truth about its state, so a device can
    /// never show a task as running after the task ended.
    pub fn device(&self, address: PciAddress) -> Option<DeviceEntry> {
        let inner = self.read();
        inner.devices.get(&address).map(|e| shown(&inner, e))
    }

    /// The devices whose entry names task `id` as the one that holds them.
    pub fn showing_task(&self, id: i64) -> Vec<PciAddress> {
        self.read()
            .devices
            .values()
            .filter(|e| e.task.as_ref().is_some_and(|t| t.id == id))
            .map(|e| e.device.address)
            .collect()
    }

    pub fn task(&self, id: i64) -> Option<TaskRecord> {
        self.read().tasks.get(&id).cloned()
    }

    pub fn claim(&self, id: i64) -> Option<ClaimRecord> {
        self.read().claims.get(&id).cloned()
    }

    /// The ids of the claims that hold their functions, oldest first.
    pub fn active_claims(&self) -> Vec<i64> {
        self.read()
            .claims
            .values()
            .filter(|c| c.state.holds())
            .map(|c| c.id)
            .collect()
    }

    /// The active claim that holds `address`.
    pub fn holder(&self, address: PciAddress) -> Option<i64> {
        self.read().holders.get(&address).copied()
    }

    /// Replaces (or adds) a claim, and who holds its functions; returns what it was. A released
    /// claim stays until [`View::forget_claim`], so that its object still reads while it goes.
    pub fn put_claim(&self, claim: ClaimRecord) -> Option<ClaimRecord> {
        let mut inner = self.write();
        for a in &claim.functions {
            if claim.state.holds() {
                inner.holders.insert(*a, claim.id);
            } else if inner.holders.get(a) == Some(&claim.id) {
                inner.holders.remove(a);
            }
        }
        inner.claims.insert(claim.id, claim)
    }

    pub fn pooled(&self, id: i64) -> Option<crate::model::pool::PooledClaim> {
        self.read().pooled.get(&id).cloned()
    }

    /// Replaces (or adds) a pooled claim; returns what it was.
    pub fn put_pooled(
        &self,
        claim: crate::model::pool::PooledClaim,
    ) -> Option<crate::model::pool::PooledClaim> {
        self.write().pooled.insert(claim.id, claim)
    }

    /// Drops a pooled claim whose object is no longer exported.
    pub fn forget_pooled(&self, id: i64) {
        self.write().pooled.remove(&id);
    }

    /// Drops a claim whose object is no longer exported.
    pub fn forget_claim(&self, id: i64) {
        let mut inner = self.write();
        if let Some(c) = inner.claims.remove(&id) {
            for a in &c.functions {
                if inner.holders.get(a) == Some(&id) {
                    inner.holders.remove(a);
                }
            }
        }
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
                State::Cleaning => c.cleaning += 1,
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
            health: view.health,
        };
        self.write().devices.insert(entry.device.address, entry)
    }

    /// The device's record changed; its task state stays. Returns the old entry and the new.
    pub fn update_device(&self, device: Device) -> Option<(DeviceEntry, DeviceEntry)> {
        let mut inner = self.write();
        let old = shown(&inner, inner.devices.get(&device.address)?);
        let entry = inner.devices.get_mut(&device.address)?;
        entry.device = device;
        let new = entry.clone();
        Some((old, shown(&inner, &new)))
    }

    pub fn remove_device(&self, address: PciAddress) -> Option<DeviceEntry> {
        self.write().devices.remove(&address)
    }

    /// A device's task state changed (a device not shown is left alone).
    pub fn set_device_tasks(&self, t: DeviceTasks) {
        if let Some(entry) = self.write().devices.get_mut(&t.address) {
            entry.task = t.active;
            entry.last = t.last;
            entry.health = t.health;
        }
    }

    /// Replaces (or adds) a task; returns what it was.
    pub fn put_task(&self, task: TaskRecord) -> Option<TaskRecord> {
        self.write().tasks.insert(task.id, task)
    }

    /// The oldest finished tasks beyond `keep` that no device shows (as the task that holds it
    /// or as its last result): their objects can go. The view keeps them until
    /// [`View::forget_tasks`], so that a caller reading an object that is still exported never
    /// finds its entry gone.
    pub fn prunable_tasks(&self, keep: usize) -> Vec<i64> {
        let inner = self.read();
        let shown: std::collections::HashSet<i64> = inner
            .devices
            .values()
            .flat_map(|e| e.task.iter().chain(e.last.iter()).map(|t| t.id))
            .collect();
        let mut finished: Vec<i64> = inner
            .tasks
            .values()
            .filter(|t| t.state.is_final() && !t.is_active() && !shown.contains(&t.id))
            .map(|t| t.id)
            .collect();
        if finished.len() <= keep {
            return Vec::new();
        }
        finished.sort_unstable();
        finished[..finished.len() - keep].to_vec()
    }

    /// Drops tasks whose objects are no longer exported.
    pub fn forget_tasks(&self, ids: &[i64]) {
        let mut inner = self.write();
        for id in ids {
            inner.tasks.remove(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::task::TaskKind;
    use crate::store::TaskState;

    fn task(id: i64, state: TaskState) -> TaskRecord {
        TaskRecord {
            id,
            address: "0000:3b:00.0".parse().unwrap(),
            kind: TaskKind::Split,
            state,
            step: String::new(),
            percent: 0,
            message: String::new(),
            params: "{}".into(),
            requested_by: "test".into(),
            created_ms: id,
            started_ms: None,
            finished_ms: None,
            reset_ms: None,
            reset_by: None,
        }
    }

    fn device() -> Device {
        use crate::model::device::{Kind, Mode, Role};
        Device {
            address: "0000:3b:02.0".parse().unwrap(),
            vendor_id: 0x8086,
            device_id: 0x154c,
            subsystem_vendor_id: 0,
            subsystem_device_id: 0,
            revision: 0,
            class: crate::model::pci::ClassCode(0x020000),
            vendor_name: String::new(),
            device_name: String::new(),
            kind: Kind::Nic,
            driver: None,
            driver_override: None,
            numa_node: None,
            iommu_group: None,
            role: Role::Vf,
            separable: false,
            mode: Mode::None,
            total_vfs: 0,
            num_vfs: 0,
            parent_pf: Some("0000:3b:00.0".parse().unwrap()),
            managed: true,
            state: State::Usable,
            state_reason: String::new(),
        }
    }

    /// A device that no event moved off a task still shows that task's newest state, and idle
    /// once the task ended: a VF once stayed "running" on the bus after its PF's task ended.
    #[test]
    fn a_device_shows_its_task_as_the_task_itself_says() {
        let view = View::default();
        let address = device().address;
        view.put_task(task(5, TaskState::Running));
        view.put_device(DeviceView {
            device: device(),
            active: Some(task(5, TaskState::Prepare)),
            last: Some(task(2, TaskState::Success)),
            health: None,
        });
        let e = view.device(address).unwrap();
        assert_eq!(
            e.task.unwrap().state,
            TaskState::Running,
            "the newest record"
        );
        assert_eq!(view.showing_task(5), [address]);

        view.put_task(task(5, TaskState::Success));
        let e = view.device(address).unwrap();
        assert_eq!(e.task, None, "a finished task holds nothing");
        assert_eq!(e.last.unwrap().id, 5, "and is the last result");

        // An error holds the device until it is reset.
        view.put_task(task(6, TaskState::Error));
        view.set_device_tasks(DeviceTasks {
            address,
            active: Some(task(6, TaskState::Error)),
            last: Some(task(5, TaskState::Success)),
            health: None,
        });
        assert_eq!(view.device(address).unwrap().task.unwrap().id, 6);
        let mut reset = task(6, TaskState::Error);
        reset.reset_ms = Some(1);
        view.put_task(reset);
        let e = view.device(address).unwrap();
        assert_eq!(e.task, None);
        assert_eq!(e.last.unwrap().id, 6);
    }

    #[test]
    fn pruning_keeps_what_devices_show_the_unfinished_and_the_newest() {
        let view = View::default();
        for id in 1..=10 {
            view.put_task(task(id, TaskState::Success));
        }
        view.put_task(task(11, TaskState::Running));
        view.put_task(task(12, TaskState::Error)); // not reset: holds its device
        let device = Device {
            address: "0000:3b:00.0".parse().unwrap(),
            parent_pf: None,
            ..device()
        };
        view.put_device(DeviceView {
            device,
            active: Some(task(12, TaskState::Error)),
            last: Some(task(2, TaskState::Success)),
            health: None,
        });
        let gone = view.prunable_tasks(3);
        // Finished and shown by nobody: 1, 3..=10 (2 is a last result); the 3 newest stay.
        assert_eq!(gone, vec![1, 3, 4, 5, 6, 7]);
        assert!(view.task(1).is_some(), "kept until its object is gone");
        view.forget_tasks(&gone);
        for id in [2, 8, 9, 10, 11, 12] {
            assert!(view.task(id).is_some(), "task {id} kept");
        }
        assert!(view.task(1).is_none());
        assert!(view.prunable_tasks(3).is_empty(), "nothing more to prune");
    }
}
