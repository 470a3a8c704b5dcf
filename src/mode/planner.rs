//! Devices and their modes: the policy decision, the program and the plan for one device, from
//! the store's record, the settings and a live snapshot of sysfs. Used by `vfioctl plan` (a dry
//! run) and by the task engine (which runs the plan).

use crate::config::Settings;
use crate::host::sysfs::Sysfs;
use crate::mode::convert::{self, ConvertError};
use crate::mode::plan::{self, Plan, PlanError, Snapshot};
use crate::mode::policy::{self, Current, Decision, Program, Target};
use crate::model::device::{Device, Role};
use crate::model::pci::PciAddress;
use crate::store::{Store, StoreError};
use serde::Serialize;
use std::collections::BTreeMap;

/// Everything `vfioctl plan` shows for one device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DevicePlan {
    pub address: PciAddress,
    pub decision: Decision,
    pub program: Program,
    /// The writes, when there is something to do.
    pub plan: Option<Plan>,
}

#[derive(Debug, thiserror::Error)]
pub enum ModeError {
    #[error("no PCI function {0} is known")]
    NoSuchDevice(PciAddress),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Snapshot(#[from] ConvertError),
    #[error("cannot plan {address}")]
    Plan {
        address: PciAddress,
        #[source]
        source: PlanError,
    },
    /// Only [`plan_preview`], which reads the host again: its PCI bus could not be listed.
    #[error("cannot read the host's PCI functions")]
    Scan(#[from] crate::host::sysfs::SysfsError),
}

fn current_of(
    s: &Snapshot,
) -> (
    crate::model::device::Mode,
    Vec<Option<String>>,
    Vec<Option<String>>,
) {
    let mode = if s.num_vfs > 0 {
        crate::model::device::Mode::Vf
    } else {
        crate::model::device::Mode::Pf
    };
    (
        mode,
        s.vfs.iter().map(|v| v.driver.clone()).collect(),
        s.group.iter().map(|g| g.driver.clone()).collect(),
    )
}

/// The plan that takes `device` to `target` (an explicit request, or the policy's answer).
pub fn plan_to(
    sysfs: &Sysfs,
    store: &Store,
    device: &Device,
    target: &Target,
) -> Result<(Program, Option<Plan>, Snapshot), ModeError> {
    let originals = original_drivers(store, device)?;
    let snapshot = convert::snapshot(sysfs, device.address, originals)?;
    let (mode, vf_drivers, group_drivers) = current_of(&snapshot);
    let current = Current {
        mode,
        num_vfs: snapshot.num_vfs,
        vf_drivers: &vf_drivers,
        group_drivers: &group_drivers,
        returnable: snapshot.group.iter().any(|b| {
            snapshot
                .original_drivers
                .get(&b.address)
                .is_some_and(|orig| b.driver != *orig || b.driver_override.is_some())
        }),
    };
    let program = policy::program(&current, target);
    if program == Program::Nothing {
        return Ok((program, None, snapshot));
    }
    let vf_driver = match target {
        Target::Vf { vf_driver, .. } => vf_driver.as_str(),
        Target::Pf { .. } => policy::VFIO_PCI,
    };
    let plan = plan::build(&snapshot, &program, vf_driver).map_err(|source| ModeError::Plan {
        address: device.address,
        source,
    })?;
    Ok((program, Some(plan), snapshot))
}

/// Drivers recorded before vfiod first changed the device's functions (PF and group).
fn original_drivers(
    store: &Store,
    device: &Device,
) -> Result<BTreeMap<PciAddress, Option<String>>, ModeError> {
    let mut out = BTreeMap::new();
    for d in store.devices()? {
        if d.address == device.address
            || (d.iommu_group.is_some() && d.iommu_group == device.iommu_group)
        {
            if let Some(orig) = store.original_driver(d.address)? {
                out.insert(d.address, orig);
            }
        }
    }
    Ok(out)
}

/// The policy's plan for one device (a dry run: nothing is written).
pub fn plan_device(
    sysfs: &Sysfs,
    store: &Store,
    settings: &Settings,
    address: PciAddress,
) -> Result<DevicePlan, ModeError> {
    let device = store
        .device(address)?
        .ok_or(ModeError::NoSuchDevice(address))?;
    let rule = settings.rule_for(address, device.vendor_id, device.device_id, device.class);
    let decision = policy::decide(&device, rule, settings.scenario);
    let (program, plan) = match &decision {
        Decision::Target { target, .. } => match plan_to(sysfs, store, &device, target) {
            Ok((program, plan, _)) => (program, plan),
            // The record said it had a driver; the kernel says it has none now (unbound since
            // the last pass): it waits, as the policy would have said.
            Err(ModeError::Plan {
                source: e @ PlanError::NoPfDriver { .. },
                ..
            }) => {
                let decision = Decision::Wait {
                    target: target.clone(),
                    reason: e.to_string(),
                };
                return Ok(DevicePlan {
                    address,
                    decision,
                    program: Program::Nothing,
                    plan: None,
                });
            }
            Err(e) => return Err(e),
        },
        _ => (Program::Nothing, None),
    };
    Ok(DevicePlan {
        address,
        decision,
        program,
        plan,
    })
}

/// Plans for every device the configuration selects (VFs follow their PF and are skipped). A
/// device that goes away while the plans are made (a VF removed by a restore running beside it)
/// has no plan; it never spoils the others'.
pub fn plan_all(
    sysfs: &Sysfs,
    store: &Store,
    settings: &Settings,
) -> Result<Vec<DevicePlan>, ModeError> {
    let mut out = Vec::new();
    for d in store.devices()? {
        if d.role == Role::Vf
            || settings
                .rule_for(d.address, d.vendor_id, d.device_id, d.class)
                .is_none()
        {
            continue;
        }
        match plan_device(sysfs, store, settings, d.address) {
            Ok(p) => out.push(p),
            Err(ModeError::NoSuchDevice(_)) => {}
            Err(ModeError::Snapshot(e)) if e.errno() == Some(libc::ENOENT) => {
                tracing::debug!(device = %d.address, "gone while planning: {}", crate::error_chain(&e));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// What `settings`, a configuration that is not in force, would plan on this host now
/// (`vfioctl plan --config`). The host is read again under it, read-only, as the inventory
/// reads it, so that what it protects and selects is its own and not the running
/// configuration's; then each PF it selects is planned as [`plan_all`] plans one, against the
/// store's record of original drivers. Nothing is written.
pub fn plan_preview(
    sysfs: &Sysfs,
    store: &Store,
    settings: &Settings,
) -> Result<Vec<DevicePlan>, ModeError> {
    let previous: BTreeMap<PciAddress, Device> = store
        .devices()?
        .into_iter()
        .map(|d| (d.address, d))
        .collect();
    let mut out = Vec::new();
    for device in crate::inventory::scan(sysfs, settings, &previous)? {
        let rule = settings.rule_for(
            device.address,
            device.vendor_id,
            device.device_id,
            device.class,
        );
        if device.role == Role::Vf || rule.is_none() {
            continue;
        }
        let decision = policy::decide(&device, rule, settings.scenario);
        let (program, plan) = match &decision {
            Decision::Target { target, .. } => match plan_to(sysfs, store, &device, target) {
                Ok((program, plan, _)) => (program, plan),
                // Gone since the scan (a VF a restore beside it removed): as plan_all.
                Err(ModeError::Snapshot(e)) if e.errno() == Some(libc::ENOENT) => continue,
                Err(e) => return Err(e),
            },
            _ => (Program::Nothing, None),
        };
        out.push(DevicePlan {
            address: device.address,
            decision,
            program,
            plan,
        });
    }
    Ok(out)
}
