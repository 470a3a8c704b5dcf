//! `org.vfiod.Vfiod1.Device`: one object per PCI function, named like libvirt's node devices.

use super::auth::{Check, Detail, ACTION_MODE, ACTION_PROGRAM};
use super::error::Error;
use super::view::DeviceEntry;
use super::wire::{Dict, Query};
use crate::engine::job::{FpgaJob, ModeJob};
use crate::model::device::Device;
use crate::model::pci::PciAddress;
use std::collections::HashMap;
use zbus::interface;
use zbus::{OwnedVariant, Variant};

pub const INTERFACE: &str = "org.vfiod.Vfiod1.Device";

/// The options `SetMode` takes.
pub const SET_MODE_OPTIONS: &[&str] = &["num_vfs"];
/// The options of a method that takes none yet: every key is unknown (InvalidArgument).
const NO_OPTIONS: &[&str] = &[];

/// The D-Bus face of one PCI function: its address and handles on the engine and the view; its
/// properties are read from the view, so the object itself never changes.
pub struct DeviceObject {
    pub address: PciAddress,
    pub objects: super::Objects,
}

impl DeviceObject {
    fn entry(&self) -> zbus::fdo::Result<DeviceEntry> {
        self.objects
            .view
            .device(self.address)
            .ok_or_else(|| zbus::fdo::Error::UnknownObject(format!("{} is gone", self.address)))
    }

    fn device(&self) -> zbus::fdo::Result<Device> {
        self.entry().map(|e| e.device)
    }

    /// Authorizes the caller for `check`, starts `job` and replies with its task once the
    /// task's object exists.
    async fn start(
        &self,
        job: Box<dyn crate::engine::Job>,
        check: Check,
        header: &zbus::message::Header<'_>,
        conn: &zbus::Connection,
    ) -> Result<zbus::OwnedObjectPath, Error> {
        let o = &self.objects;
        o.authorizer.check(conn, header, &check).await?;
        let who = o.requesters.of(conn, header).await;
        let started = o.engine.start_task(job, &who).await;
        // A refusal was recorded too (a task created, then refused and reset): the caller must
        // find the device idle again when the error reaches it, as it finds a new task's object.
        o.engine.flush().await;
        Ok(super::task::task_path(started?.id))
    }
}

/// The task properties of a device entry: idle, prepare, running or error; its object; the
/// last result.
fn task_state_of(e: &DeviceEntry) -> String {
    e.task
        .as_ref()
        .map_or("idle".into(), |t| t.state.as_str().into())
}

fn current_task_of(e: &DeviceEntry) -> zbus::OwnedObjectPath {
    e.task.as_ref().map_or_else(
        || zbus::OwnedObjectPath::try_from("/").expect("root path"),
        |t| super::task::task_path(t.id),
    )
}

/// `/org/vfiod/Vfiod1/claim/N` of the claim that holds a device, "/" when none does.
pub fn claim_path_of(claim: Option<i64>) -> zbus::OwnedObjectPath {
    claim.map_or_else(
        || zbus::OwnedObjectPath::try_from("/").expect("root path"),
        super::claim::claim_path,
    )
}

fn last_result_of(e: &DeviceEntry) -> String {
    e.last.as_ref().map_or(String::new(), |t| {
        format!(
            "task {} {}: {}: {}",
            t.id,
            t.kind,
            t.state.as_str(),
            t.message
        )
    })
}

/// The task properties that differ between two entries, for one PropertiesChanged signal.
pub fn changed_task_properties(
    old: &DeviceEntry,
    new: &DeviceEntry,
) -> HashMap<&'static str, OwnedVariant> {
    let v = |x: Variant<'_>| OwnedVariant::try_from(x).expect("plain values convert");
    let mut out = HashMap::new();
    if task_state_of(old) != task_state_of(new) {
        out.insert("TaskState", v(task_state_of(new).into()));
    }
    if current_task_of(old) != current_task_of(new) {
        out.insert("CurrentTask", v(current_task_of(new).into()));
    }
    if last_result_of(old) != last_result_of(new) {
        out.insert("LastResult", v(last_result_of(new).into()));
    }
    out
}

