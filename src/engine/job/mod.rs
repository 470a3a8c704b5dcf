//! Jobs: the work a task runs. Every kind of device job (the ones in [`super::job`]: a mode
//! conversion, FPGA program and verify, a claim's attach and detach, a live migration)
//! implements one trait, and the task runner
//! ([`super::task`]) gives each the same life: one task at a time per device and scope, a
//! durable visible state (prepare, running, success, error), refusal before any change, progress
//! in weighted phases, rollback after a failure, error until an operator resets it.
//!
//! The order in which the runner calls a job:
//!
//! ```text
//!   admit    before the task exists: refuse from the records alone (no such device, not
//!            managed, protected, bad arguments); say what the task will hold (scope)
//!   ── the task row is created (Busy if the device or its scope is held) ──
//!   prepare  inside the task, which now holds its scope: read the state the job will change
//!            and decide the work from it (never from a state read before the task existed)
//!   guard    refuse before any change when someone uses what the job would take (a VM's
//!            claim, a running domain, an open VFIO group)
//!   ── a refusal in prepare or guard ends the task without holding the device ──
//!   run      the work, reporting progress through its declared phases
//!   rollback after a failed run: back to what prepare read
//! ```
//!
//! The kinds of job, one module each below (`clean`: a device between tenants). A new kind of job is a new module here that
//! implements [`Job`]; the engine needs no change.

pub mod attach;
pub mod clean;
pub mod detach;
pub mod guard;
pub mod migrate;
pub mod mode;
pub mod program;

pub use attach::AttachJob;
pub use clean::CleanJob;
pub use detach::DetachJob;
pub use migrate::MigrateJob;
pub use mode::ModeJob;
pub use program::FpgaJob;

/// For the crash tests (`tests/kill/claims.rs`), only in builds with the `test-hooks` feature:
/// `VFIOD_TEST_KILL_AT=<point>` makes the daemon kill itself (SIGKILL, no cleanup) when a job
/// reaches `point` ("attach:attaching", "attach:in-libvirt", "detach:asked", and for
/// `tests/kill/tasks.rs` "program:writing"; "program:downloading" before an image is downloaded
/// again). Release builds
/// carry neither the code nor the variable's name.
#[cfg(feature = "test-hooks")]
pub(crate) fn kill_point(point: &str) {
    if std::env::var("VFIOD_TEST_KILL_AT").is_ok_and(|p| p == point) {
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
}

#[cfg(not(feature = "test-hooks"))]
#[inline(always)]
pub(crate) fn kill_point(_point: &str) {}

/// For the tests of a race (`tests/simulated/hooks.rs`), only in builds with the `test-hooks`
/// feature: `VFIOD_TEST_PAUSE_AT=<point>` makes a job wait a second when it reaches `point`
/// ("clean:given-back": a clean has given its functions back, its task has not ended yet;
/// "task:ended": a task's end is recorded and published, nothing after it has run yet;
/// "loop:uevent-pass": the loop has a burst of uevents and is about to pass on it; several,
/// comma-separated), so that a test can act inside that window every time rather than once in
/// a hundred runs.
#[cfg(feature = "test-hooks")]
pub(crate) fn pause_point(point: &str) {
    if std::env::var("VFIOD_TEST_PAUSE_AT").is_ok_and(|p| p.split(',').any(|p| p == point)) {
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

#[cfg(not(feature = "test-hooks"))]
#[inline(always)]
pub(crate) fn pause_point(_point: &str) {}

use super::context::JobContext;
use crate::host::libvirt::LibvirtError;
use crate::mode::convert::ConvertError;
use crate::mode::plan::PlanError;
use crate::model::pci::PciAddress;
use crate::model::task::TaskKind;
use crate::store::StoreError;

/// A share of a job's work, for an honest percentage (as fwupd's `FuProgress`): a 64-VF split is
/// one phase of many small steps, an FPGA write one long step, a migration mostly waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Phase {
    /// Shown as the task's step when the phase starts ("write image", "verify").
    pub name: &'static str,
    /// Relative weight; the weights of a job need not add up to 100.
    pub weight: u32,
}

impl Phase {
    pub const fn new(name: &'static str, weight: u32) -> Phase {
        Phase { name, weight }
    }
}

/// Percent done when `done` of `total` steps of phase `index` are done. Pure. Never 100: a task
/// reaches 100 only by succeeding.
pub fn percent(phases: &[Phase], index: usize, done: usize, total: usize) -> u8 {
    let all: u64 = phases.iter().map(|p| u64::from(p.weight)).sum();
    if all == 0 {
        return 0;
    }
    let before: u64 = phases.iter().take(index).map(|p| u64::from(p.weight)).sum();
    let current = phases.get(index).map_or(0, |p| u64::from(p.weight));
    // In units of 1/total of a weight, so that a step within a light phase still counts.
    let (done, total) = if total == 0 {
        (0, 1)
    } else {
        (done.min(total) as u64, total as u64)
    };
    (((before * total + current * done) * 100) / (all * total)).min(99) as u8
}

/// Where a running job says how far it is. The runner records each report (at most as often as
/// the job reports; a job that reports per step should throttle, as the sysfs executor does).
pub struct Progress<'a> {
    phases: &'a [Phase],
    index: usize,
    report: &'a mut dyn FnMut(&str, u8),
}

impl<'a> Progress<'a> {
    pub fn new(phases: &'a [Phase], report: &'a mut dyn FnMut(&str, u8)) -> Progress<'a> {
        Progress {
            phases,
            index: 0,
            report,
        }
    }

    /// Enters the declared phase `name` and reports its start. An undeclared name is a bug of
    /// the job: it is reported as a step of the current phase rather than panicking a task.
    pub fn phase(&mut self, name: &str) {
        match self.phases.iter().position(|p| p.name == name) {
            Some(i) => {
                self.index = i;
                let pct = percent(self.phases, i, 0, 1);
                (self.report)(name, pct);
            }
            None => {
                tracing::warn!(phase = name, "job reports a phase it did not declare");
                self.step(0, 1, name);
            }
        }
    }

    /// `done` of `total` steps of the current phase are done; `step` says what runs now.
    pub fn step(&mut self, done: usize, total: usize, step: &str) {
        let pct = percent(self.phases, self.index, done, total);
        (self.report)(step, pct);
    }
}

