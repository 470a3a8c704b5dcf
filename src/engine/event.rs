//! What the engine tells the world, in order, on one channel: the D-Bus layer publishes it (and
//! any other consumer could). The engine decides what each event concerns (which devices a task
//! covers, their task state afterwards), so a consumer needs no store of its own.

use crate::model::clean::ResetHealth;
use crate::model::device::Device;
use crate::model::pci::PciAddress;
use crate::store::{DeviceChange, TaskRecord};
use tokio::sync::{mpsc, oneshot};

/// The task state of one device after a change: the task that holds it (its own, or its IOMMU
/// group's, or its PF's) and its last finished task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceTasks {
    pub address: PciAddress,
    pub active: Option<TaskRecord>,
    pub last: Option<TaskRecord>,
    /// How its resets have gone (its cleans between tenants), when it was ever cleaned: a clean
    /// task's end changes it.
    pub health: Option<ResetHealth>,
}

/// One device as a consumer first sees it: its record and its task state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceView {
    pub device: Device,
    pub active: Option<TaskRecord>,
    pub last: Option<TaskRecord>,
    pub health: Option<ResetHealth>,
}

#[derive(Debug)]
pub enum EngineEvent {
    /// An inventory pass committed these changes; `tasks` gives the task state of each device
    /// that appeared.
    Inventory {
        changes: Vec<DeviceChange>,
        tasks: Vec<DeviceTasks>,
    },
    /// A task was created or changed. `devices` is the task state of every device it covers,
    /// when the change can alter it (created, started, finished, reset); empty for progress.
    Task {
        task: TaskRecord,
        devices: Vec<DeviceTasks>,
    },
    /// A claim was made or changed (released: `claim.state` says so).
    Claim(crate::store::ClaimRecord),
    /// A pooled claim was recorded or took a step (ended: `state` says so).
    Pooled(crate::model::pool::PooledClaim),
    /// The settings were replaced by a reload.
    Settings,
    /// A libvirt domain was defined, started, stopped, ... (from libvirt's own events).
    Domain(crate::host::libvirt::DomainEvent),
    /// A marker: answered once every event sent before it has been handled, so that a D-Bus
    /// reply naming a new task is sent only when the task's object exists.
    Flush(oneshot::Sender<()>),
}

pub type EventSender = mpsc::UnboundedSender<EngineEvent>;
pub type EventStream = mpsc::UnboundedReceiver<EngineEvent>;
