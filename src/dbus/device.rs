//! `org.vfiod.Vfiod1.Device`: one object per PCI function, named like libvirt's node devices.

use crate::model::device::Device;
use std::collections::HashMap;
use zbus::interface;
use zbus::{OwnedVariant, Variant};

pub const INTERFACE: &str = "org.vfiod.Vfiod1.Device";

/// The D-Bus face of a device record (a snapshot of the store's row) and of its tasks.
pub struct DeviceObject {
    pub device: Device,
    /// The active task (prepare, running, or error until reset).
    pub task: Option<crate::store::TaskRecord>,
    /// The most recent finished task.
    pub last: Option<crate::store::TaskRecord>,
    pub ctx: std::sync::Arc<std::sync::OnceLock<super::Ctx>>,
}

impl DeviceObject {
    fn service(
        &self,
    ) -> Result<
        (
            std::sync::Arc<crate::engine::Service<super::DbusPublisher>>,
            super::auth::Authorizer,
        ),
        super::error::Error,
    > {
        let ctx = self
            .ctx
            .get()
            .ok_or_else(|| super::error::Error::Failed("vfiod is starting".into()))?;
        let s = ctx
            .service
            .upgrade()
            .ok_or_else(|| super::error::Error::Failed("vfiod is stopping".into()))?;
        Ok((s, ctx.authorizer))
    }

    /// Who asked, for the task record: the caller's uid when the bus tells it, else its name.
    async fn requester(conn: &zbus::Connection, header: &zbus::message::Header<'_>) -> String {
        let Some(sender) = header.sender() else {
            return "unknown".into();
        };
        let uid = match zbus::fdo::DBusProxy::new(conn).await {
            Ok(p) => p.get_connection_unix_user(sender.clone().into()).await.ok(),
            Err(_) => None,
        };
        match uid {
            Some(u) => format!("uid {u} ({sender})"),
            None => sender.to_string(),
        }
    }

    async fn start(
        &self,
        target: Option<crate::modes::policy::Target>,
        header: &zbus::message::Header<'_>,
        conn: &zbus::Connection,
    ) -> Result<zbus::OwnedObjectPath, super::error::Error> {
        let (service, authorizer) = self.service()?;
        authorizer
            .check(conn, header, super::auth::ACTION_MANAGE)
            .await?;
        let who = Self::requester(conn, header).await;
        let task = service
            .start_task(self.device.address, target, &who)
            .await?;
        Ok(super::task::task_path(task.id))
    }
}

/// Property values as sent on the bus. Absent values use sentinels D-Bus can carry: "" for
/// no driver, -1 for no NUMA node or IOMMU group.
pub fn properties(d: &Device) -> Vec<(&'static str, OwnedVariant)> {
    fn v<'a, T: Into<Variant<'a>>>(x: T) -> OwnedVariant {
        OwnedVariant::try_from(x.into()).expect("plain values convert")
    }
    vec![
        ("Address", v(d.address.to_string())),
        ("VendorId", v(d.vendor_id)),
        ("DeviceId", v(d.device_id)),
        ("SubsystemVendorId", v(d.subsystem_vendor_id)),
        ("SubsystemDeviceId", v(d.subsystem_device_id)),
        ("Revision", v(d.revision)),
        ("Class", v(d.class.0)),
        ("VendorName", v(d.vendor_name.clone())),
        ("DeviceName", v(d.device_name.clone())),
        ("Kind", v(d.kind.as_str())),
        ("Driver", v(d.driver.clone().unwrap_or_default())),
        (
            "DriverOverride",
            v(d.driver_override.clone().unwrap_or_default()),
        ),
        ("NumaNode", v(d.numa_node.unwrap_or(-1))),
        ("IommuGroup", v(d.iommu_group.map_or(-1, |g| g as i64))),
        ("Role", v(d.role.as_str())),
        ("Separable", v(d.separable)),
        ("Mode", v(d.mode.as_str())),
        ("TotalVfs", v(d.total_vfs)),
        ("NumVfs", v(d.num_vfs)),
        (
            "ParentPf",
            v(d.parent_pf.map(|a| a.to_string()).unwrap_or_default()),
        ),
        ("Managed", v(d.managed)),
        ("State", v(d.state.as_str())),
        ("StateReason", v(d.state_reason.clone())),
    ]
}

