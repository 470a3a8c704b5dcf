//! The `clean` job: a device between tenants. When a claim ends (released, its VM's run over,
//! its lease lapsed, detached) its functions are held out of the pool (`store::clean`) and this
//! job cleans them together; an operator can ask for it too (`Device.Clean`).
//!
//! Phases:
//! 1. **reset**: the reset the kernel offers, as `clean::reset::plan` decides (each function by
//!    its own methods, one at a time so that the one that works is known, or the whole bus
//!    through its bridge), each write bounded by `[claims] reset_timeout`; a reset that hangs is
//!    abandoned.
//! 2. **health check**: config space readable and not all-ones, ids and class unchanged, the
//!    driver bound before bound again (`clean::health`).
//! 3. **command**, when a `[[clean]]` entry gives one: the operator's command with `{address}`
//!    and `{group}` replaced, no shell, bounded by its timeout, its output in the result; then
//!    **check after command**, the health check again.
//!
//! A function that passes leaves its hold (back in the pool); one that fails keeps it, and
//! `clean::verdict` says whether it is quarantined. A failed clean ends in error, as every job,
//! and keeps its functions until an operator resets the task, which clears their quarantine
//! and cleans them again. Nothing can be rolled back: a reset is not undone.

use super::guard;
use super::kill_point;
use crate::clean::health::{self, Expected};
use crate::clean::reset::{self as plan_rules, ResetMethods, ResetPlan};
use crate::clean::verdict::{self, Failure};
use crate::engine::context::JobContext;
use crate::engine::job::{Admission, Job, JobError, JobFailure, Phase, Progress};
use crate::host::exec;
use crate::host::sysfs::reset::{self as resets, ResetReport};
use crate::model::device::{Device, State};
use crate::model::pci::PciAddress;
use crate::model::task::TaskKind;
use crate::store::{CleanOutcome, FunctionClean};
use std::collections::BTreeMap;
use std::time::Duration;

/// Why a clean runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Why {
    /// Claim `0` ended: its functions are held until they are clean.
    ClaimEnded(i64),
    /// An operator asked for it (`Device.Clean`), by this identity.
    Operator(String),
    /// A hold that no claim's end explains (an operator's clean, cleaned again after the
    /// operator reset its task).
    Held,
}

/// Clean `functions` (the device first, then the rest of its group), together.
pub struct CleanJob {
    address: PciAddress,
    functions: Vec<PciAddress>,
    why: Why,
    prepared: Option<Prepared>,
    /// The run met vfiod's own shortage of descriptors or memory (EMFILE, ENFILE, ENOMEM):
    /// nothing is blamed on the device, the failure settles (it holds nothing but the hold)
    /// and the cleaner tries again.
    short: Option<String>,
}

struct Prepared {
    /// `None`: no reset (a `[[clean]]` entry says `reset = false`).
    plan: Option<ResetPlan>,
    /// What each function showed before the reset, to compare with after it.
    expected: BTreeMap<PciAddress, Expected>,
    /// Failed cleans in a row before this one.
    failures_in_row: BTreeMap<PciAddress, u32>,
    /// The operator's command with its placeholders replaced, and its timeout.
    command: Option<(Vec<String>, Duration)>,
    reset_timeout: Duration,
}

impl CleanJob {
    /// The clean of a claim's held functions; `functions[0]` is the claim's device.
    pub fn after_claim(functions: Vec<PciAddress>, claim: i64) -> CleanJob {
        CleanJob::new(functions, Why::ClaimEnded(claim))
    }

    /// A clean of held functions that no claim's end explains.
    pub fn held(functions: Vec<PciAddress>) -> CleanJob {
        CleanJob::new(functions, Why::Held)
    }

    /// An operator's clean of `address` and the rest of its IOMMU group.
    pub fn on_demand(address: PciAddress, by: &str) -> CleanJob {
        CleanJob::new(vec![address], Why::Operator(by.to_string()))
    }

