//! `org.vfiod.Vfiod1.Device`: one object per PCI function, named like libvirt's node devices.

use crate::device::Device;
use std::collections::HashMap;
use zbus::interface;
use zbus::{OwnedVariant, Variant};

pub const INTERFACE: &str = "org.vfiod.Vfiod1.Device";

/// The D-Bus face of a device record (a snapshot of the store's row).
pub struct DeviceObject {
    pub device: Device,
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Kind, Mode, Role, State};
    use crate::pci::ClassCode;

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