/// Property values as sent on the bus. Absent values use sentinels D-Bus can carry: "" for
/// no driver, -1 for no NUMA node or IOMMU group.
pub fn properties(d: &Device) -> Vec<(&'static str, OwnedVariant)> {
    use super::variant as v;
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
        ("ParentPf", v(parent_pf_path(d.parent_pf))),
        ("Managed", v(d.managed)),
        ("State", v(d.state.as_str())),
        ("StateReason", v(d.state_reason.clone())),
        ("Migratable", v(crate::migration::migratable(d).as_str())),
    ]
}

/// The properties that differ between two snapshots, for one PropertiesChanged signal.
pub fn changed_properties(old: &Device, new: &Device) -> HashMap<&'static str, OwnedVariant> {
    super::changed(properties(old), properties(new))
}

#[interface(name = "org.vfiod.Vfiod1.Device")]
impl DeviceObject {
    /// PCI address, `DDDD:BB:SS.F`.
    #[zbus(property(emits_changed_signal = "const"))]
    fn address(&self) -> zbus::fdo::Result<String> {
        let d = self.device()?;
        Ok(d.address.to_string())
    }
    #[zbus(property)]
    fn vendor_id(&self) -> zbus::fdo::Result<u16> {
        let d = self.device()?;
        Ok(d.vendor_id)
    }
    #[zbus(property)]
    fn device_id(&self) -> zbus::fdo::Result<u16> {
        let d = self.device()?;
        Ok(d.device_id)
    }
    #[zbus(property)]
    fn subsystem_vendor_id(&self) -> zbus::fdo::Result<u16> {
        let d = self.device()?;
        Ok(d.subsystem_vendor_id)
    }
    #[zbus(property)]
    fn subsystem_device_id(&self) -> zbus::fdo::Result<u16> {
        let d = self.device()?;
        Ok(d.subsystem_device_id)
    }
    #[zbus(property)]
    fn revision(&self) -> zbus::fdo::Result<u8> {
        let d = self.device()?;
        Ok(d.revision)
    }
    /// 24-bit class code.
    #[zbus(property)]
    fn class(&self) -> zbus::fdo::Result<u32> {
        let d = self.device()?;
        Ok(d.class.0)
    }
    #[zbus(property)]
    fn vendor_name(&self) -> zbus::fdo::Result<String> {
        let d = self.device()?;
        Ok(d.vendor_name.clone())
    }
    #[zbus(property)]
    fn device_name(&self) -> zbus::fdo::Result<String> {
        let d = self.device()?;
        Ok(d.device_name.clone())
    }
    /// gpu, fpga, crypto, nvme, nic or other.
    #[zbus(property)]
    fn kind(&self) -> zbus::fdo::Result<String> {
        let d = self.device()?;
        Ok(d.kind.as_str().into())
    }
    /// Bound driver, "" when none.
    #[zbus(property)]
    fn driver(&self) -> zbus::fdo::Result<String> {
        let d = self.device()?;
        Ok(d.driver.clone().unwrap_or_default())
    }
    #[zbus(property)]
    fn driver_override(&self) -> zbus::fdo::Result<String> {
        let d = self.device()?;
        Ok(d.driver_override.clone().unwrap_or_default())
    }
    /// -1 when the platform reports none.
    #[zbus(property)]
    fn numa_node(&self) -> zbus::fdo::Result<i32> {
        let d = self.device()?;
        Ok(d.numa_node.unwrap_or(-1))
    }
    /// -1 when the function has no IOMMU group.
    #[zbus(property)]
    fn iommu_group(&self) -> zbus::fdo::Result<i64> {
        let d = self.device()?;
        Ok(d.iommu_group.map_or(-1, i64::from))
    }
    /// pf (SR-IOV capable), vf, or function (no SR-IOV).
    #[zbus(property)]
    fn role(&self) -> zbus::fdo::Result<String> {
        let d = self.device()?;
        Ok(d.role.as_str().into())
    }
    /// SR-IOV capable.
    #[zbus(property)]
    fn separable(&self) -> zbus::fdo::Result<bool> {
        let d = self.device()?;
        Ok(d.separable)
    }
    /// pf, vf (split), or none (a VF itself).
    #[zbus(property)]
    fn mode(&self) -> zbus::fdo::Result<String> {
        let d = self.device()?;
        Ok(d.mode.as_str().into())
    }
    #[zbus(property)]
    fn total_vfs(&self) -> zbus::fdo::Result<u32> {
        let d = self.device()?;
        Ok(d.total_vfs)
    }
    #[zbus(property)]
    fn num_vfs(&self) -> zbus::fdo::Result<u32> {
        let d = self.device()?;
        Ok(d.num_vfs)
    }
    /// For a VF, its PF's object; `/` otherwise.
    #[zbus(property)]
    fn parent_pf(&self) -> zbus::fdo::Result<zbus::OwnedObjectPath> {
        let d = self.device()?;
        Ok(parent_pf_path(d.parent_pf))
    }
    /// Selected by the config and not protected: vfiod may change it.
    #[zbus(property)]
    fn managed(&self) -> zbus::fdo::Result<bool> {
        let d = self.device()?;
        Ok(d.managed)
    }
    /// usable, protected or broken.
    #[zbus(property)]
    fn state(&self) -> zbus::fdo::Result<String> {
        let d = self.device()?;
        Ok(d.state.as_str().into())
    }
    #[zbus(property)]
    fn state_reason(&self) -> zbus::fdo::Result<String> {
        let d = self.device()?;
        Ok(d.state_reason.clone())
    }