/// The properties that differ between two snapshots, for one PropertiesChanged signal.
pub fn changed_properties(old: &Device, new: &Device) -> HashMap<&'static str, OwnedVariant> {
    let before: HashMap<_, _> = properties(old).into_iter().collect();
    properties(new)
        .into_iter()
        .filter(|(k, v)| before.get(k) != Some(v))
        .collect()
}

#[interface(name = "org.vfiod.Vfiod1.Device")]
impl DeviceObject {
    /// PCI address, `DDDD:BB:SS.F`.
    #[zbus(property(emits_changed_signal = "const"))]
    fn address(&self) -> String {
        self.device.address.to_string()
    }
    #[zbus(property)]
    fn vendor_id(&self) -> u16 {
        self.device.vendor_id
    }
    #[zbus(property)]
    fn device_id(&self) -> u16 {
        self.device.device_id
    }
    #[zbus(property)]
    fn subsystem_vendor_id(&self) -> u16 {
        self.device.subsystem_vendor_id
    }
    #[zbus(property)]
    fn subsystem_device_id(&self) -> u16 {
        self.device.subsystem_device_id
    }
    #[zbus(property)]
    fn revision(&self) -> u8 {
        self.device.revision
    }
    /// 24-bit class code.
    #[zbus(property)]
    fn class(&self) -> u32 {
        self.device.class.0
    }
    #[zbus(property)]
    fn vendor_name(&self) -> String {
        self.device.vendor_name.clone()
    }
    #[zbus(property)]
    fn device_name(&self) -> String {
        self.device.device_name.clone()
    }
    /// gpu, fpga, crypto, nvme, nic or other.
    #[zbus(property)]
    fn kind(&self) -> String {
        self.device.kind.as_str().into()
    }
    /// Bound driver, "" when none.
    #[zbus(property)]
    fn driver(&self) -> String {
        self.device.driver.clone().unwrap_or_default()
    }
    #[zbus(property)]
    fn driver_override(&self) -> String {
        self.device.driver_override.clone().unwrap_or_default()
    }
    /// -1 when the platform reports none.
    #[zbus(property)]
    fn numa_node(&self) -> i32 {
        self.device.numa_node.unwrap_or(-1)
    }
    /// -1 when the function has no IOMMU group.
    #[zbus(property)]
    fn iommu_group(&self) -> i64 {
        self.device.iommu_group.map_or(-1, i64::from)
    }
    /// pf (SR-IOV capable), vf, or function (no SR-IOV).
    #[zbus(property)]
    fn role(&self) -> String {
        self.device.role.as_str().into()
    }
    /// SR-IOV capable.
    #[zbus(property)]
    fn separable(&self) -> bool {
        self.device.separable
    }
    /// pf, vf (split), or none (a VF itself).
    #[zbus(property)]
    fn mode(&self) -> String {
        self.device.mode.as_str().into()
    }
    #[zbus(property)]
    fn total_vfs(&self) -> u32 {
        self.device.total_vfs
    }
    #[zbus(property)]
    fn num_vfs(&self) -> u32 {
        self.device.num_vfs
    }
    /// For a VF, its PF's address; "" otherwise.
    #[zbus(property)]
    fn parent_pf(&self) -> String {
        self.device
            .parent_pf
            .map(|a| a.to_string())
            .unwrap_or_default()
    }
    /// Selected by the config and not protected: vfiod may change it.
    #[zbus(property)]
    fn managed(&self) -> bool {
        self.device.managed
    }
    /// usable, protected or broken.
    #[zbus(property)]
    fn state(&self) -> String {
        self.device.state.as_str().into()
    }
    #[zbus(property)]
    fn state_reason(&self) -> String {
        self.device.state_reason.clone()
    }

    /// idle, prepare, running or error (error until an operator calls ResetTask).
    #[zbus(property)]
    pub fn task_state(&self) -> String {
        self.task
            .as_ref()
            .map_or("idle".into(), |t| t.state.as_str().into())
    }

    /// The active task's object, "/" when idle.
    #[zbus(property)]
    pub fn current_task(&self) -> zbus::OwnedObjectPath {
        self.task.as_ref().map_or_else(
            || zbus::OwnedObjectPath::try_from("/").expect("root path"),
            |t| super::task::task_path(t.id),
        )
    }

