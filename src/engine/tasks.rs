//! The task engine: long device operations (split, restore, rebind, bind) run as tasks, one at
//! a time per device, with a durable, visible state (prepare -> running -> success | error).
//!
//! [`prepare`] validates a request and creates the task row (refused with Busy when the device
//! is not idle); [`run`] executes the plan with progress, verification and rollback, and records
//! the outcome. Both block (sysfs, SQLite): call them off the async threads.

use crate::engine::Engine;
use crate::host::sysfs::hostuse;
use crate::model::device::{Role, State};
use crate::model::pci::PciAddress;
use crate::modes::convert::{self};
use crate::modes::plan::{Plan, Snapshot, Step, SysPath};
use crate::modes::planner::{self, ModeError};
use crate::modes::policy::{self, Decision, Program, Target};
use crate::store::{StoreError, TaskRecord};

#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    #[error("no PCI function {0} is known")]
    NoSuchDevice(PciAddress),
    #[error("{address} is protected: {reason}")]
    Protected { address: PciAddress, reason: String },
    #[error("{0} is not selected by the configuration ([[select]]); vfiod does not change it")]
    NotManaged(PciAddress),
    #[error("{address}: {reason}")]
    Refused { address: PciAddress, reason: String },
    /// A VM has the device (or one of its functions): claimed or attached, or its VFIO group is
    /// open.
    #[error("{address} is in use: {}", .users.join("; "))]
    InUse {
        address: PciAddress,
        users: Vec<String>,
    },
    /// libvirt could not say which running domains use the device; nothing is changed without
    /// that answer.
    #[error("{address}: cannot check which running domains use it (set libvirt_uri = \"\" to skip this check)")]
    Libvirt {
        address: PciAddress,
        #[source]
        source: crate::host::libvirt::LibvirtError,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Mode(#[from] ModeError),
}

impl TaskError {
    pub fn is_busy(&self) -> bool {
        matches!(self, TaskError::Store(StoreError::Busy { .. }))
    }
}

/// A validated request with its task row, ready to run.
#[derive(Debug)]
pub struct Prepared {
    pub task: TaskRecord,
    pub program: Program,
    pub plan: Option<Plan>,
    pub before: Snapshot,
}

fn program_name(p: &Program) -> &'static str {
    match p {
        Program::Nothing => "check",
        Program::Split { .. } => "split",
        Program::Restore => "restore",
        Program::Resplit { .. } => "resplit",
        Program::RebindVfs => "rebind",
        Program::Bind { .. } => "bind",
        Program::Unbind => "unbind",
    }
}

/// Validates a mode request for `address` (`target: None` = the policy's target) and creates
/// its task in `prepare`. Nothing is written to the device here.
pub fn prepare(
    engine: &Engine,
    address: PciAddress,
    target: Option<Target>,
    requested_by: &str,
) -> Result<Prepared, TaskError> {
    let store = engine.store();
    let settings = engine.settings();
    let device = store
        .device(address)?
        .ok_or(TaskError::NoSuchDevice(address))?;
    let refuse = |reason: String| TaskError::Refused { address, reason };
    match device.state {
        State::Protected => {
            return Err(TaskError::Protected {
                address,
                reason: device.state_reason.clone(),
            })
        }
        State::Broken => return Err(refuse(format!("broken: {}", device.state_reason))),
        State::Usable => {}
    }
    if device.role == Role::Vf {
        return Err(refuse(format!(
            "a VF follows its PF; change the mode of {}",
            device.parent_pf.map(|p| p.to_string()).unwrap_or_default()
        )));
    }
    if !device.managed {
        return Err(TaskError::NotManaged(address));
    }
    let target = match target {
        Some(t) => {
            if matches!(t, Target::Vf { .. }) && !device.separable {
                return Err(refuse(
                    "non-separable (no SR-IOV): it can only be used whole (PF mode)".into(),
                ));
            }
            if let Target::Vf { num_vfs, .. } = &t {
                if *num_vfs == 0 || *num_vfs > device.total_vfs {
                    return Err(refuse(format!(
                        "num_vfs {num_vfs} is outside 1..={}",
                        device.total_vfs
                    )));
                }
            }
            t
        }
        None => {
            let rule = settings.rule_for(address, device.vendor_id, device.device_id, device.class);
            match policy::decide(&device, rule, settings.scenario) {
                Decision::Target { target, .. } => target,
                Decision::Leave { reason } | Decision::Refuse { reason } => {
                    return Err(refuse(reason))
                }
            }
        }
    };
    let (program, plan, before) = planner::plan_to(engine.sysfs(), store, &device, &target)?;
    if let Some(plan) = &plan {
        let users = in_use(engine, plan, &before)?;
        if !users.is_empty() {
            return Err(TaskError::InUse { address, users });
        }
    }
    let params = serde_json::to_string(&target).unwrap_or_else(|_| "{}".into());
    let task = store.create_task_covering(
        address,
        &scope(&before),
        program_name(&program),
        &params,
        requested_by,
    )?;
    Ok(Prepared {
        task,
        program,
        plan,
        before,
    })
}