/// What a job learned when admitted: what its task is and holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Admission {
    /// The task's kind as far as the records tell; prepare may refine it.
    pub kind: TaskKind,
    /// Functions besides the device that the task may change (its IOMMU group): no other task
    /// may start on them while it is active.
    pub scope: Vec<PciAddress>,
    /// The request's parameters, kept with the task (a JSON object).
    pub params: serde_json::Value,
}

/// Why a job was not started, or was refused before it changed anything. Each variant is one
/// named D-Bus error (`dbus::error`); the message says what to do where it can.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("no PCI function {0} on this host")]
    NoSuchDevice(PciAddress),
    #[error(
        "{0} is not selected by the configuration, so vfiod does not manage it (select it with \
         a [[select]] entry in a drop-in under /etc/vfiod/conf.d/, then `vfioctl reload`)"
    )]
    NotManaged(PciAddress),
    #[error("{address} is protected: {reason}")]
    Protected { address: PciAddress, reason: String },
    /// The request cannot be done for this device (a VF's mode, VF mode for a non-separable
    /// device, a VF count out of range): the caller's to change.
    #[error("{address}: {reason}")]
    Invalid { address: PciAddress, reason: String },
    #[error("{address} is broken: {reason}")]
    Broken { address: PciAddress, reason: String },
    /// Its claim ended and it is being cleaned: come back when that is done.
    #[error("{address} is being cleaned before it returns to the pool ({reason}); try again when its clean is done")]
    Cleaning { address: PciAddress, reason: String },
    /// A VM has the device or one of the functions the job would change.
    #[error("{address} is in use: {}", .users.join("; "))]
    InUse {
        address: PciAddress,
        users: Vec<String>,
    },
    /// Something the job needs on the host is missing (a driver no module provides).
    #[error("{address}: {reason}")]
    Unavailable { address: PciAddress, reason: String },
    /// libvirt could not say which running domains use the device: nothing is changed without
    /// that answer.
    #[error("{address}: cannot check which running domains use it (set libvirt_uri = \"\" to skip this check)")]
    Libvirt {
        address: PciAddress,
        #[source]
        source: LibvirtError,
    },
    #[error("{address}: cannot read its current state")]
    Hardware {
        address: PciAddress,
        #[source]
        source: ConvertError,
    },
    #[error("cannot plan {address}")]
    Plan {
        address: PciAddress,
        #[source]
        source: PlanError,
    },
    /// The host has no IOMMU: nothing is bound to vfio-pci, nor attached to a VM.
    #[error("{address} cannot be passed through")]
    NoIommu {
        address: PciAddress,
        #[source]
        source: crate::model::iommu::NoIommu,
    },
    /// The store refused (Busy: another task holds the device) or failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// vfiod's own fault: a job that panicked, a worker that could not run.
    #[error("internal error: {0}")]
    Internal(String),
}

impl JobError {
    /// The refusal of passthrough of `address` on a host without an IOMMU (read now), else
    /// nothing.
    pub fn unless_iommu(cx: &JobContext, address: PciAddress) -> Result<(), JobError> {
        crate::host::sysfs::iommu::read(&cx.sysfs)
            .passthrough()
            .map_err(|source| JobError::NoIommu { address, source })
    }