    /// What a live migration of its VM does to it: `yes` (its VFIO variant driver migrates its
    /// state: it moves with the VM), `detach` (vfiod detaches it, and the destination attaches
    /// an equivalent device of its own), `no` (vfiod cannot carry it: not managed, broken,
    /// protected).
    #[zbus(property)]
    fn migratable(&self) -> zbus::fdo::Result<String> {
        let d = self.device()?;
        Ok(crate::migration::migratable(&d).as_str().into())
    }

    /// idle, prepare, running or error (error until an operator calls ResetTask): of the task
    /// that holds the device, its own or one that covers it.
    #[zbus(property)]
    fn task_state(&self) -> zbus::fdo::Result<String> {
        Ok(task_state_of(&self.entry()?))
    }

    /// That task's object, "/" when idle.
    #[zbus(property)]
    fn current_task(&self) -> zbus::fdo::Result<zbus::OwnedObjectPath> {
        Ok(current_task_of(&self.entry()?))
    }

    /// The last finished task: "task N KIND: STATE: RESULT", "" if none.
    #[zbus(property)]
    fn last_result(&self) -> zbus::fdo::Result<String> {
        Ok(last_result_of(&self.entry()?))
    }

    /// The claim that holds the device (its own, or its IOMMU group's), "/" when none does.
    #[zbus(property)]
    fn claim(&self) -> zbus::fdo::Result<zbus::OwnedObjectPath> {
        self.entry()?;
        Ok(claim_path_of(self.objects.view.holder(self.address)))
    }

