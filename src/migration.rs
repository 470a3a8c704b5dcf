//! Live migration of VMs with passthrough devices, decided: whether a device can go with its VM
//! (`Migratable`), what vfiod writes in a domain's `<metadata>` so that the destination knows
//! what the VM had, and what the destination claims for it. Pure; the migrate job
//! (`engine::job::migrate`) and the `migrate` hook act on it.
//!
//! A function whose driver has no VFIO migration support cannot be live-migrated as it is
//! (QEMU refuses), so vfiod detaches it before the migration, the destination claims an
//! equivalent device of its own and attaches it once the VM runs there, and the source
//! reattaches it if the migration fails. A function on a VFIO variant driver with migration
//! support (mlx5_vfio_pci, hisi_acc_vfio_pci, ...) stays attached and moves with the VM.

use crate::claim::Requirements;
use crate::model::device::{Device, Role, State};
use serde::Serialize;

/// What happens to a device when its VM is live-migrated (`Device.Migratable`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Migratable {
    /// Its driver migrates its state: it stays attached and moves with the VM.
    Yes,
    /// vfiod detaches it before and attaches an equivalent device on the destination.
    Detach,
    /// vfiod cannot carry it: not managed, broken or protected.
    No,
}

impl Migratable {
    pub fn as_str(self) -> &'static str {
        match self {
            Migratable::Yes => "yes",
            Migratable::Detach => "detach",
            Migratable::No => "no",
        }
    }
}

/// Whether a driver is a VFIO variant driver (vfio-pci plus the device's own migration
/// support): the kernel names them `<vendor>_vfio_pci`. Plain `vfio-pci` migrates nothing.
pub fn is_vfio_variant(driver: &str) -> bool {
    driver != "vfio-pci" && (driver.ends_with("_vfio_pci") || driver.ends_with("-vfio-pci"))
}

/// What a live migration does to `device`. Pure.
pub fn migratable(device: &Device) -> Migratable {
    if !device.managed || device.state != State::Usable {
        return Migratable::No;
    }
    match device.driver.as_deref() {
        Some(d) if is_vfio_variant(d) => Migratable::Yes,
        _ => Migratable::Detach,
    }
}

/// What the destination asks of its own devices for one the VM had: the same kind, vendor and
/// device id, and role (a VF for a VF). Pure.
pub fn requirements_for(kind: &str, id: &str, role: &str) -> Result<Requirements, String> {
    let kind = kind
        .parse()
        .map_err(|_| format!("unknown device kind {kind:?}"))?;
    let id = crate::config::parse_id(id).map_err(|e| format!("device id {id:?}: {e}"))?;
    let role: Role = role
        .parse()
        .map_err(|_| format!("unknown device role {role:?}"))?;
    Ok(Requirements {
        kind: Some(kind),
        id: Some(id),
        role: Some(role),
        ..Requirements::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variant_drivers_migrate_and_plain_vfio_pci_does_not() {
        assert!(is_vfio_variant("mlx5_vfio_pci"));
        assert!(is_vfio_variant("hisi_acc_vfio_pci"));
        assert!(!is_vfio_variant("vfio-pci"));
        assert!(!is_vfio_variant("nvme"));
    }

    #[test]
    fn destination_requirements() {
        let r = requirements_for("nvme", "1b36:0010", "vf").unwrap();
        assert_eq!(r.kind, Some(crate::model::device::Kind::Nvme));
        assert_eq!(r.id, Some((0x1b36, Some(0x0010))));
        assert_eq!(r.role, Some(Role::Vf));
        assert!(requirements_for("toaster", "1b36:0010", "vf")
            .unwrap_err()
            .contains("toaster"));
        assert!(requirements_for("nvme", "zz", "vf").is_err());
        assert!(requirements_for("nvme", "1b36:0010", "both").is_err());
    }
}
