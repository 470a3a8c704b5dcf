//! Runs plans against the kernel: each write is read back, each step reports progress, a
//! failure stops the program and the caller rolls back with [`crate::mode::plan::rollback`].
//! Blocking (sysfs); call it off the async threads.

use crate::host::sysfs::{Sysfs, SysfsError};
use crate::mode::plan::{Binding, Plan, Snapshot, Step, SysPath};
use crate::model::pci::PciAddress;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a running program reports its progress, at most.
pub const PROGRESS_EVERY: Duration = Duration::from_millis(100);

/// How long VFs may take to appear or go after an `sriov_numvfs` write.
pub const VF_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("step {index} `{step}` failed")]
    Sysfs {
        index: usize,
        step: String,
        #[source]
        source: SysfsError,
    },
    #[error("step {index} `{step}`: {problem}")]
    Verify {
        index: usize,
        step: String,
        problem: String,
    },
    #[error("cannot read the current state of {address}")]
    Snapshot {
        address: PciAddress,
        #[source]
        source: SysfsError,
    },
}

impl ConvertError {
    /// The errno behind the failure, if the kernel refused a write.
    pub fn errno(&self) -> Option<i32> {
        match self {
            ConvertError::Sysfs { source, .. } | ConvertError::Snapshot { source, .. } => {
                source.errno()
            }
            ConvertError::Verify { .. } => None,
        }
    }
}

pub fn binding(sysfs: &Sysfs, address: PciAddress) -> Result<Binding, SysfsError> {
    let driver = sysfs.read_optional_link_name(&sysfs.device_attr(address, "driver"))?;
    let driver_override = match sysfs.read_text(&sysfs.device_attr(address, "driver_override")) {
        Ok(t) if t.is_empty() || t == "(null)" => None,
        Ok(t) => Some(t),
        Err(e) if e.is_not_found() => None,
        Err(e) => return Err(e),
    };
    Ok(Binding {
        address,
        driver,
        driver_override,
    })
}

/// The device's state as the kernel shows it now: the input of plans and rollbacks.
pub fn snapshot(
    sysfs: &Sysfs,
    pf: PciAddress,
    original_drivers: BTreeMap<PciAddress, Option<String>>,
) -> Result<Snapshot, ConvertError> {
    let wrap = |source| ConvertError::Snapshot {
        address: pf,
        source,
    };
    let raw = sysfs.read_function(pf).map_err(wrap)?;
    let pf_binding = binding(sysfs, pf).map_err(wrap)?;
    let (num_vfs, autoprobe, vf_offset, vf_stride, vf_addrs) = match &raw.sriov {
        Some(s) => (
            s.num_vfs,
            Some(s.drivers_autoprobe),
            s.vf_offset,
            s.vf_stride,
            s.vfs.clone(),
        ),
        None => (0, None, None, None, Vec::new()),
    };
    let mut vfs = Vec::with_capacity(vf_addrs.len());
    for v in vf_addrs {
        vfs.push(binding(sysfs, v).map_err(wrap)?);
    }
    let mut group = Vec::new();
    match raw.iommu_group {
        Some(g) => {
            for m in sysfs.iommu_group_members(g).map_err(wrap)? {
                let r = sysfs.read_function(m).map_err(wrap)?;
                if !r.class.is_bridge() {
                    group.push(binding(sysfs, m).map_err(wrap)?);
                }
            }
        }
        None => group.push(pf_binding.clone()),
    }
    Ok(Snapshot {
        pf: pf_binding,
        num_vfs,
        autoprobe,
        vf_offset,
        vf_stride,
        vfs,
        group,
        original_drivers,
    })
}

