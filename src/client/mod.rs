//! Client side of the D-Bus API, used by `vfioctl` and the tests: proxies, the JSON view of a
//! device, and the table `vfioctl list` prints.

pub mod claim;
pub mod event;
pub mod image;
pub mod hook;
pub mod metrics;
pub mod exit;
pub mod man;
pub mod pool;
pub mod progress;
pub mod status;
pub mod table;

use crate::dbus::wire::{Dict, Entry};
use crate::dbus::{BusTarget, BUS_NAME, ROOT_PATH};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use zbus::{Connection, OwnedVariant};

#[zbus::proxy(
    interface = "org.vfiod.Vfiod1.Manager",
    default_service = "org.vfiod.Vfiod1",
    default_path = "/org/vfiod/Vfiod1"
)]
pub trait Manager {
    #[zbus(property)]
    fn version(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn scenario(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn simulated(&self) -> zbus::Result<bool>;
    #[zbus(property)]
    fn device_count(&self) -> zbus::Result<u32>;
    #[zbus(property)]
    fn usable_count(&self) -> zbus::Result<u32>;
    #[zbus(property)]
    fn protected_count(&self) -> zbus::Result<u32>;
    #[zbus(property)]
    fn broken_count(&self) -> zbus::Result<u32>;
    #[zbus(property)]
    fn cleaning_count(&self) -> zbus::Result<u32>;
    #[zbus(property)]
    fn config_sources(&self) -> zbus::Result<Vec<String>>;
    /// Not cached: the daemon does not signal it (see `dbus::manager`).
    #[zbus(property(emits_changed_signal = "false"))]
    fn libvirt(&self) -> zbus::Result<std::collections::HashMap<String, zbus::OwnedVariant>>;
    /// Not cached either: the daemon does not signal it.
    #[zbus(property(emits_changed_signal = "false"))]
    fn fleet(&self) -> zbus::Result<Dict>;
    /// "present", "absent" or "" (before the first pass); not signalled.
    #[zbus(property(emits_changed_signal = "false"))]
    fn iommu(&self) -> zbus::Result<String>;
    /// The doctor's summary as of start-up or the last reload; not signalled.
    #[zbus(property(emits_changed_signal = "false"))]
    fn doctor(&self) -> zbus::Result<String>;
    fn get_metrics(&self) -> zbus::Result<String>;
    fn get_device(&self, address: &str) -> zbus::Result<zbus::OwnedObjectPath>;
    fn get_events(&self, query: Dict) -> zbus::Result<Vec<Dict>>;
    /// One per event the daemon records (`vfioctl events --follow`).
    #[zbus(signal)]
    fn event(&self, entry: Dict) -> zbus::Result<()>;
    fn get_plan(&self, address: &str) -> zbus::Result<Dict>;
    fn get_plans(&self) -> zbus::Result<Vec<Dict>>;
    /// `vfioctl plan --config`: the plans of a configuration given as (name, content) files.
    fn preview_plans(&self, files: &[(String, String)], options: Dict) -> zbus::Result<Vec<Dict>>;
    fn get_tasks(&self, query: Dict) -> zbus::Result<Vec<Dict>>;
    fn migrate(
        &self,
        domain: &str,
        destination: &str,
        options: crate::dbus::wire::Dict,
    ) -> zbus::Result<zbus::OwnedObjectPath>;
    fn hook(
        &self,
        domain: &str,
        operation: &str,
        sub_operation: &str,
        extra: &str,
        xml: &str,
    ) -> zbus::Result<(i32, String, String)>;
    fn hook_with_options(
        &self,
        domain: &str,
        operation: &str,
        sub_operation: &str,
        extra: &str,
        xml: &str,
        options: Dict,
    ) -> zbus::Result<(i32, String, String)>;
    fn reload(&self) -> zbus::Result<()>;
    fn rescan(&self) -> zbus::Result<()>;
    fn find_devices(&self, requirements: Dict) -> zbus::Result<Vec<zbus::OwnedObjectPath>>;
    fn claim(&self, requirements: Dict, owner: Dict) -> zbus::Result<zbus::OwnedObjectPath>;
    fn get_claims(&self) -> zbus::Result<Vec<zbus::OwnedObjectPath>>;
    // Deprecated aliases of `Pools` (pool::PoolsProxy) and `PooledClaim.Release`, kept for
    // one release; vfioctl uses the new members, tests check both.
    #[zbus(property)]
    fn host_name(&self) -> zbus::Result<String>;
    fn get_pools(&self) -> zbus::Result<Vec<Dict>>;
    fn get_pool_devices(&self, pool: &str) -> zbus::Result<Vec<Dict>>;
    fn get_pooled_claims(&self, query: Dict) -> zbus::Result<Vec<Dict>>;
    fn lease_pooled(&self, pool: &str, device: &str, owner: Dict) -> zbus::Result<Dict>;
    fn release_pooled(&self, id: i64) -> zbus::Result<Dict>;
}

#[zbus::proxy(
    interface = "org.vfiod.Vfiod1.Device",
    default_service = "org.vfiod.Vfiod1"
)]
pub trait Device {
    fn set_mode(&self, mode: &str, options: Dict) -> zbus::Result<zbus::OwnedObjectPath>;
    fn apply(&self) -> zbus::Result<zbus::OwnedObjectPath>;
    fn reset_task(&self) -> zbus::Result<()>;
    fn program(&self, image: &str, options: Dict) -> zbus::Result<zbus::OwnedObjectPath>;
    fn verify(&self, image: &str, options: Dict) -> zbus::Result<zbus::OwnedObjectPath>;
    fn clean(&self, options: Dict) -> zbus::Result<zbus::OwnedObjectPath>;
}

