//! The mode job: bring a device to a mode (split into VFs, restore to PF mode, re-split, rebind
//! its VFs, bind or unbind its IOMMU group) by running the plan of sysfs writes that gets it
//! there, computed inside the task from the state it will change.

use super::guard;
use crate::engine::context::JobContext;
use crate::engine::job::{Admission, Job, JobError, JobFailure, Phase, Progress};
use crate::mode::convert;
use crate::mode::plan::{Binding, Plan, Snapshot, Step, SysPath};
use crate::mode::planner::{self, ModeError};
use crate::mode::policy::{self, Decision, Program, Target};
use crate::model::device::Role;
use crate::model::pci::PciAddress;
use crate::model::task::TaskKind;

/// The one phase of a mode job: a plan is many small writes, each a step.
const APPLY: Phase = Phase::new("apply plan", 100);

/// A request to bring `address` to a mode: an explicit target (`SetMode`) or the policy's
/// (`Apply`, reconcile at start-up and reload).
pub struct ModeJob {
    address: PciAddress,
    requested: Option<Target>,
    /// Decided by admit (the request, or the policy's answer).
    target: Option<Target>,
    /// Decided by prepare, from the state the task holds.
    prepared: Option<Prepared>,
}

struct Prepared {
    program: Program,
    plan: Option<Plan>,
    before: Snapshot,
}

impl ModeJob {
    /// `target: None` = the policy's target for the device.
    pub fn new(address: PciAddress, target: Option<Target>) -> ModeJob {
        ModeJob {
            address,
            requested: target,
            target: None,
            prepared: None,
        }
    }
}

/// The task kind of a program.
pub fn kind_of(program: &Program) -> TaskKind {
    match program {
        Program::Nothing => TaskKind::Check,
        Program::Split { .. } => TaskKind::Split,
        Program::Restore => TaskKind::Restore,
        Program::Resplit { .. } => TaskKind::Resplit,
        Program::RebindVfs => TaskKind::Rebind,
        Program::Bind { .. } => TaskKind::Bind,
        Program::Unbind => TaskKind::Unbind,
    }
}

fn mode_error(address: PciAddress, e: ModeError) -> JobError {
    match e {
        ModeError::NoSuchDevice(a) => JobError::NoSuchDevice(a),
        ModeError::Store(s) => JobError::Store(s),
        ModeError::Snapshot(source) => JobError::Hardware { address, source },
        ModeError::Plan { address, source } => JobError::Plan { address, source },
        // Only a preview scans; a job plans one device it already has.
        e @ ModeError::Scan(_) => JobError::Internal(crate::error_chain(&e)),
    }
}

impl Job for ModeJob {
    fn device(&self) -> PciAddress {
        self.address
    }

    fn admit(&mut self, cx: &JobContext) -> Result<Admission, JobError> {
        let address = self.address;
        let device = cx
            .store
            .device(address)?
            .ok_or(JobError::NoSuchDevice(address))?;
        let invalid = |reason: String| JobError::Invalid { address, reason };
        JobError::unless_usable(cx, &device)?;
        if device.role == Role::Vf {
            return Err(invalid(format!(
                "a VF follows its PF; change the mode of {}",
                device.parent_pf.map(|p| p.to_string()).unwrap_or_default()
            )));
        }
        if !device.managed {
            return Err(JobError::NotManaged(address));
        }
        let target = match &self.requested {
            Some(t) => {
                if let Target::Vf { num_vfs, .. } = t {
                    if !device.separable {
                        return Err(invalid(
                            "non-separable (no SR-IOV): it can only be used whole (PF mode)".into(),
                        ));
                    }
                    if *num_vfs == 0 || *num_vfs > device.total_vfs {
                        return Err(invalid(format!(
                            "num_vfs {num_vfs} is outside 1..={}",
                            device.total_vfs
                        )));
                    }
                    // Refused before a task exists: one would fail at its first write and stay
                    // failed until reset. (Prepare checks the kernel's state again.)
                    if device.num_vfs == 0 && device.driver.is_none() {
                        return Err(JobError::Unavailable {
                            address,
                            reason: format!(
                                "it has no driver bound, so it cannot be split {}",
                                crate::mode::policy::NO_PF_DRIVER
                            ),
                        });
                    }
                }
                t.clone()
            }
            None => {
                let s = &cx.settings;
                let rule = s.rule_for(address, device.vendor_id, device.device_id, device.class);
                match policy::decide(&device, rule, s.scenario) {
                    Decision::Target { target, .. } => target,
                    Decision::Leave { reason } | Decision::Refuse { reason } => {
                        return Err(invalid(reason))
                    }
                    Decision::Wait { reason, .. } => {
                        return Err(JobError::Unavailable { address, reason })
                    }
                }
            }
        };
        // The task holds the endpoints of the device's IOMMU group (a GPU's task moves its
        // audio function). A PF's VFs need no entry: the store keeps a PF's task and its VFs'
        // (a clean) from running at once through the inventory's record of which PF a VF has.
        let scope = match device.iommu_group {
            Some(g) => cx
                .store
                .devices()?
                .into_iter()
                .filter(|d| d.iommu_group == Some(g) && !d.class.is_bridge())
                .map(|d| d.address)
                .collect(),
            None => Vec::new(),
        };
        // The kind as the state looks now; prepare decides again once the task holds the device.
        let (program, plan, _) = planner::plan_to(&cx.sysfs, &cx.store, &device, &target)
            .map_err(|e| mode_error(address, e))?;
        if plan
            .as_ref()
            .is_some_and(|p| drivers_bound_to(p).contains(&crate::mode::policy::VFIO_PCI))
        {
            JobError::unless_iommu(cx, address)?;
        }
        let params = serde_json::to_value(&target).unwrap_or_else(|_| serde_json::json!({}));
        self.target = Some(target);
        Ok(Admission {
            kind: kind_of(&program),
            scope,
            params,
        })
    }