fn read_back(sysfs: &Sysfs, path: &SysPath, value: &str) -> Result<Option<String>, SysfsError> {
    let SysPath::Device { address, attr } = path else {
        return Ok(None);
    };
    let got = sysfs.read_text(&sysfs.device_attr(*address, attr))?;
    let want = match attr.as_str() {
        "driver_override" if value.trim().is_empty() => "(null)".to_string(),
        "sriov_numvfs" | "sriov_drivers_autoprobe" | "driver_override" => value.trim().to_string(),
        _ => return Ok(None),
    };
    Ok(
        (got != want && !(attr == "driver_override" && got.is_empty() && want == "(null)"))
            .then(|| format!("{attr} reads {got:?} after writing {want:?}")),
    )
}

/// Polls until the PF shows `count` VFs: `sriov_numvfs` says so and each `virtfnN` link leads
/// to a device directory (one stat per VF through its link). Only what the steps after it need:
/// a poll that re-read the whole PF would cost more than the writes it waits for.
fn wait_vfs(sysfs: &Sysfs, pf: PciAddress, count: u32) -> Result<Option<String>, SysfsError> {
    let deadline = Instant::now() + VF_WAIT;
    let numvfs = sysfs.device_attr(pf, "sriov_numvfs");
    loop {
        let n: u32 = match sysfs.read_text(&numvfs) {
            Ok(t) => t.parse().map_err(|_| SysfsError::Parse {
                path: numvfs.clone(),
                value: t.clone(),
                reason: "not a number".into(),
            })?,
            // A PF without SR-IOV (or one that went away) shows no VFs.
            Err(e) if e.is_not_found() && count == 0 => 0,
            Err(e) => return Err(e),
        };
        let links = (0..count.max(n))
            .take_while(|i| {
                sysfs
                    .device_attr(pf, &format!("virtfn{i}"))
                    .metadata()
                    .is_ok()
            })
            .count() as u32;
        if n == count && links == count {
            return Ok(None);
        }
        if Instant::now() >= deadline {
            return Ok(Some(format!(
                "{pf} shows {n} VFs ({links} present) after {VF_WAIT:?}, expected {count}"
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `plan` step by step. `progress(done, total, step)` is called before each step.
pub fn execute(
    sysfs: &Sysfs,
    plan: &Plan,
    progress: &mut dyn FnMut(usize, usize, &Step),
) -> Result<(), ConvertError> {
    let total = plan.steps.len();
    for (index, step) in plan.steps.iter().enumerate() {
        progress(index, total, step);
        let fail = |source| ConvertError::Sysfs {
            index,
            step: step.to_string(),
            source,
        };
        let problem = match step {
            Step::Write { path, value } => {
                sysfs.write(&path.resolve(sysfs), value).map_err(fail)?;
                match path {
                    SysPath::Driver { driver, attr } if attr == "unbind" => {
                        let a: PciAddress =
                            value.trim().parse().map_err(|_| ConvertError::Verify {
                                index,
                                step: step.to_string(),
                                problem: "not an address".into(),
                            })?;
                        let now = sysfs
                            .read_optional_link_name(&sysfs.device_attr(a, "driver"))
                            .map_err(fail)?;
                        (now.as_deref() == Some(driver.as_str()))
                            .then(|| format!("{a} is still bound to {driver}"))
                    }
                    _ => read_back(sysfs, path, value).map_err(fail)?,
                }
            }
            Step::WaitVfs { pf, count } => wait_vfs(sysfs, *pf, *count).map_err(fail)?,
            Step::ExpectDriver { address, driver } => {
                let now = sysfs
                    .read_optional_link_name(&sysfs.device_attr(*address, "driver"))
                    .map_err(fail)?;
                (now != *driver).then(|| {
                    format!(
                        "{address} is bound to {}, expected {}",
                        now.as_deref().unwrap_or("no driver"),
                        driver.as_deref().unwrap_or("no driver")
                    )
                })
            }
        };
        if let Some(problem) = problem {
            return Err(ConvertError::Verify {
                index,
                step: step.to_string(),
                problem,
            });
        }
    }
    progress(
        total,
        total,
        plan.steps.last().unwrap_or(&Step::WaitVfs {
            pf: plan.device,
            count: 0,
        }),
    );
    Ok(())
}

/// A program that failed, and what its rollback did.
#[derive(Debug, thiserror::Error)]
#[error("{error}; rollback {}", match .rollback { Ok(()) => "restored the previous state".to_string(), Err(e) => format!("failed too: {}", crate::error_chain(e)) })]
pub struct Failed {
    #[source]
    pub error: ConvertError,
    pub rollback: Result<(), ConvertError>,
}

/// Runs `plan` as one bounded job on the sysfs writer thread (see [`Sysfs::run_bounded`]). No
/// rollback: the caller decides ([`roll_back`], or [`apply`] for both).
///
/// `progress(done, total, step)` runs on the caller's thread at the first step, then at most
/// every [`PROGRESS_EVERY`], and at the end: each report crosses threads and is recorded, and a
/// progress bar needs no more. A slow step is reported as soon as the one before it ends.
pub fn run(
    sysfs: &Sysfs,
    plan: &Plan,
    progress: &mut dyn FnMut(usize, usize, &Step),
) -> Result<(), ConvertError> {
    let owned = plan.clone();
    // The step running on the writer thread, to name the one a timed-out write belongs to.
    let current = Arc::new(AtomicUsize::new(0));
    let at = Arc::clone(&current);
    let outcome = sysfs.run_bounded(
        move |inline: &Sysfs, post: &dyn Fn((usize, usize))| {
            let mut reported: Option<Instant> = None;
            execute(inline, &owned, &mut |done, total, _| {
                at.store(done, Ordering::Relaxed);
                if done == total || reported.is_none_or(|t| t.elapsed() >= PROGRESS_EVERY) {
                    reported = Some(Instant::now());
                    post((done, total));
                }
                test_hook::stop_at(done);
            })
        },
        &mut |(done, total)| {
            let step = plan.steps.get(done).or(plan.steps.last());
            if let Some(step) = step {
                progress(done, total, step);
            }
        },
    );
    match outcome {
        Ok(result) => result,
        Err(source) => {
            let index = current.load(Ordering::Relaxed);
            Err(ConvertError::Sysfs {
                index,
                step: plan
                    .steps
                    .get(index)
                    .map(|s| s.to_string())
                    .unwrap_or_default(),
                source,
            })
        }
    }
}

/// Re-reads the device and runs the rollback plan back to `before`.
pub fn roll_back(sysfs: &Sysfs, device: PciAddress, before: &Snapshot) -> Result<(), ConvertError> {
    let now = snapshot(sysfs, device, before.original_drivers.clone())?;
    let back = crate::mode::plan::rollback(before, &now);
    execute(sysfs, &back, &mut |_, _, _| {})
}

/// [`run`], and on failure [`roll_back`] to `before`.
pub fn apply(
    sysfs: &Sysfs,
    plan: &Plan,
    before: &Snapshot,
    progress: &mut dyn FnMut(usize, usize, &Step),
) -> Result<(), Box<Failed>> {
    let Err(error) = run(sysfs, plan, progress) else {
        return Ok(());
    };
    tracing::warn!(
        device = %plan.device,
        "{}; rolling back",
        crate::error_chain(&error)
    );
    let rollback = roll_back(sysfs, plan.device, before);
    Err(Box::new(Failed { error, rollback }))
}

/// For the kill-9 test (`tests/kill/tasks.rs`), only in builds with the `test-hooks` feature:
/// `VFIOD_TEST_KILL_AT_STEP=k` makes the daemon kill itself (SIGKILL, no cleanup) just before step
/// k of a program. Release builds carry neither the code nor the variable's name.
#[cfg(feature = "test-hooks")]
mod test_hook {
    pub fn stop_at(step: usize) {
        static KILL_AT: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
        let at = KILL_AT.get_or_init(|| {
            std::env::var("VFIOD_TEST_KILL_AT_STEP")
                .ok()
                .and_then(|k| k.parse().ok())
        });
        if *at == Some(step) {
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        }
    }
}

#[cfg(not(feature = "test-hooks"))]
mod test_hook {
    #[inline(always)]
    pub fn stop_at(_step: usize) {}
}
