//! The detach job: a claim's hostdevs out of their domain. Out of the configuration at once; out
//! of a running domain only when the guest acknowledges the PCI hot-unplug, which libvirt reports
//! with a device-removed event: the job waits for it, bounded by `[claims] detach_timeout`.
//! Success ends the claim and the device returns to the pool. A refusal (by libvirt or the
//! guest) leaves the claim attached; a timeout leaves it detaching, out of the pool, until a
//! late device-removed event completes it (the engine does that). Either way the records stay.

use super::attach::{claim_refusal, current, libvirt_message, LIBVIRT_OFF};
use crate::claim::lifecycle::{self, Step};
use crate::engine::context::JobContext;
use crate::engine::job::{Admission, Job, JobError, JobFailure, Phase, Progress};
use crate::engine::removals::Waited;
use crate::host::libvirt::{self, Definition, Hostdev, LibvirtError};
use crate::model::claim::ClaimState;
use crate::model::pci::PciAddress;
use crate::model::task::TaskKind;
use crate::store::{ClaimDetails, ClaimRecord};
use std::time::{Duration, Instant};

const DETACH: Phase = Phase::new("detach from the domain", 20);
const WAIT: Phase = Phase::new("wait for the guest to release it", 80);

pub struct DetachJob {
    claim: ClaimRecord,
}

impl DetachJob {
    pub fn new(claim: ClaimRecord) -> DetachJob {
        DetachJob { claim }
    }

    /// How the claim names its domain: the UUID an attach recorded, else the name.
    fn domain(&self) -> String {
        self.claim
            .vm_uuid
            .clone()
            .or_else(|| self.claim.vm_name.clone())
            .unwrap_or_default()
    }

    fn step(&mut self, cx: &JobContext, step: Step, what: &str) -> Result<(), JobFailure> {
        self.claim = cx
            .claims
            .step(self.claim.id, step, ClaimDetails::default(), what)
            .map_err(|e| JobFailure::from_error(&e))?;
        Ok(())
    }

    /// The detach did not happen: the claim is attached as before, and the job fails with `why`.
    fn refused(&mut self, cx: &JobContext, why: String) -> JobFailure {
        let what = format!("detach failed: {why}");
        let recorded = if self.claim.state == ClaimState::Detaching {
            self.step(cx, Step::DetachRefused, &what)
        } else {
            // Nothing was asked of libvirt yet: the claim is as it was.
            cx.store
                .claim_note(self.claim.id, &what)
                .map(drop)
                .map_err(|e| JobFailure::from_error(&e))
        };
        if let Err(e) = recorded {
            return JobFailure::new(format!("{why}; {}", e.message));
        }
        JobFailure::new(format!("{why}; the claim stays {}", ClaimState::Attached))
    }

    /// The domain no longer has the claim's devices: the claim ends.
    fn detached(&mut self, cx: &JobContext, domain: &str) -> Result<String, JobFailure> {
        let what = format!("detached from {domain}; the device returns to the pool");
        self.step(cx, Step::Detached, &what)?;
        Ok(what)
    }
}

impl Job for DetachJob {
    fn device(&self) -> PciAddress {
        self.claim.address
    }

    fn admit(&mut self, cx: &JobContext) -> Result<Admission, JobError> {
        self.claim = current(cx, self.claim.id)?;
        claim_refusal(&self.claim, Step::Detach)?;
        if cx.libvirt.uri().is_none() {
            return Err(JobError::Unavailable {
                address: self.claim.address,
                reason: LIBVIRT_OFF.into(),
            });
        }
        Ok(Admission {
            kind: TaskKind::Detach,
            scope: self.claim.functions[1..].to_vec(),
            params: serde_json::json!({ "claim": self.claim.id, "domain": self.claim.vm() }),
        })
    }

    fn prepare(&mut self, cx: &JobContext) -> Result<TaskKind, JobError> {
        self.claim = current(cx, self.claim.id)?;
        claim_refusal(&self.claim, Step::Detach)?;
        Ok(TaskKind::Detach)
    }

    fn guard(&self, _cx: &JobContext) -> Result<(), JobError> {
        Ok(())
    }

    fn phases(&self) -> Vec<Phase> {
        vec![DETACH, WAIT]
    }

    fn run(&mut self, cx: &JobContext, progress: &mut Progress<'_>) -> Result<String, JobFailure> {
        progress.phase(DETACH.name);
        let info = match cx.libvirt.lookup(&self.domain()) {
            Ok(i) => i,
            Err(LibvirtError::NoSuchDomain { .. }) => {
                // No domain, no device in it.
                self.step(cx, Step::Detach, "detaching")?;
                let gone = format!("{} (the domain no longer exists)", self.claim.vm());
                return self.detached(cx, &gone);
            }
            Err(e) => return Err(self.refused(cx, libvirt_message(&e))),
        };
        let functions = self.claim.functions.clone();
        let unplug = Unplug {
            cx,
            info: &info,
            functions: &functions,
        };
        let (live, config) = match unplug.definitions() {
            Ok(d) => d,
            Err(e) => return Err(self.refused(cx, e)),
        };
        self.step(cx, Step::Detach, &format!("detaching from {}", info.name))?;
        let asked = match unplug.request(&live, &config) {
            Ok(a) => a,
            Err(e) => return Err(self.refused(cx, e)),
        };
        super::kill_point("detach:asked");
        if live.is_empty() {
            return self.detached(cx, &info.name);
        }

        progress.phase(WAIT.name);
        match unplug.wait(asked) {
            Waited::Removed => self.detached(cx, &info.name),
            Waited::Refused(alias) => Err(self.refused(
                cx,
                format!("the guest of {} refused to release {alias}", info.name),
            )),
            Waited::TimedOut(left) => {
                let why = unplug.timed_out(&left);
                if let Err(e) = self.step(cx, Step::DetachTimedOut, &why) {
                    return Err(JobFailure::new(format!("{why}; {}", e.message)));
                }
                Err(JobFailure::new(format!(
                    "{why}; the claim stays detaching and its device out of the pool until \
                     libvirt reports the device removed"
                )))
            }
        }
    }

