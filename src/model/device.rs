//! The device record: everything vfiod knows about one PCI function, as the inventory builds it,
//! the store keeps it and the D-Bus API shows it.

use crate::model::pci::{ClassCode, PciAddress};
use crate::model::text::text_enum;
use serde::{Deserialize, Serialize};

/// What kind of accelerator a function is, from its class code unless config overrides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Gpu,
    Fpga,
    Crypto,
    Nvme,
    Nic,
    Other,
}

/// Where a function sits in SR-IOV terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// SR-IOV capable physical function.
    Pf,
    /// Virtual function created by a PF.
    Vf,
    /// Function without SR-IOV (GPU, its audio function, a plain NVMe drive, bridges...).
    Function,
}

/// Current mode of a device. Only PFs can be in VF mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Used whole: no VFs enabled (or a function that cannot split at all).
    Pf,
    /// Split: `sriov_numvfs` > 0.
    Vf,
    /// A VF itself: it has no mode of its own.
    None,
}

/// Whether a device may be used. Ordered by severity: a broken device is never usable, whatever
/// else holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Usable,
    /// The host itself uses it (boot disk, an interface that is up, listed in `protected`), or it
    /// shares an IOMMU group with such a device: vfiod never touches it.
    Protected,
    /// Its information can no longer be read completely, or its config space reads all-ones;
    /// or a clean found it unhealthy and quarantined it until an operator clears it.
    Broken,
    /// A claim on it ended and it is being cleaned (reset, health check, the operator's
    /// command): out of the pool until that succeeds.
    Cleaning,
}

text_enum!(Kind, Gpu => "gpu", Fpga => "fpga", Crypto => "crypto", Nvme => "nvme", Nic => "nic", Other => "other");
text_enum!(Role, Pf => "pf", Vf => "vf", Function => "function");
text_enum!(Mode, Pf => "pf", Vf => "vf", None => "none");
text_enum!(State, Usable => "usable", Protected => "protected", Broken => "broken", Cleaning => "cleaning");

/// One PCI function as the inventory last saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Device {
    pub address: PciAddress,
    pub vendor_id: u16,
    pub device_id: u16,
    pub subsystem_vendor_id: u16,
    pub subsystem_device_id: u16,
    pub revision: u8,
    pub class: ClassCode,
    /// Names from the pci.ids database; empty when the id is unknown.
    pub vendor_name: String,
    pub device_name: String,
    pub kind: Kind,
    /// Bound driver, if any.
    pub driver: Option<String>,
    /// `driver_override` when set.
    pub driver_override: Option<String>,
    /// NUMA node; `None` when the platform has none (sysfs shows -1).
    pub numa_node: Option<i32>,
    pub iommu_group: Option<u32>,
    pub role: Role,
    /// SR-IOV capable (`sriov_totalvfs` present and > 0).
    pub separable: bool,
    pub mode: Mode,
    pub total_vfs: u32,
    pub num_vfs: u32,
    /// For a VF, its PF.
    pub parent_pf: Option<PciAddress>,
    /// Selected by the config's `[[select]]` rules (a VF also when its PF is) and not
    /// protected: vfiod may change it. See [`crate::inventory::is_managed`].
    pub managed: bool,
    pub state: State,
    /// Why the state is not `usable` (empty when usable).
    pub state_reason: String,
}

impl Device {
    pub fn object_name(&self) -> String {
        self.address.nodedev_name()
    }

    /// A usable, managed function at `address` (an Intel NIC's VF on vfio-pci, not split), for
    /// unit tests to change the fields they are about.
    #[cfg(test)]
    pub(crate) fn example(address: &str) -> Device {
        Device {
            address: address.parse().unwrap(),
            vendor_id: 0x8086,
            device_id: 0x154c,
            subsystem_vendor_id: 0,
            subsystem_device_id: 0,
            revision: 1,
            class: ClassCode(0x020000),
            vendor_name: "Intel".into(),
            device_name: "X710 VF".into(),
            kind: Kind::Nic,
            driver: Some("vfio-pci".into()),
            driver_override: None,
            numa_node: Some(0),
            iommu_group: Some(40),
            role: Role::Function,
            separable: false,
            mode: Mode::Pf,
            total_vfs: 0,
            num_vfs: 0,
            parent_pf: None,
            managed: true,
            state: State::Usable,
            state_reason: String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_round_trip_as_text() {
        for k in [
            Kind::Gpu,
            Kind::Fpga,
            Kind::Crypto,
            Kind::Nvme,
            Kind::Nic,
            Kind::Other,
        ] {
            assert_eq!(k.as_str().parse::<Kind>().unwrap(), k);
        }
        for s in [
            State::Usable,
            State::Protected,
            State::Broken,
            State::Cleaning,
        ] {
            assert_eq!(s.as_str().parse::<State>().unwrap(), s);
        }
        let err = "gpgpu".parse::<Kind>().unwrap_err();
        assert!(err.contains("gpu, fpga"), "{err}");
    }
}