    fn new(functions: Vec<PciAddress>, why: Why) -> CleanJob {
        CleanJob {
            address: functions[0],
            functions,
            why,
            prepared: None,
            short: None,
        }
    }

    fn device(&self, cx: &JobContext, address: PciAddress) -> Result<Device, JobError> {
        cx.store
            .device(address)?
            .ok_or(JobError::NoSuchDevice(address))
    }

    fn unavailable(&self, reason: String) -> JobError {
        JobError::Unavailable {
            address: self.address,
            reason,
        }
    }
}

/// Those of `functions` still held for a clean to come, in their order.
fn still_held(cx: &JobContext, functions: &[PciAddress]) -> Result<Vec<PciAddress>, JobError> {
    let mut held = Vec::new();
    for &a in functions {
        if cx
            .store
            .clean_hold(a)?
            .is_some_and(|h| h.state == crate::model::clean::HoldState::Pending)
        {
            held.push(a);
        }
    }
    Ok(held)
}

/// The words of `argv` with `{address}` and `{group}` replaced.
pub fn command_words(argv: &[String], address: PciAddress, group: Option<u32>) -> Vec<String> {
    let group = group.map(|g| g.to_string()).unwrap_or_default();
    argv.iter()
        .map(|w| {
            w.replace("{address}", &address.to_string())
                .replace("{group}", &group)
        })
        .collect()
}