    fn rollback(&mut self, _cx: &JobContext) -> Result<String, JobFailure> {
        // A detach takes nothing back: the records already say where the device is.
        Ok(format!(
            "kept claim {} ({})",
            self.claim.id, self.claim.state
        ))
    }

    fn settles_failures(&self) -> bool {
        true
    }
}

/// Takes functions out of a domain: out of its configuration at once, out of the running domain
/// when the guest lets go (libvirt's device-removed event), bounded by `[claims]
/// detach_timeout`. The steps of a detach, and of a migration's detach before it moves a VM.
pub(super) struct Unplug<'a> {
    pub cx: &'a JobContext,
    pub info: &'a libvirt::DomainInfo,
    pub functions: &'a [PciAddress],
}

/// What [`Unplug::request`] asked: the mark events are counted from, and the live aliases.
pub(super) struct Asked {
    mark: u64,
    aliases: Vec<String>,
}

impl Unplug<'_> {
    /// The hostdevs of the functions in one definition.
    fn read(&self, which: Definition) -> Result<Vec<Hostdev>, String> {
        self.cx
            .libvirt
            .domain_xml(&self.info.name, which)
            .map_err(|e| libvirt_message(&e))
            .and_then(|xml| mine(self.functions, &xml))
    }

    /// The hostdevs of the functions in the running domain and in its configuration.
    pub fn definitions(&self) -> Result<(Vec<Hostdev>, Vec<Hostdev>), String> {
        let live = if self.info.active {
            self.read(Definition::Live)?
        } else {
            Vec::new()
        };
        let config = if self.info.persistent {
            self.read(Definition::Persistent)?
        } else {
            Vec::new()
        };
        Ok((live, config))
    }

    /// Asks libvirt: out of the configuration first (immediate, and the VM does not get the
    /// device back at its next start whatever the guest does now), then out of the running
    /// domain.
    pub fn request(&self, live: &[Hostdev], config: &[Hostdev]) -> Result<Asked, String> {
        let name = &self.info.name;
        for h in config {
            let xml = libvirt::hostdev_xml(h.source, h.alias.as_deref().unwrap_or(""));
            self.cx
                .libvirt
                .detach_device(name, &xml, libvirt::Affect::Persistent)
                .map_err(|e| libvirt_message(&e))?;
        }
        let mark = self.cx.removals.mark();
        let mut aliases = Vec::new();
        for h in live {
            let alias = h.alias.clone().unwrap_or_default();
            let xml = libvirt::hostdev_xml(h.source, &alias);
            self.cx
                .libvirt
                .detach_device(name, &xml, libvirt::Affect::Live)
                .map_err(|e| libvirt_message(&e))?;
            aliases.push(alias);
        }
        Ok(Asked { mark, aliases })
    }

    /// Waits for the guest to let go of what [`Unplug::request`] asked.
    pub fn wait(&self, asked: Asked) -> Waited {
        let deadline = Instant::now() + self.timeout();
        match self
            .cx
            .removals
            .wait(asked.mark, &self.info.uuid, &asked.aliases, deadline)
        {
            // The event may have been lost (a libvirtd restart): the live XML has the last word.
            Waited::TimedOut(left) => match self.read(Definition::Live) {
                Ok(now) if now.is_empty() => Waited::Removed,
                _ => Waited::TimedOut(left),
            },
            other => other,
        }
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(u64::from(self.cx.settings.claims.detach_timeout_seconds))
    }

    /// Why a wait timed out, for the task and the claim's event.
    pub fn timed_out(&self, left: &[String]) -> String {
        format!(
            "the detach timed out: the guest of {} did not release {} within {} s (the guest \
             must acknowledge the PCI hot-unplug)",
            self.info.name,
            left.join(", "),
            self.timeout().as_secs()
        )
    }
}

/// The hostdevs of `functions` in a definition.
fn mine(functions: &[PciAddress], xml: &str) -> Result<Vec<Hostdev>, String> {
    Ok(libvirt::hostdevs(xml)?
        .into_iter()
        .filter(|h| functions.contains(&h.source))
        .collect())
}

/// The claim an alias of a device-removed event belongs to, if vfiod attached it.
pub fn claim_of_alias(alias: &str) -> Option<i64> {
    lifecycle::parse_alias(alias).map(|(id, _)| id)
}