    /// Puts the device in `mode` ("pf" or "vf"). Options: `num_vfs` u (mode vf only; absent
    /// or 0 = as many as the configuration or the device allows). Returns the task once it is
    /// prepared; it reports progress as it runs. Refused with Busy when a task holds the device,
    /// NotManaged, Protected, InUse, or InvalidArgument (an unknown option included).
    async fn set_mode(
        &self,
        mode: &str,
        options: Dict,
        #[zbus(header)] header: zbus::message::Header<'_>,
        #[zbus(connection)] conn: &zbus::Connection,
    ) -> Result<zbus::OwnedObjectPath, Error> {
        use crate::mode::policy::{Target, VFIO_PCI};
        let num_vfs = Query::new(options, SET_MODE_OPTIONS)?
            .u32("num_vfs")?
            .unwrap_or(0);
        let settings = self.objects.engine.settings();
        let d = self.device()?;
        let rule = settings.rule_for(d.address, d.vendor_id, d.device_id, d.class);
        let target = match mode {
            "pf" => {
                if num_vfs != 0 {
                    return Err(Error::InvalidArgument(
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
                return Err(Error::InvalidArgument(format!(
                    "mode must be pf or vf, not {}",
                    super::error::quote(other)
                )));
            }
        };
        let check = Check::set_mode(self.address, &target);
        let job = ModeJob::new(self.address, Some(target));
        self.start(Box::new(job), check, &header, conn).await
    }

    /// Brings the device to the mode its policy says (what vfiod does at start and on reload).
    async fn apply(
        &self,
        #[zbus(header)] header: zbus::message::Header<'_>,
        #[zbus(connection)] conn: &zbus::Connection,
    ) -> Result<zbus::OwnedObjectPath, Error> {
        let job = ModeJob::new(self.address, None);
        let check = Check::on_device(ACTION_MODE, "Apply", self.address);
        self.start(Box::new(job), check, &header, conn).await
    }

    /// Writes catalog image `image` into the FPGA as a `program` task (phases download, write,
    /// verify); replies with the task once it is prepared, or with the refusal: an image that
    /// is not legal for the device (InvalidArgument saying why), Busy, InUse (a claimed VF of
    /// a card in VF mode). Options: none yet (an unknown key is InvalidArgument). Authorized as
    /// `org.vfiod.vfiod1.program`.
    async fn program(
        &self,
        image: &str,
        options: Dict,
        #[zbus(header)] header: zbus::message::Header<'_>,
        #[zbus(connection)] conn: &zbus::Connection,
    ) -> Result<zbus::OwnedObjectPath, Error> {
        Query::new(options, NO_OPTIONS)?;
        let check =
            Check::on_device(ACTION_PROGRAM, "Program", self.address).with(Detail::Image, image);
        let job = FpgaJob::program(self.address, image);
        self.start(Box::new(job), check, &header, conn).await
    }

    /// Checks what the FPGA reports (its port's AFU id) against image `image`, as a `verify`
    /// task. Options: none yet (an unknown key is InvalidArgument). Authorized as
    /// `org.vfiod.vfiod1.program`.
    async fn verify(
        &self,
        image: &str,
        options: Dict,
        #[zbus(header)] header: zbus::message::Header<'_>,
        #[zbus(connection)] conn: &zbus::Connection,
    ) -> Result<zbus::OwnedObjectPath, Error> {
        Query::new(options, NO_OPTIONS)?;
        let check =
            Check::on_device(ACTION_PROGRAM, "Verify", self.address).with(Detail::Image, image);
        let job = FpgaJob::verify(self.address, image);
        self.start(Box::new(job), check, &header, conn).await
    }

    /// Clears a task left in error, after the operator has looked at the device; recorded with
    /// the caller's identity.
    async fn reset_task(
        &self,
        #[zbus(header)] header: zbus::message::Header<'_>,
        #[zbus(connection)] conn: &zbus::Connection,
    ) -> Result<(), Error> {
        let o = &self.objects;
        let kind = self.entry()?.task.map(|t| t.kind);
        o.authorizer
            .check(conn, &header, &Check::reset_task(self.address, kind))
            .await?;
        let who = o.requesters.of(conn, &header).await;
        o.engine.reset_task(self.address, &who).await?;
        o.engine.flush().await;
        Ok(())
    }
}

/// A VF's PF as an object path (a device is always one); `/` for no PF.
fn parent_pf_path(pf: Option<crate::model::pci::PciAddress>) -> zbus::OwnedObjectPath {
    pf.map(super::device_path)
        .unwrap_or_else(|| zbus::OwnedObjectPath::try_from("/").expect("valid object path"))
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