/// A reset's attempts on one line: "flr: Inappropriate ioctl for device; bus: 12 ms".
fn attempts(report: &ResetReport) -> String {
    if let Some(why) = &report.refused {
        return why.clone();
    }
    report
        .attempts
        .iter()
        .map(|a| match &a.outcome {
            Ok(took) => format!("{}: {} ms", a.method, took.as_millis()),
            Err(why) => format!("{}: {why}", a.method),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// What a reset report means for its function: the method that worked and its time, or the
/// failure.
fn reset_result(report: &ResetReport) -> Result<(String, i64), Failure> {
    if let Some((method, took)) = &report.worked {
        return Ok((method.clone(), took.as_millis() as i64));
    }
    let tried = attempts(report);
    Err(if report.hung {
        Failure::ResetHung(tried)
    } else if report.none_available {
        Failure::NoReset("the kernel offers no reset for it".into())
    } else {
        Failure::ResetFailed(tried)
    })
}

impl Job for CleanJob {
    fn device(&self) -> PciAddress {
        self.address
    }

    fn admit(&mut self, cx: &JobContext) -> Result<Admission, JobError> {
        let device = self.device(cx, self.address)?;
        match device.state {
            // vfiod never touches what the host uses; a function it cannot read cannot be
            // checked (its hold waits until it reads again).
            State::Protected => {
                return Err(JobError::Protected {
                    address: self.address,
                    reason: device.state_reason,
                })
            }
            State::Broken => {
                return Err(JobError::Broken {
                    address: self.address,
                    reason: device.state_reason,
                })
            }
            State::Usable | State::Cleaning => {}
        }
        if !device.managed {
            return Err(JobError::NotManaged(self.address));
        }
        if matches!(self.why, Why::ClaimEnded(_) | Why::Held) {
            // The cleaner read the holds a moment ago: a clean that ended since then may have
            // given these functions back already, and they may be another VM's by now.
            self.functions = still_held(cx, &self.functions)?;
            match self.functions.first() {
                Some(first) => self.address = *first,
                None => {
                    return Err(JobError::Invalid {
                        address: self.address,
                        reason: "no longer held for a clean: its clean is done".into(),
                    })
                }
            }
        }
        if let Why::Operator(_) = self.why {
            // The device and its IOMMU group-mates: a reset may reach them all, and they go to
            // a VM together.
            if let Some(g) = device.iommu_group {
                for d in cx.store.devices()? {
                    if d.iommu_group == Some(g) && d.address != self.address && !d.class.is_bridge()
                    {
                        self.functions.push(d.address);
                    }
                }
            }
        }
        let params = match &self.why {
            Why::ClaimEnded(claim) => serde_json::json!({"claim": claim}),
            Why::Operator(_) | Why::Held => serde_json::json!({}),
        };
        let mut params = params;
        params["functions"] = serde_json::json!(self
            .functions
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>());
        Ok(Admission {
            kind: TaskKind::Clean,
            scope: self.functions[1..].to_vec(),
            params,
        })
    }

    fn prepare(&mut self, cx: &JobContext) -> Result<TaskKind, JobError> {
        // Inside the task, which now holds the functions: what admit saw still holds, or the
        // clean it raced with has given them back (then this one does nothing).
        if matches!(self.why, Why::ClaimEnded(_) | Why::Held)
            && still_held(cx, &self.functions)?.is_empty()
        {
            return Err(JobError::Invalid {
                address: self.address,
                reason: "no longer held for a clean: its clean is done".into(),
            });
        }
        let settings = &cx.settings;
        let primary = self.device(cx, self.address)?;
        let rule = settings.clean_rule(
            primary.address,
            primary.vendor_id,
            primary.device_id,
            primary.class,
        );
        let mut methods: Vec<ResetMethods> = Vec::new();
        let mut last_worked = BTreeMap::new();
        let mut expected = BTreeMap::new();
        let mut failures_in_row = BTreeMap::new();
        for &a in &self.functions {
            let record = self.device(cx, a)?;
            methods.push(
                resets::read_methods(&cx.sysfs, a)
                    .map_err(|e| self.unavailable(format!("{a}: {}", crate::error_chain(&e))))?,
            );
            let health = cx.store.reset_health(a)?.unwrap_or_default();
            if let Some(m) = health.method {
                last_worked.insert(a, m);
            }
            failures_in_row.insert(a, health.failures_in_row);
            // What it shows now is what it must show after; a function already unreadable is
            // compared with its record (and the check says what is wrong).
            // vfiod's own lack of descriptors says nothing of the device: not cleaned now.
            let now = resets::observe_unless_short(&cx.sysfs, a).map_err(|why| {
                self.unavailable(format!("{a}: vfiod is short of its own resources: {why}"))
            })?;
            expected.insert(
                a,
                Expected::before(&now).unwrap_or(Expected {
                    vendor_id: record.vendor_id,
                    device_id: record.device_id,
                    class: record.class,
                    driver: record.driver.clone(),
                }),
            );
        }
        let plan = match rule {
            Some(r) if !r.reset => None,
            _ => {
                let bus = resets::read_bus(&cx.sysfs, &self.functions)
                    .map_err(|e| self.unavailable(crate::error_chain(&e)))?;
                Some(plan_rules::plan(&methods, &last_worked, bus.as_ref()))
            }
        };
        let command = rule.and_then(|r| {
            r.argv.as_ref().map(|argv| {
                (
                    command_words(argv, self.address, primary.iommu_group),
                    Duration::from_secs(u64::from(r.timeout_seconds)),
                )
            })
        });
        self.prepared = Some(Prepared {
            plan,
            expected,
            failures_in_row,
            command,
            reset_timeout: Duration::from_secs(u64::from(settings.claims.reset_timeout_seconds)),
        });
        Ok(TaskKind::Clean)
    }

    fn guard(&self, cx: &JobContext) -> Result<(), JobError> {
        // Nobody may hold what is reset: a claim, a running domain, an open VFIO group (a VM's
        // QEMU still closing it).
        guard::refuse_if_used(cx, self.address, &self.functions, guard::Allowed::default())
    }

    fn phases(&self) -> Vec<Phase> {
        let p = self.prepared.as_ref();
        let mut phases = Vec::new();
        if p.is_some_and(|p| p.plan.is_some()) {
            phases.push(Phase::new("reset", 40));
        }
        phases.push(Phase::new("health check", 10));
        if p.is_some_and(|p| p.command.is_some()) {
            phases.push(Phase::new("command", 40));
            phases.push(Phase::new("check after command", 10));
        }
        phases
    }

    fn run(&mut self, cx: &JobContext, progress: &mut Progress<'_>) -> Result<String, JobFailure> {
        let p = self
            .prepared
            .as_ref()
            .ok_or_else(|| JobFailure::new("internal error: clean run before prepare"))?;
        if let Why::Operator(by) = &self.why {
            // From here on the functions are out of the pool until this clean succeeds.
            cx.store
                .hold_on_demand(&self.functions, by)
                .map_err(|e| JobFailure::from_error(&e))?;
        }
        let mut reset: BTreeMap<PciAddress, (String, i64)> = BTreeMap::new();
        let mut short: Option<String> = None;
        let mut failed: BTreeMap<PciAddress, Failure> = BTreeMap::new();
        let mut notes: Vec<String> = Vec::new();

        if let Some(plan) = &p.plan {
            progress.phase("reset");
            kill_point("clean:resetting");
            match plan {
                ResetPlan::Each {
                    resets: each,
                    without,
                    no_group,
                } => {
                    for (i, f) in each.iter().enumerate() {
                        progress.step(i, each.len(), &format!("reset {}", f.address));
                        let report =
                            resets::reset_function(&cx.sysfs, f.address, &f.order, p.reset_timeout);
                        if report.shortage {
                            short.get_or_insert_with(|| attempts(&report));
                        }
                        if let Some(why) = &report.not_restored {
                            notes.push(format!("{}: reset_method not put back: {why}", f.address));
                        }
                        match reset_result(&report) {
                            Ok(r) => {
                                reset.insert(f.address, r);
                            }
                            Err(e) => {
                                failed.insert(f.address, e);
                            }
                        }
                    }
                    for a in without {
                        let why = no_group
                            .as_ref()
                            .map(|n| format!("the kernel offers no reset for it, and {n}"))
                            .unwrap_or_else(|| "the kernel offers no reset for it".into());
                        failed.insert(*a, Failure::NoReset(why));
                    }
                }
                ResetPlan::Group { bridge } => {
                    progress.step(0, 1, &format!("reset the bus below {bridge}"));
                    let report = resets::reset_group(&cx.sysfs, &self.functions, p.reset_timeout);
                    if report.shortage {
                        short.get_or_insert_with(|| attempts(&report));
                    }
                    for &a in &self.functions {
                        match reset_result(&report) {
                            Ok(r) => {
                                reset.insert(a, r);
                            }
                            Err(e) => {
                                failed.insert(a, e);
                            }
                        }
                    }
                }
                ResetPlan::Nothing { no_group } => {
                    for &a in &self.functions {
                        failed.insert(
                            a,
                            Failure::NoReset(format!(
                                "the kernel offers no reset for it, and {no_group}"
                            )),
                        );
                    }
                }
            }
        }

        // A function whose reset hung may hang a read too: it is left alone.
        let hung = |a: &PciAddress, failed: &BTreeMap<PciAddress, Failure>| {
            matches!(failed.get(a), Some(Failure::ResetHung(_)))
        };
        let check = |failed: &mut BTreeMap<PciAddress, Failure>, short: &mut Option<String>| {
            for &a in &self.functions {
                let Some(expected) = p.expected.get(&a) else {
                    continue;
                };
                if hung(&a, failed) {
                    continue;
                }
                match resets::observe_unless_short(&cx.sysfs, a) {
                    Ok(observed) => {
                        if let Err(why) = health::check(expected, &observed) {
                            failed.insert(a, Failure::Unhealthy(why.to_string()));
                        }
                    }
                    Err(why) => {
                        short.get_or_insert(why);
                    }
                }
            }
        };
        progress.phase("health check");
        check(&mut failed, &mut short);

        let mut command_output = None;
        if let Some((argv, timeout)) = &p.command {
            if failed.is_empty() {
                progress.phase("command");
                match exec::run_command(argv, *timeout) {
                    Ok(out) => command_output = Some(out),
                    Err(why) => {
                        // The reason a quarantine shows is one line ("... failed (exit status:
                        // 1)"); the command's output goes into the task's result only.
                        let short = why
                            .split_once("; output:")
                            .map_or(why.as_str(), |(head, _)| head)
                            .to_string();
                        for &a in &self.functions {
                            failed.insert(a, Failure::CommandFailed(short.clone()));
                        }
                        command_output = Some(why);
                    }
                }
                progress.phase("check after command");
                check(&mut failed, &mut short);
            } else {
                notes.push("the clean command did not run: the reset or the check failed".into());
            }
        }

        if let Some(why) = short {
            // Nothing is recorded against the device: it stays held, and is cleaned again.
            self.short = Some(why.clone());
            return Err(JobFailure::new(format!(
                "clean not finished: vfiod ran out of its own descriptors or memory ({why}); \
                 the device is not blamed and is cleaned again"
            )));
        }
        let outcome = CleanOutcome {
            functions: self
                .functions
                .iter()
                .map(|a| {
                    let failure = failed.get(a);
                    FunctionClean {
                        address: *a,
                        reset: reset.get(a).cloned(),
                        failure: failure.map(|f| f.to_string()),
                        quarantine: failure.is_some_and(|f| {
                            verdict::quarantines(f, p.failures_in_row.get(a).copied().unwrap_or(0))
                        }),
                    }
                })
                .collect(),
        };
        cx.store
            .clean_finished(&outcome)
            .map_err(|e| JobFailure::from_error(&e))?;
        super::pause_point("clean:given-back");
        let text = summary(
            &outcome,
            command_output.as_deref(),
            &notes,
            !failed.is_empty(),
        );
        if failed.is_empty() {
            Ok(text)
        } else {
            Err(JobFailure::new(text))
        }
    }

    fn rollback(&mut self, _cx: &JobContext) -> Result<String, JobFailure> {
        Ok("nothing to undo (a reset cannot be undone); the functions stay held".into())
    }

    /// A run cut short by vfiod's own shortage settles: it keeps nothing but the hold, which
    /// the cleaner takes up again. Every other failure waits for an operator.
    fn settles_failures(&self) -> bool {
        self.short.is_some()
    }
}

/// The task's result: per function what happened, then the command's output and notes.
fn summary(
    outcome: &CleanOutcome,
    command: Option<&str>,
    notes: &[String],
    failed: bool,
) -> String {
    let mut parts: Vec<String> = outcome
        .functions
        .iter()
        .map(|f| {
            let reset = f
                .reset
                .as_ref()
                .map(|(m, ms)| format!("reset by {m} in {ms} ms"))
                .unwrap_or_else(|| "not reset".into());
            match (&f.failure, f.quarantine) {
                (None, _) => format!("{}: {reset}, healthy", f.address),
                (Some(why), true) => format!("{}: {why}: quarantined", f.address),
                (Some(why), false) => format!("{}: {why}", f.address),
            }
        })
        .collect();
    if let Some(out) = command {
        parts.push(out.to_string());
    }
    parts.extend(notes.iter().cloned());
    let head = if failed { "clean failed" } else { "clean" };
    format!("{head}: {}", parts.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_become_the_device_and_its_group() {
        let argv: Vec<String> = ["/bin/scrub", "--dev={address}", "{group}", "x"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let a: PciAddress = "0000:01:00.1".parse().unwrap();
        assert_eq!(
            command_words(&argv, a, Some(7)),
            ["/bin/scrub", "--dev=0000:01:00.1", "7", "x"]
        );
        assert_eq!(command_words(&argv, a, None)[2], "");
    }
}