/// `Device.SetMode`'s options: `num_vfs` when a count is asked for (0 or none: the
/// configuration's or the device's).
pub fn mode_options(num_vfs: Option<u32>) -> Dict {
    num_vfs
        .filter(|n| *n > 0)
        .map(|n| ("num_vfs".to_string(), crate::dbus::variant(n)))
        .into_iter()
        .collect()
}

#[zbus::proxy(
    interface = "org.vfiod.Vfiod1.Task",
    default_service = "org.vfiod.Vfiod1"
)]
pub trait Task {
    #[zbus(property)]
    fn id(&self) -> zbus::Result<i64>;
    #[zbus(property)]
    fn kind(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn device(&self) -> zbus::Result<zbus::OwnedObjectPath>;
    #[zbus(property)]
    fn address(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn state(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn step(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn percent(&self) -> zbus::Result<u8>;
    #[zbus(property)]
    fn result(&self) -> zbus::Result<String>;
}

/// An address as a user may type it: `0000:3b:00.0`, or libvirt's and the device object's
/// spelling `pci_0000_3b_00_0` (virsh nodedev-list, the object path's last element), given in
/// the first. Anything else is passed on unchanged, for the daemon to name what is wrong.
pub fn address_spelling(text: &str) -> String {
    crate::model::pci::PciAddress::from_nodedev_name(text)
        .map_or_else(|_| text.to_string(), |a| a.to_string())
}

/// A device object's proxy by address (no property cache: one-shot calls). The daemon resolves
/// the address, so an unknown one is its NoSuchDevice naming it, not the bus's UnknownObject.
pub async fn device(conn: &Connection, address: &str) -> Result<DeviceProxy<'static>, ClientError> {
    let path = manager(conn)
        .await?
        .get_device(&address_spelling(address))
        .await?;
    Ok(DeviceProxy::builder(conn)
        .path(path)
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await?)
}

pub async fn task(
    conn: &Connection,
    path: zbus::OwnedObjectPath,
) -> Result<TaskProxy<'static>, ClientError> {
    Ok(TaskProxy::builder(conn)
        .path(path)
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await?)
}

/// Follows a task until it ends, calling `show(percent, step)` as it progresses. Returns
/// (state, result).
pub async fn wait_task(
    task: &TaskProxy<'_>,
    mut show: impl FnMut(u8, &str),
) -> Result<(String, String), ClientError> {
    loop {
        let state = task.state().await?;
        let (pct, step) = (task.percent().await?, task.step().await?);
        show(pct, &step);
        if state == "success" || state == "error" {
            return Ok((state, task.result().await?));
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// A task object as `vfioctl mode|task start|task show|migrate|fpga ... --json` prints it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskView {
    pub id: i64,
    pub kind: String,
    /// The device's address.
    pub address: String,
    pub state: String,
    pub step: String,
    pub percent: u8,
    pub result: String,
    /// Its object path.
    pub path: String,
}

/// A task object's current state.
pub async fn task_view(task: &TaskProxy<'_>) -> Result<TaskView, ClientError> {
    Ok(TaskView {
        id: task.id().await?,
        kind: task.kind().await?,
        address: task.address().await?,
        state: task.state().await?,
        step: task.step().await?,
        percent: task.percent().await?,
        result: task.result().await?,
        path: task.inner().path().to_string(),
    })
}

/// A query dictionary for `GetEvents`/`GetTasks` from the keys that are set.
pub fn query(pairs: Vec<(&str, Option<zbus::Variant<'static>>)>) -> Dict {
    pairs
        .into_iter()
        .filter_map(|(k, v)| Some((k.to_string(), OwnedVariant::try_from(v?).ok()?)))
        .collect()
}

/// One entry of the history (`vfioctl events --json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventEntry {
    pub id: i64,
    pub time_ms: i64,
    pub address: String,
    pub kind: String,
    pub message: String,
}

impl EventEntry {
    pub fn from_dict(d: &Dict) -> EventEntry {
        let e = Entry(d);
        EventEntry {
            id: e.i64("id"),
            time_ms: e.i64("time"),
            address: e.str("address"),
            kind: e.str("kind"),
            message: e.str("message"),
        }
    }
}

/// One task of the history (`vfioctl task list --json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskEntry {
    pub id: i64,
    pub kind: String,
    pub address: String,
    pub state: String,
    pub step: String,
    pub percent: u8,
    pub result: String,
    /// The task's parameters as the daemon recorded them (an object; null when none).
    pub parameters: serde_json::Value,
    pub requested_by: String,
    pub created_ms: i64,
    pub started_ms: i64,
    pub finished_ms: i64,
    pub reset_by: String,
}

impl TaskEntry {
    pub fn from_dict(d: &Dict) -> TaskEntry {
        let e = Entry(d);
        TaskEntry {
            id: e.i64("id"),
            kind: e.str("kind"),
            address: e.str("device"),
            state: e.str("state"),
            step: e.str("step"),
            percent: e.u8("percent"),
            result: e.str("result"),
            parameters: e.json("parameters"),
            requested_by: e.str("requested_by"),
            created_ms: e.i64("created"),
            started_ms: e.i64("started"),
            finished_ms: e.i64("finished"),
            reset_by: e.str("reset_by"),
        }
    }
}

/// One device's plan (`vfioctl plan`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanEntry {
    pub address: String,
    pub decision: String,
    pub reason: String,
    pub program: String,
    pub steps: Vec<String>,
    /// The whole plan (`vfioctl plan --json`).
    pub json: serde_json::Value,
}

impl PlanEntry {
    pub fn from_dict(d: &Dict) -> PlanEntry {
        let e = Entry(d);
        PlanEntry {
            address: e.str("address"),
            decision: e.str("decision"),
            reason: e.str("reason"),
            program: e.str("program"),
            steps: e.strings("steps"),
            json: e.json("plan"),
        }
    }
}

/// One device as `vfioctl list --json` prints it: ids as lowercase hex strings (as lspci and
/// libvirt show them), absent values as null.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceView {
    pub address: String,
    pub vendor_id: String,
    pub device_id: String,
    pub subsystem_vendor_id: String,
    pub subsystem_device_id: String,
    pub revision: String,
    pub class: String,
    pub vendor_name: String,
    pub device_name: String,
    pub kind: String,
    pub driver: Option<String>,
    pub driver_override: Option<String>,
    pub numa_node: Option<i32>,
    pub iommu_group: Option<u32>,
    pub role: String,
    pub separable: bool,
    pub mode: String,
    pub total_vfs: u32,
    pub num_vfs: u32,
    pub parent_pf: Option<String>,
    pub managed: bool,
    pub state: String,
    pub state_reason: String,
    /// idle, prepare, running or error: the task that holds the device, its own or one that
    /// covers it. A device in error is not usable until the task is reset.
    pub task_state: String,
    /// That task's object path; null when idle.
    pub current_task: Option<String>,
    /// The last finished task and its result; "" when none.
    pub last_result: String,
    /// The object of the claim that holds the device; null when none does.
    #[serde(default)]
    pub claim: Option<String>,
    /// The VM that claim is for (its name, else its UUID).
    #[serde(default)]
    pub vm: Option<String>,
    /// What a live migration of its VM does to it: yes, detach, no.
    #[serde(default)]
    pub migratable: String,
    /// How its resets have gone in its cleans between tenants; null when never cleaned.
    #[serde(default)]
    pub reset_health: Option<crate::model::clean::ResetHealth>,
}

/// `Device.ResetHealth` read back: the model's record (times in Unix milliseconds), `None` when
/// the dictionary is empty (never cleaned).
pub fn reset_health_from_dict(d: &Dict) -> Option<crate::model::clean::ResetHealth> {
    if d.is_empty() {
        return None;
    }
    let e = Entry(d);
    let text = |k: &str| d.contains_key(k).then(|| e.str(k));
    let time = |k: &str| d.contains_key(k).then(|| e.i64(k));
    Some(crate::model::clean::ResetHealth {
        method: text("method"),
        duration_ms: time("duration_ms"),
        ok_ms: time("ok_ms"),
        failure: text("failure"),
        failure_ms: time("failure_ms"),
        failures_in_row: e.u32("failures_in_row"),
        cleans: e.u32("cleans"),
    })
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to the bus")]
    Connect(#[source] zbus::Error),
    #[error("vfiod is not running on this bus (no owner for {BUS_NAME})")]
    NotRunning,
    // The zbus error already names the D-Bus error and its message; no #[source], so a
    // printed chain does not repeat it.
    #[error("{0}")]
    Call(zbus::Error),
    #[error("device object {path} lacks property {property} or has the wrong type")]
    BadProperty { path: String, property: String },
}

impl From<zbus::fdo::Error> for ClientError {
    fn from(e: zbus::fdo::Error) -> Self {
        zbus::Error::from(e).into()
    }
}

impl From<zbus::Error> for ClientError {
    fn from(e: zbus::Error) -> Self {
        let unknown = |n: &str| {
            n == "org.freedesktop.DBus.Error.ServiceUnknown"
                || n == "org.freedesktop.DBus.Error.NameHasNoOwner"
        };
        match &e {
            zbus::Error::MethodError(name, _, _) if unknown(name.as_str()) => {
                ClientError::NotRunning
            }
            zbus::Error::FDO(f)
                if matches!(
                    **f,
                    zbus::fdo::Error::ServiceUnknown(_) | zbus::fdo::Error::NameHasNoOwner(_)
                ) =>
            {
                ClientError::NotRunning
            }
            _ => ClientError::Call(e),
        }
    }
}

/// A manager proxy that reads properties on each access: vfioctl and tests want the daemon's
/// current values, not a cache that a signal may not have refreshed yet.
pub async fn manager(conn: &Connection) -> Result<ManagerProxy<'static>, ClientError> {
    Ok(ManagerProxy::builder(conn)
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await?)
}

/// `vfioctl plan --config`: what the configuration in `files` (read by the caller, in the
/// order they apply) would plan on the daemon's host now (`Manager.PreviewPlans`). The files
/// are sent as text: a caller validates them first (`Settings::from_files`), which refuses one
/// that is not UTF-8.
pub async fn preview_plans(
    conn: &Connection,
    files: &[(std::path::PathBuf, Vec<u8>)],
) -> Result<Vec<PlanEntry>, ClientError> {
    let texts: Vec<(String, String)> = files
        .iter()
        .map(|(p, b)| {
            (
                p.display().to_string(),
                String::from_utf8_lossy(b).into_owned(),
            )
        })
        .collect();
    let m = manager(conn).await?;
    Ok(m.preview_plans(&texts, Dict::new())
        .await?
        .iter()
        .map(PlanEntry::from_dict)
        .collect())
}

pub async fn connect(bus: &BusTarget) -> Result<Connection, ClientError> {
    bus.builder().build().await.map_err(ClientError::Connect)
}

fn prop<T: TryFrom<OwnedVariant>>(
    props: &HashMap<String, OwnedVariant>,
    path: &str,
    name: &str,
) -> Result<T, ClientError> {
    props
        .get(name)
        .and_then(|v| v.try_clone().ok())
        .and_then(|v| T::try_from(v).ok())
        .ok_or_else(|| ClientError::BadProperty {
            path: path.to_string(),
            property: name.to_string(),
        })
}

/// The address of a device object's path (`/org/vfiod/Vfiod1/device/pci_0000_3b_00_0`), or
/// `None` for `/` (no device) or another path.
pub fn address_of_path(path: &str) -> Option<String> {
    let name = path
        .strip_prefix(crate::dbus::ROOT_PATH)?
        .strip_prefix("/device/")?;
    crate::model::pci::PciAddress::from_nodedev_name(name)
        .ok()
        .map(|a| a.to_string())
}

/// Builds the view from a device object's properties.
pub fn view_from_properties(
    path: &str,
    p: &HashMap<String, OwnedVariant>,
) -> Result<DeviceView, ClientError> {
    let s = |n: &str| prop::<String>(p, path, n);
    let opt = |v: String| (!v.is_empty()).then_some(v);
    let numa: i32 = prop(p, path, "NumaNode")?;
    let group: i64 = prop(p, path, "IommuGroup")?;
    Ok(DeviceView {
        address: s("Address")?,
        vendor_id: format!("{:04x}", prop::<u16>(p, path, "VendorId")?),
        device_id: format!("{:04x}", prop::<u16>(p, path, "DeviceId")?),
        subsystem_vendor_id: format!("{:04x}", prop::<u16>(p, path, "SubsystemVendorId")?),
        subsystem_device_id: format!("{:04x}", prop::<u16>(p, path, "SubsystemDeviceId")?),
        revision: format!("{:02x}", prop::<u8>(p, path, "Revision")?),
        class: format!("0x{:06x}", prop::<u32>(p, path, "Class")?),
        vendor_name: s("VendorName")?,
        device_name: s("DeviceName")?,
        kind: s("Kind")?,
        driver: opt(s("Driver")?),
        driver_override: opt(s("DriverOverride")?),
        numa_node: (numa >= 0).then_some(numa),
        iommu_group: u32::try_from(group).ok(),
        role: s("Role")?,
        separable: prop(p, path, "Separable")?,
        mode: s("Mode")?,
        total_vfs: prop(p, path, "TotalVfs")?,
        num_vfs: prop(p, path, "NumVfs")?,
        parent_pf: address_of_path(&prop::<zbus::OwnedObjectPath>(p, path, "ParentPf")?),
        managed: prop(p, path, "Managed")?,
        state: s("State")?,
        state_reason: s("StateReason")?,
        migratable: s("Migratable")?,
        task_state: s("TaskState")?,
        current_task: {
            let p: zbus::OwnedObjectPath = prop(p, path, "CurrentTask")?;
            (p.as_str() != "/").then(|| p.as_str().to_string())
        },
        last_result: s("LastResult")?,
        claim: {
            let p: zbus::OwnedObjectPath = prop(p, path, "Claim")?;
            (p.as_str() != "/").then(|| p.as_str().to_string())
        },
        vm: None,
        // Absent from a vfiod before cleaning existed.
        reset_health: prop::<Dict>(p, path, "ResetHealth")
            .ok()
            .and_then(|d| reset_health_from_dict(&d)),
    })
}

/// Every device object, sorted by address, from one GetManagedObjects call.
pub async fn list_devices(conn: &Connection) -> Result<Vec<DeviceView>, ClientError> {
    let om = zbus::fdo::ObjectManagerProxy::builder(conn)
        .destination(BUS_NAME)
        .path(ROOT_PATH)
        .build()
        .await?;
    let objects = om.get_managed_objects().await?;
    let of = |ifaces: &HashMap<zbus::names::OwnedInterfaceName, HashMap<String, OwnedVariant>>,
              interface: &str| {
        ifaces
            .iter()
            .find(|(name, _)| name.as_str() == interface)
            .map(|(_, p)| p.clone())
    };
    let mut vms = HashMap::new();
    for (path, ifaces) in &objects {
        if let Some(props) = of(ifaces, claim::INTERFACE) {
            vms.insert(path.as_str().to_string(), claim::vm_of(&props));
        }
    }
    let mut out = Vec::new();
    for (path, ifaces) in &objects {
        if let Some(props) = of(ifaces, crate::dbus::device::INTERFACE) {
            let mut d = view_from_properties(path.as_str(), &props)?;
            d.vm = d.claim.as_ref().and_then(|c| vms.get(c).cloned());
            out.push(d);
        }
    }
    out.sort_by_key(|d| d.address.parse::<crate::model::pci::PciAddress>().ok());
    Ok(out)
}

/// One device by address (NoSuchDevice comes back as the daemon's named error).
pub async fn show_device(conn: &Connection, address: &str) -> Result<DeviceView, ClientError> {
    let manager = manager(conn).await?;
    let path = manager.get_device(&address_spelling(address)).await?;
    let props = zbus::fdo::PropertiesProxy::builder(conn)
        .destination(BUS_NAME)
        .path(path.clone())
        .build()
        .await?;
    let all = props
        .get_all(crate::dbus::device::INTERFACE.try_into()?)
        .await?;
    let mut d = view_from_properties(path.as_str(), &all.into_iter().collect())?;
    if let Some(c) = &d.claim {
        // Released between the two reads: no VM to show.
        d.vm = claim::claim_view(conn, c).await.ok().map(|c| c.vm);
    }
    Ok(d)
}

/// The `vfioctl list` table. Names are whole: a reader of a pipe gets them uncut.
pub fn render_table(devices: &[DeviceView]) -> String {
    let rows = devices.iter().map(|d| {
        let name = if d.device_name.is_empty() {
            format!("[{}:{}]", d.vendor_id, d.device_id)
        } else {
            let vendor = d.vendor_name.split_whitespace().next().unwrap_or("");
            format!("{vendor} {}", d.device_name)
        };
        let vfs = match d.role.as_str() {
            "pf" => format!("{}/{}", d.num_vfs, d.total_vfs),
            "vf" => format!("vf of {}", d.parent_pf.as_deref().unwrap_or("?")),
            _ => "-".into(),
        };
        let mode = match d.mode.as_str() {
            "none" => "-".to_string(),
            m => m.to_string(),
        };
        let mut state = d.state.clone();
        if d.managed {
            state.push_str(" (managed)");
        }
        if let Some(vm) = &d.vm {
            state.push_str(&format!(", claimed by {vm}"));
        }
        vec![
            d.address.clone(),
            d.kind.clone(),
            name,
            d.driver.clone().unwrap_or_else(|| "-".into()),
            mode,
            vfs,
            d.iommu_group.map_or("-".into(), |g| g.to_string()),
            d.numa_node.map_or("-".into(), |n| n.to_string()),
            state,
        ]
    });
    table::render(
        &[
            "ADDRESS", "KIND", "NAME", "DRIVER", "MODE", "VFS", "GROUP", "NUMA", "STATE",
        ],
        rows,
    )
}

/// `vfioctl show` as text: one `key: value` per line.
pub fn render_details(d: &DeviceView) -> String {
    let or_none = |o: &Option<String>| o.clone().unwrap_or_else(|| "none".into());
    let mut s = String::new();
    let mut kv = |k: &str, v: String| s.push_str(&format!("{k:<18}{v}\n"));
    kv("address:", d.address.clone());
    kv("vendor:", format!("{} [{}]", d.vendor_name, d.vendor_id));
    kv("device:", format!("{} [{}]", d.device_name, d.device_id));
    kv(
        "subsystem:",
        format!("{}:{}", d.subsystem_vendor_id, d.subsystem_device_id),
    );
    kv("class:", format!("{} (rev {})", d.class, d.revision));
    kv("kind:", d.kind.clone());
    kv("driver:", or_none(&d.driver));
    kv("driver_override:", or_none(&d.driver_override));
    kv(
        "numa node:",
        d.numa_node.map_or("none".into(), |n| n.to_string()),
    );
    kv(
        "iommu group:",
        d.iommu_group.map_or("none".into(), |g| g.to_string()),
    );
    kv("role:", d.role.clone());
    kv(
        "separable:",
        if d.separable {
            "yes (SR-IOV)".into()
        } else {
            "no".into()
        },
    );
    kv("mode:", d.mode.clone());
    kv("vfs:", format!("{} of {}", d.num_vfs, d.total_vfs));
    kv("parent pf:", or_none(&d.parent_pf));
    kv(
        "managed:",
        if d.managed { "yes".into() } else { "no".into() },
    );
    kv("state:", d.state.clone());
    if !d.state_reason.is_empty() {
        kv("reason:", d.state_reason.clone());
    }
    kv(
        "task:",
        match (&d.current_task, d.task_state.as_str()) {
            (Some(path), "error") => format!(
                "error: {path} holds the device until reset (vfioctl task reset {})",
                d.address
            ),
            (Some(path), state) => format!("{state}: {path}"),
            (None, state) => state.to_string(),
        },
    );
    if !d.last_result.is_empty() {
        kv("last task:", d.last_result.clone());
    }
    kv(
        "claim:",
        match (&d.claim, &d.vm) {
            (Some(path), Some(vm)) => format!("{path} for {vm}"),
            (Some(path), None) => path.clone(),
            (None, _) => "none".into(),
        },
    );
    if let Some(h) = &d.reset_health {
        kv(
            "last reset:",
            match (&h.method, h.duration_ms) {
                (Some(m), Some(ms)) => format!("{m}, {ms} ms"),
                (Some(m), None) => m.clone(),
                _ => "none worked yet".into(),
            },
        );
        kv(
            "cleans:",
            format!("{} ok, {} failed in a row", h.cleans, h.failures_in_row),
        );
        if let Some(f) = &h.failure {
            kv("last failure:", f.clone());
        }
    }
    s
}