    fn prepare(&mut self, cx: &JobContext) -> Result<TaskKind, JobError> {
        let address = self.address;
        let target = self
            .target
            .clone()
            .ok_or_else(|| JobError::Internal("mode job prepared before it was admitted".into()))?;
        let device = cx
            .store
            .device(address)?
            .ok_or(JobError::NoSuchDevice(address))?;
        let (program, plan, before) = planner::plan_to(&cx.sysfs, &cx.store, &device, &target)
            .map_err(|e| mode_error(address, e))?;
        if let Some(plan) = &plan {
            // drivers_probe never loads a module: a missing vfio-pci would only show up as a
            // failed bind half-way through the program.
            for driver in drivers_bound_to(plan) {
                cx.modules
                    .ensure_loaded(&cx.sysfs, driver)
                    .map_err(|reason| JobError::Unavailable { address, reason })?;
            }
        }
        let kind = kind_of(&program);
        self.prepared = Some(Prepared {
            program,
            plan,
            before,
        });
        Ok(kind)
    }

    fn guard(&self, cx: &JobContext) -> Result<(), JobError> {
        let Some(Prepared {
            plan: Some(plan),
            before,
            ..
        }) = &self.prepared
        else {
            return Ok(());
        };
        // Whatever the plan would unbind or destroy: never from under a VM.
        let touched = touched(plan, before);
        guard::refuse_if_used(cx, self.address, &touched, guard::Allowed::default())
    }

    fn phases(&self) -> Vec<Phase> {
        vec![APPLY]
    }

    fn run(&mut self, cx: &JobContext, progress: &mut Progress<'_>) -> Result<String, JobFailure> {
        let address = self.address;
        let Some(prepared) = &self.prepared else {
            return Err(JobFailure::new("mode job run before it was prepared"));
        };
        let Some(plan) = &prepared.plan else {
            return Ok(format!(
                "{address} is already in the requested mode: unchanged"
            ));
        };
        // What each function was bound to before vfiod first changed it: restore puts it back.
        for b in group_and_pf(&prepared.before) {
            cx.store
                .remember_original_driver(b.address, b.driver.as_deref())
                .map_err(|e| JobFailure::from_error(&e))?;
        }
        convert::run(&cx.sysfs, plan, &mut |done, total, step| {
            progress.step(done, total, &step.to_string())
        })
        .map_err(|e| JobFailure::from_error(&e))?;
        if matches!(prepared.program, Program::Restore | Program::Unbind) {
            for b in group_and_pf(&prepared.before) {
                cx.store
                    .forget_original_driver(b.address)
                    .map_err(|e| JobFailure::from_error(&e))?;
            }
        }
        Ok(success_message(&prepared.program, address))
    }

    fn rollback(&mut self, cx: &JobContext) -> Result<String, JobFailure> {
        let Some(prepared) = &self.prepared else {
            return Ok("nothing to roll back".into());
        };
        convert::roll_back(&cx.sysfs, self.address, &prepared.before)
            .map(|()| "restored the previous state".to_string())
            .map_err(|e| JobFailure::from_error(&e))
    }
}

/// The drivers a plan binds functions to, each once.
fn drivers_bound_to(plan: &Plan) -> Vec<&str> {
    let mut wanted: Vec<&str> = Vec::new();
    for s in &plan.steps {
        if let Step::ExpectDriver {
            driver: Some(d), ..
        } = s
        {
            if !wanted.contains(&d.as_str()) {
                wanted.push(d);
            }
        }
    }
    wanted
}

/// Functions whose binding the plan changes or whose existence it ends.
fn touched(plan: &Plan, before: &Snapshot) -> Vec<PciAddress> {
    let mut out: Vec<PciAddress> = Vec::new();
    let mut add = |a: PciAddress| {
        if !out.contains(&a) {
            out.push(a)
        }
    };
    for s in &plan.steps {
        match s {
            Step::Write {
                path: SysPath::Device { address, attr },
                ..
            } if attr == "sriov_numvfs" => {
                add(*address);
                before.vfs.iter().for_each(|v| add(v.address));
            }
            Step::Write {
                path: SysPath::Driver { attr, .. },
                value,
            } if attr == "unbind" => {
                if let Ok(a) = value.trim().parse() {
                    add(a);
                }
            }
            _ => {}
        }
    }
    out
}

/// The functions whose driver a program may change: the IOMMU group's endpoints and the PF
/// (which is one of them whenever it has an IOMMU group), each once.
fn group_and_pf(before: &Snapshot) -> impl Iterator<Item = &Binding> {
    let pf_outside =
        (!before.group.iter().any(|b| b.address == before.pf.address)).then_some(&before.pf);
    before.group.iter().chain(pf_outside)
}

fn success_message(p: &Program, a: PciAddress) -> String {
    match p {
        Program::Split { num_vfs } => format!("{a} split into {num_vfs} VFs"),
        Program::Resplit { from, to } => format!("{a} re-split from {from} to {to} VFs"),
        Program::Restore => format!("{a} restored to PF mode"),
        Program::RebindVfs => format!("{a}: VFs rebound"),
        Program::Bind { driver } => format!("{a} and its IOMMU group bound to {driver}"),
        Program::Unbind => format!("{a} and its IOMMU group returned to their own drivers"),
        Program::Nothing => format!("{a} unchanged"),
    }
}