    /// The refusal of a job on a device that is not usable (protected, broken, being cleaned),
    /// else nothing. Whether it is being cleaned is its hold's to say (`store::clean`): its
    /// record may be older than the end of its clean.
    pub fn unless_usable(
        cx: &JobContext,
        device: &crate::model::device::Device,
    ) -> Result<(), JobError> {
        use crate::model::device::State;
        let (address, reason) = (device.address, device.state_reason.clone());
        match device.state {
            State::Usable => {}
            State::Protected => return Err(JobError::Protected { address, reason }),
            State::Broken => return Err(JobError::Broken { address, reason }),
            State::Cleaning => {}
        }
        match cx.store.clean_hold(address)? {
            Some(h) if h.state == crate::model::clean::HoldState::Pending => {
                Err(JobError::Cleaning {
                    address,
                    reason: h.reason,
                })
            }
            Some(h) => Err(JobError::Broken {
                address,
                reason: format!("quarantined: {}", h.reason),
            }),
            None => Ok(()),
        }
    }

    pub fn is_busy(&self) -> bool {
        matches!(self, JobError::Store(StoreError::Busy { .. }))
    }
}

/// A run that failed, as the task's result shows it.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct JobFailure {
    pub message: String,
}

impl JobFailure {
    pub fn new(message: impl Into<String>) -> JobFailure {
        JobFailure {
            message: message.into(),
        }
    }

    /// From an error and its causes, on one line.
    pub fn from_error(e: &dyn std::error::Error) -> JobFailure {
        JobFailure::new(crate::error_chain(e))
    }
}

/// A kind of work a task runs. See the module documentation for the order of the calls. All
/// methods block (sysfs, SQLite, libvirt): the runner calls them off the async threads.
pub trait Job: Send + 'static {
    /// The device the task is for; its D-Bus object shows the task.
    fn device(&self) -> PciAddress;

    /// Before the task exists: refuse from the records alone, and say what the task holds.
    fn admit(&mut self, cx: &JobContext) -> Result<Admission, JobError>;

    /// Inside the task: read the state the job will change and decide the work. Returns the
    /// task's kind (a mode job may find there is nothing to do: [`TaskKind::Check`]).
    fn prepare(&mut self, cx: &JobContext) -> Result<TaskKind, JobError>;

    /// Refuse (usually [`JobError::InUse`]) before any change when the work would take something
    /// a VM uses. `cx.domains` answers which running domains have which functions.
    fn guard(&self, cx: &JobContext) -> Result<(), JobError>;

    /// The phases [`Job::run`] goes through, with their weights. The first is entered before
    /// `run` is called.
    fn phases(&self) -> Vec<Phase>;

    /// The work. Returns what it achieved, for the task's result.
    fn run(&mut self, cx: &JobContext, progress: &mut Progress<'_>) -> Result<String, JobFailure>;

    /// After a failed (or panicked) run: put back what prepare read, as far as possible.
    /// Returns what it did ("restored the previous state").
    fn rollback(&mut self, cx: &JobContext) -> Result<String, JobFailure>;

    /// Whether a failure whose rollback succeeded leaves nothing for an operator to check, so
    /// that the task ends in error without holding its device (an attach libvirt refused: the
    /// claim is released and the device returns to the pool). A conversion's failure always
    /// needs an operator's look: the default.
    fn settles_failures(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_phases_give_honest_percentages() {
        let phases = [
            Phase::new("download", 30),
            Phase::new("write", 60),
            Phase::new("verify", 10),
        ];
        assert_eq!(percent(&phases, 0, 0, 10), 0);
        assert_eq!(percent(&phases, 0, 5, 10), 15);
        assert_eq!(percent(&phases, 1, 0, 1), 30);
        assert_eq!(percent(&phases, 1, 1, 2), 60);
        assert_eq!(percent(&phases, 2, 0, 1), 90);
        // Never 100 before success, even when every step is done.
        assert_eq!(percent(&phases, 2, 1, 1), 99);
        // One phase: done * 100 / total, as the sysfs executor always reported.
        let one = [Phase::new("apply plan", 100)];
        assert_eq!(percent(&one, 0, 65, 130), 50);
        // Degenerate inputs do not panic.
        assert_eq!(percent(&[], 0, 1, 1), 0);
        assert_eq!(percent(&one, 0, 5, 0), 0);
        assert_eq!(percent(&one, 3, 5, 2), 99);
    }

    #[test]
    fn progress_reports_phases_and_steps() {
        let phases = [Phase::new("a", 1), Phase::new("b", 3)];
        let mut seen = Vec::new();
        let mut report = |s: &str, p: u8| seen.push((s.to_string(), p));
        let mut p = Progress::new(&phases, &mut report);
        p.phase("a");
        p.step(1, 2, "half of a");
        p.phase("b");
        p.step(2, 3, "two thirds of b");
        p.phase("nope");
        assert_eq!(
            seen,
            vec![
                ("a".into(), 0),
                ("half of a".into(), 12),
                ("b".into(), 25),
                ("two thirds of b".into(), 75),
                ("nope".into(), 25),
            ]
        );
    }
}