/// The functions besides its own device that a task may rebind: the endpoints of its IOMMU
/// group (a GPU's task moves its audio function). A PF's VFs need no entry: they cannot have
/// tasks of their own, and the store finds a VF's blocking task through its PF.
fn scope(before: &Snapshot) -> Vec<PciAddress> {
    before.group.iter().map(|b| b.address).collect()
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

/// Who uses the functions `plan` would unbind or destroy: claims in the store (claimed or
/// attached to a VM), running libvirt domains they are assigned to, and processes holding their
/// VFIO group open (a running VM's QEMU, libvirt's or not). Never take a device away from a
/// running VM.
fn in_use(engine: &Engine, plan: &Plan, before: &Snapshot) -> Result<Vec<String>, TaskError> {
    let sysfs = engine.sysfs();
    let touched = touched(plan, before);
    let mut users: Vec<String> = engine
        .store()
        .active_claims(&touched)?
        .into_iter()
        .map(|(a, vm)| format!("{a} is claimed by VM {vm}"))
        .collect();
    // Only functions on vfio-pci can have a VFIO group open; two link reads each, not a whole
    // read_function (a restore touches 65 functions).
    let mut groups = Vec::new();
    for a in &touched {
        let link = |attr| sysfs.read_optional_link_name(&sysfs.device_attr(*a, attr));
        if let (Ok(Some(driver)), Ok(Some(group))) = (link("driver"), link("iommu_group")) {
            if let (Ok(g), "vfio-pci") = (group.parse::<u32>(), driver.as_str()) {
                if !groups.contains(&g) {
                    groups.push(g);
                }
            }
        }
    }
    for (g, procs) in hostuse::vfio_users(sysfs, &groups) {
        users.push(format!("IOMMU group {g} is open by {}", procs.join(", ")));
    }
    if let Some(uri) = &engine.settings().libvirt_uri {
        let domains =
            crate::host::libvirt::running_domains(uri, sysfs.root()).map_err(|source| {
                TaskError::Libvirt {
                    address: plan.device,
                    source,
                }
            })?;
        for d in domains {
            for f in d.functions.iter().filter(|f| touched.contains(f)) {
                users.push(format!("{f} is assigned to running domain {}", d.domain));
            }
        }
    }
    Ok(users)
}

/// Loads (with modprobe) every driver the plan binds to that the kernel does not have yet. Only
/// on the real kernel (sysfs root `/`); the simulated kernel has its drivers.
fn ensure_drivers(engine: &Engine, plan: &Plan) -> Result<(), String> {
    let sysfs = engine.sysfs();
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
    for d in wanted {
        if sysfs.driver_dir(d).exists() {
            continue;
        }
        if sysfs.root() != std::path::Path::new("/") {
            return Err(format!("driver {d} is not loaded"));
        }
        // Module names use underscores where driver names may use dashes (vfio-pci: vfio_pci);
        // modprobe accepts either.
        let out = std::process::Command::new("modprobe")
            .arg("--")
            .arg(d)
            .output()
            .map_err(|e| format!("driver {d} is not loaded and modprobe could not run: {e}"))?;
        if !out.status.success() || !sysfs.driver_dir(d).exists() {
            return Err(format!(
                "driver {d} is not loaded and `modprobe {d}` did not load it: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        tracing::info!("loaded kernel module for driver {d}");
    }
    Ok(())
}

/// Runs a prepared task to its end and returns the final record. `notify(id)` is called after
/// each recorded change (the D-Bus layer publishes it).
pub fn run(
    engine: &Engine,
    prepared: Prepared,
    notify: &(dyn Fn(i64) + Sync),
) -> Result<TaskRecord, StoreError> {
    let store = engine.store();
    let sysfs = engine.sysfs();
    let id = prepared.task.id;
    let address = prepared.task.address;
    store.task_progress(id, "checking that nothing uses the device", 0)?;
    notify(id);
    let Some(plan) = prepared.plan else {
        let t = store.task_succeeded(
            id,
            &format!("{address} is already in the requested mode: unchanged"),
        )?;
        notify(id);
        return Ok(t);
    };

    // Checked again here: a VM may have started between the request and now.
    let users = match in_use(engine, &plan, &prepared.before) {
        Ok(users) => users,
        Err(TaskError::Store(e)) => return Err(e),
        Err(other) => {
            let why = crate::error_chain(&other);
            let t = store.task_failed(id, &format!("refused: {why}; nothing was changed"))?;
            notify(id);
            return Ok(t);
        }
    };
    if !users.is_empty() {
        let t = store.task_failed(
            id,
            &format!(
                "refused: {address} is in use ({}); nothing was changed",
                users.join("; ")
            ),
        )?;
        notify(id);
        return Ok(t);
    }

    // The drivers the plan binds to must be loaded: drivers_probe never loads a module, so a
    // missing vfio-pci would only show up as a failed bind half-way through the program.
    if let Err(why) = ensure_drivers(engine, &plan) {
        let t = store.task_failed(id, &format!("refused: {why}; nothing was changed"))?;
        notify(id);
        return Ok(t);
    }

    // Remember what each function was bound to before vfiod first changed it.
    for b in group_and_pf(&prepared.before) {
        store.remember_original_driver(b.address, b.driver.as_deref())?;
    }

    // convert reports the first step and then at most every 100 ms: one commit each.
    let mut progress = |done: usize, total: usize, step: &Step| {
        let pct = ((done * 100) / total.max(1)).min(99) as u8;
        if store.task_progress(id, &step.to_string(), pct).is_ok() {
            notify(id);
        }
    };
    let result = convert::apply(sysfs, &plan, &prepared.before, &mut progress);
    let t = match result {
        Ok(()) => {
            if matches!(prepared.program, Program::Restore | Program::Unbind) {
                for b in group_and_pf(&prepared.before) {
                    store.forget_original_driver(b.address)?;
                }
            }
            store.task_succeeded(id, &success_message(&prepared.program, address))?
        }
        Err(failed) => store.task_failed(id, &crate::error_chain(&*failed))?,
    };
    notify(id);
    Ok(t)
}

/// The functions whose driver a program may change: the IOMMU group's endpoints and the PF
/// (which is one of them whenever it has an IOMMU group), each once.
fn group_and_pf(before: &Snapshot) -> impl Iterator<Item = &crate::modes::plan::Binding> {
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