    /// The last finished task: "task N KIND: STATE: RESULT", "" if none.
    #[zbus(property)]
    pub fn last_result(&self) -> String {
        self.last.as_ref().map_or(String::new(), |t| {
            format!(
                "task {} {}: {}: {}",
                t.id,
                t.kind,
                t.state.as_str(),
                t.message
            )
        })
    }

    /// Puts the device in `mode` ("pf" or "vf"; `num_vfs` 0 = as many as the configuration or
    /// the device allows). Returns the task at once; it reports progress as it runs. Refused
    /// with Busy when the device has a task, Protected, or InvalidArgument.
    async fn set_mode(
        &self,
        mode: &str,
        num_vfs: u32,
        #[zbus(header)] header: zbus::message::Header<'_>,
        #[zbus(connection)] conn: &zbus::Connection,
    ) -> Result<zbus::OwnedObjectPath, super::error::Error> {
        use crate::modes::policy::{Target, VFIO_PCI};
        let (service, _) = self.service()?;
        let settings = service.engine.settings();
        let d = &self.device;
        let rule = settings.rule_for(d.address, d.vendor_id, d.device_id, d.class);
        let target = match mode {
            "pf" => {
                if num_vfs != 0 {
                    return Err(super::error::Error::InvalidArgument(
                        "num_vfs must be 0 with mode pf".into(),
                    ));
                }
                Target::Pf {
                    driver: rule.and_then(|r| r.pf_driver.clone()),
                }
            }
            "vf" => Target::Vf {
                num_vfs: if num_vfs == 0 {
                    rule.and_then(|r| r.num_vfs).unwrap_or(d.total_vfs)
                } else {
                    num_vfs
                },
                vf_driver: rule
                    .and_then(|r| r.vf_driver.clone())
                    .unwrap_or_else(|| VFIO_PCI.into()),
            },
            other => {
                return Err(super::error::Error::InvalidArgument(format!(
                    "mode must be pf or vf, not {other:?}"
                )));
            }
        };
        self.start(Some(target), &header, conn).await
    }

    /// Brings the device to the mode its policy says (what vfiod does at start and on reload).
    async fn apply(
        &self,
        #[zbus(header)] header: zbus::message::Header<'_>,
        #[zbus(connection)] conn: &zbus::Connection,
    ) -> Result<zbus::OwnedObjectPath, super::error::Error> {
        self.start(None, &header, conn).await
    }

    /// Clears a task left in error, after the operator has looked at the device; recorded with
    /// the caller's identity.
    async fn reset_task(
        &self,
        #[zbus(header)] header: zbus::message::Header<'_>,
        #[zbus(connection)] conn: &zbus::Connection,
    ) -> Result<(), super::error::Error> {
        let (service, authorizer) = self.service()?;
        authorizer
            .check(conn, &header, super::auth::ACTION_MANAGE)
            .await?;
        let who = Self::requester(conn, &header).await;
        let t = service
            .engine
            .store()
            .reset_task(self.device.address, &who)?;
        crate::engine::Publish::task_changed(&service.publisher, t.id).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::device::{Kind, Mode, Role, State};
    use crate::model::pci::ClassCode;

    fn sample() -> Device {
        Device {
            address: "0000:3b:00.0".parse().unwrap(),
            vendor_id: 0x8086,
            device_id: 0x1572,
            subsystem_vendor_id: 0x8086,
            subsystem_device_id: 1,
            revision: 2,
            class: ClassCode(0x020000),
            vendor_name: "Intel Corporation".into(),
            device_name: "X710".into(),
            kind: Kind::Nic,
            driver: Some("i40e".into()),
            driver_override: None,
            numa_node: Some(0),
            iommu_group: Some(10),
            role: Role::Pf,
            separable: true,
            mode: Mode::Pf,
            total_vfs: 64,
            num_vfs: 0,
            parent_pf: None,
            managed: true,
            state: State::Usable,
            state_reason: String::new(),
        }
    }

    #[test]
    fn only_changed_properties_are_signalled() {
        let a = sample();
        let mut b = a.clone();
        b.num_vfs = 8;
        b.mode = Mode::Vf;
        let ch = changed_properties(&a, &b);
        let mut keys: Vec<_> = ch.keys().copied().collect();
        keys.sort();
        assert_eq!(keys, vec!["Mode", "NumVfs"]);
        assert!(changed_properties(&a, &a).is_empty());
    }
}
