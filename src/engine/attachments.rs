//! Claims and libvirt domains: attach and detach as tasks that a caller waits for, libvirt's
//! device events (a late device-removed completes a detach that timed out), and the reconcile of
//! the claims with the domains' definitions at start-up, after libvirt reconnects and when a
//! domain stops: a hostdev vfiod recorded that libvirt no longer has, or the reverse, is
//! reported as an event and repaired where that is safe (see
//! [`crate::claim::lifecycle::reconcile`]).

use super::job::{detach::claim_of_alias, AttachJob, DetachJob};
use super::{Core, Engine, JobError};
use crate::claim::lifecycle::{self, Assigned, DomainDefinitions, Repair, Step};
use crate::host::libvirt::{self, DomainEvent, DomainEventKind, LibvirtError};
use crate::model::claim::ClaimState;
use crate::model::pci::PciAddress;
use crate::model::task::TaskKind;
use crate::store::TaskState;
use crate::store::{ClaimDetails, ClaimRecord, StoreError, TaskRecord};
use std::sync::Arc;

/// Who the reconcile acts as, in events.
const RECONCILE: &str = "vfiod (reconcile with libvirt)";

/// How an attach or detach a caller waits for ended badly.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// Refused before anything changed (no such claim, wrong state, not authorized to, busy).
    #[error(transparent)]
    Refused(#[from] JobError),
    /// The attach ran and failed: the claim was released.
    #[error("{0}")]
    AttachFailed(String),
    /// The detach ran and failed or timed out: the claim and its records stay.
    #[error("{0}")]
    DetachFailed(String),
}

impl Engine {
    /// Attaches claim `id` to `domain` and waits for the outcome. Returns the attached claim.
    pub async fn attach_claim(
        self: &Arc<Self>,
        id: i64,
        domain: &str,
        flags: Vec<String>,
        requested_by: &str,
    ) -> Result<ClaimRecord, AttachError> {
        let claim = self.claim_now(id).await?;
        let job = AttachJob::new(claim, domain, flags);
        let task = self.start_task(Box::new(job), requested_by).await?;
        let done = self.finished(task).await?;
        match done.state {
            TaskState::Success => Ok(self.claim_now(id).await?),
            _ => Err(AttachError::AttachFailed(done.message)),
        }
    }

    /// Detaches claim `id` from its domain and waits for the guest, at most `[claims]
    /// detach_timeout`. Returns the claim as it ends (released).
    pub async fn detach_claim(
        self: &Arc<Self>,
        id: i64,
        requested_by: &str,
    ) -> Result<ClaimRecord, AttachError> {
        let claim = self.claim_now(id).await?;
        let task = self
            .start_task(Box::new(DetachJob::new(claim)), requested_by)
            .await?;
        let done = self.finished(task).await?;
        match done.state {
            TaskState::Success => Ok(self.claim_now(id).await?),
            _ => Err(AttachError::DetachFailed(done.message)),
        }
    }

    async fn claim_now(&self, id: i64) -> Result<ClaimRecord, JobError> {
        self.read(move |core| core.store().claim_record(id))
            .await
            .map_err(|e| JobError::Internal(crate::error_chain(&e)))??
            .ok_or(JobError::Store(StoreError::NoSuchClaim(id)))
    }

    /// The task's final record, once it has one.
    async fn finished(&self, task: TaskRecord) -> Result<TaskRecord, JobError> {
        self.wait_tasks(std::slice::from_ref(&task)).await;
        let id = task.id;
        self.read(move |core| core.store().task(id))
            .await
            .map_err(|e| JobError::Internal(crate::error_chain(&e)))??
            .ok_or_else(|| JobError::Internal(format!("task {id} is gone")))
    }

    /// A domain's device event: noted for the detach job that waits for it; a removal no job
    /// waits for completes a detach that timed out (or ends the attachment of a device someone
    /// removed by hand).
    pub(super) async fn device_event(self: &Arc<Self>, d: &DomainEvent) {
        let (alias, removed) = match &d.kind {
            DomainEventKind::DeviceRemoved { alias } => (alias, true),
            DomainEventKind::DeviceRemovalFailed { alias } => (alias, false),
            _ => return,
        };
        self.core.removals().record(&d.uuid, alias, removed);
        let Some(id) = claim_of_alias(alias) else {
            return;
        };
        let me = Arc::clone(self);
        let (name, uuid) = (d.name.clone(), d.uuid.clone());
        let outcome = self
            .read(move |core| me.late_removal(core, id, &name, &uuid, removed))
            .await;
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(
                claim_id = id,
                "cannot record a device event: {}",
                crate::error_chain(&e)
            ),
            Err(e) => tracing::error!(claim_id = id, "cannot record a device event: {e}"),
        }
    }

    /// A device event of claim `id` that no detach job is waiting for.
    fn late_removal(
        &self,
        core: &Core,
        id: i64,
        name: &str,
        uuid: &str,
        removed: bool,
    ) -> Result<(), StoreError> {
        let Some(claim) = core.store().claim_record(id)? else {
            return Ok(());
        };
        let busy = core.store().active_task(claim.address)?.is_some_and(|t| {
            matches!(t.kind, TaskKind::Detach | TaskKind::Attach) && !t.state.is_final()
        });
        if busy || !matches!(claim.state, ClaimState::Detaching | ClaimState::Attached) {
            return Ok(());
        }
        if !removed {
            let what = format!("the guest of {name} refused to release the device");
            if claim.state == ClaimState::Detaching {
                self.claim_step(id, Step::DetachRefused, ClaimDetails::default(), &what)?;
            } else {
                core.store().claim_note(id, &what)?;
            }
            return Ok(());
        }
        // A claim of several functions ends when the live domain has none of them.
        if let Ok(xml) = core.libvirt().domain_xml(uuid, libvirt::Definition::Live) {
            if let Ok(h) = libvirt::hostdevs(&xml) {
                if h.iter().any(|h| claim.functions.contains(&h.source)) {
                    return Ok(());
                }
            }
        }
        let what = if claim.state == ClaimState::Detaching {
            format!("detached from {name} late: libvirt reported the device removed; the device returns to the pool")
        } else {
            format!(
                "{name} no longer has the device (removed outside vfiod); the VM keeps the claim"
            )
        };
        tracing::info!(claim_id = id, domain = name, "{what}");
        self.claim_step(id, Step::Detached, ClaimDetails::default(), &what)?;
        Ok(())
    }

    /// A claim step outside a job, published in commit order.
    pub(super) fn claim_step(
        &self,
        id: i64,
        step: Step,
        details: ClaimDetails,
        what: &str,
    ) -> Result<ClaimRecord, StoreError> {
        self.claim_steps().step(id, step, details, what)
    }

    /// Reconciles the claims with libvirt's domains (all of them, or the one named `only`).
    /// Claims an attach or detach task works on are left to it. Returns how many claims changed.
    pub async fn reconcile_claims(self: &Arc<Self>, only: Option<String>) -> usize {
        let me = Arc::clone(self);
        let done = self
            .read(move |core| me.reconcile_claims_now(core, only.as_deref()))
            .await;
        match done {
            Ok(Ok(n)) => n,
            Ok(Err(e)) => {
                tracing::warn!(
                    "claims not reconciled with libvirt: {}",
                    crate::error_chain(&e)
                );
                0
            }
            Err(e) => {
                tracing::error!("claims not reconciled with libvirt: {e}");
                0
            }
        }
    }

    fn reconcile_claims_now(
        &self,
        core: &Core,
        only: Option<&str>,
    ) -> Result<usize, ReconcileError> {
        if core.libvirt().uri().is_none() {
            return Ok(0);
        }
        let domains: Vec<DomainDefinitions> = core
            .libvirt()
            .all_domains()?
            .into_iter()
            .map(|d| {
                let parse = |xml: Option<String>| -> Option<Vec<Assigned>> {
                    let h = libvirt::hostdevs(&xml?).ok()?;
                    Some(
                        h.into_iter()
                            .map(|h| Assigned {
                                source: h.source,
                                alias: h.alias,
                                guest_address: h.guest_address,
                            })
                            .collect(),
                    )
                };
                DomainDefinitions {
                    name: d.info.name,
                    uuid: d.info.uuid,
                    live: parse(d.live),
                    config: parse(d.config),
                }
            })
            .collect();
        let concerns = |name: Option<&str>, uuid: Option<&str>| match only {
            None => true,
            Some(o) => name == Some(o) || uuid.is_some_and(|u| u.eq_ignore_ascii_case(o)),
        };
        let store = core.store();
        let mut changed = 0;
        for claim in store.active_claim_records()? {
            if !concerns(claim.vm_name.as_deref(), claim.vm_uuid.as_deref()) {
                continue;
            }
            if store.active_task(claim.address)?.is_some_and(|t| {
                matches!(t.kind, TaskKind::Attach | TaskKind::Detach) && !t.state.is_final()
            }) {
                continue;
            }
            let domain = domains.iter().find(|d| {
                claim
                    .vm_uuid
                    .as_deref()
                    .is_some_and(|u| u.eq_ignore_ascii_case(&d.uuid))
                    || (claim.vm_uuid.is_none() && claim.vm_name.as_deref() == Some(&d.name))
            });
            let repair = lifecycle::reconcile(
                claim.state,
                &claim.functions,
                claim.persistent,
                crate::hook::for_a_run(&claim.requested_by),
                domain,
            );
            if repair == Repair::Keep {
                continue;
            }
            match self.repair(core, &claim, domain, repair) {
                Ok(()) => changed += 1,
                Err(e) => {
                    tracing::error!(claim_id = claim.id, "reconcile: {}", crate::error_chain(&e))
                }
            }
        }
        // The reverse: functions vfiod manages that a domain has and no claim holds.
        let held: Vec<_> = store
            .active_claim_records()?
            .into_iter()
            .flat_map(|c| c.functions)
            .collect();
        let devices = store.devices()?;
        let managed = |f| devices.iter().any(|d| d.address == f && d.managed);
        for d in domains
            .iter()
            .filter(|d| concerns(Some(&d.name), Some(&d.uuid)))
        {
            for f in lifecycle::unclaimed_assignments(d, &held, &managed) {
                self.report_unclaimed(core, d, f);
            }
        }
        if only.is_none() {
            self.settle_interrupted(core)?;
        }
        Ok(changed)
    }

    /// Attach and detach tasks that vfiod's stop interrupted: their claims are reconciled now,
    /// so nothing is left for an operator to reset.
    fn settle_interrupted(&self, core: &Core) -> Result<(), StoreError> {
        let store = core.store();
        for d in store.devices()? {
            let Some(t) = store.blocking_task(d.address)? else {
                continue;
            };
            if matches!(t.kind, TaskKind::Attach | TaskKind::Detach)
                && t.state == TaskState::Error
                && t.reset_ms.is_none()
                && t.address == d.address
                && t.message.starts_with("interrupted")
            {
                let t = store.reset_task(d.address, RECONCILE)?;
                self.task_changed(&t, super::task::Change::State);
            }
        }
        Ok(())
    }

    /// Carries out the reconcile's `repair` of `claim`, each change recorded as its event.
    fn repair(
        &self,
        core: &Core,
        claim: &ClaimRecord,
        domain: Option<&DomainDefinitions>,
        repair: Repair,
    ) -> Result<(), StoreError> {
        let id = claim.id;
        let step = |step, details, what: String| {
            tracing::warn!(claim_id = id, "{what}");
            self.claim_step(id, step, details, &what).map(drop)
        };
        match repair {
            Repair::Keep => Ok(()),
            Repair::Report(why) => {
                tracing::warn!(claim_id = id, "reconcile: {why}");
                core.store()
                    .claim_note(id, &format!("reconcile: {why}"))
                    .map(drop)
            }
            Repair::MarkAttached { why } => {
                let Some(d) = domain else {
                    return Ok(());
                };
                if claim.state == ClaimState::Claimed {
                    step(
                        Step::Attach,
                        ClaimDetails::default(),
                        format!("reconcile: {why}"),
                    )?;
                }
                let details = ClaimDetails {
                    vm_name: Some(d.name.clone()),
                    vm_uuid: Some(d.uuid.clone()),
                    guest_address: Some(d.guest_address(claim.address)),
                };
                step(
                    Step::Attached,
                    details,
                    format!("reconcile: {why}: attached"),
                )
            }
            Repair::BackToClaimed { why } => {
                let s = if claim.state == ClaimState::Detaching {
                    Step::DetachRefused
                } else {
                    Step::Detached
                };
                let details = ClaimDetails {
                    guest_address: Some(None),
                    ..ClaimDetails::default()
                };
                step(s, details, format!("reconcile: {why}"))
            }
            Repair::Release { why } => {
                let s = match claim.state {
                    ClaimState::Attaching => Step::AttachFailed,
                    ClaimState::Detaching => Step::Detached,
                    // Out of the domain first: an attached claim cannot be released.
                    ClaimState::Attached => {
                        step(
                            Step::Detached,
                            ClaimDetails::default(),
                            format!("reconcile: {why}"),
                        )?;
                        Step::Release
                    }
                    ClaimState::Claimed | ClaimState::Released => Step::Release,
                };
                step(
                    s,
                    ClaimDetails::default(),
                    format!("released by the reconcile: {why}"),
                )
            }
        }
    }

    /// A managed function a domain has and no claim holds: reported, not claimed. Claiming it
    /// for the domain would keep it out of the pool and block its PF's conversions for as long
    /// as the domain's configuration names it, which the operator did not ask for; the tasks'
    /// guard already refuses to touch what a running domain has.
    /// Only in the configuration of a domain that does not run it with `[hooks] auto_claim`,
    /// it is what the hook expects (it claims it at the next start; after every stop of a domain
    /// whose own XML names it, its `stopped` hook released the claim made for that run): an
    /// event, not a warning.
    fn report_unclaimed(&self, core: &Core, d: &DomainDefinitions, f: PciAddress) {
        let at_start = lifecycle::claimed_at_start(d, f, self.settings().hooks.auto_claim);
        let why = if at_start {
            format!(
                "reconcile: domain {} has {f} assigned but no claim holds it: in its \
                 configuration only, and the libvirt hook claims it when the domain starts \
                 ([hooks] auto_claim)",
                d.name
            )
        } else {
            format!(
                "reconcile: domain {} has {f} assigned but no claim holds it (claim it for the \
                 domain to record it: vfioctl claim --address {f} --vm {})",
                d.name, d.name
            )
        };
        if at_start {
            tracing::info!(domain = %d.name, device = %f, "{why}");
        } else {
            tracing::warn!(domain = %d.name, device = %f, "{why}");
        }
        let recorded = core.store().record_event(crate::store::NewEvent::new(
            Some(f),
            crate::model::event::EventKind::Claim,
            why,
        ));
        if let Err(e) = recorded {
            tracing::error!(device = %f, "cannot record: {}", crate::error_chain(&e));
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum ReconcileError {
    #[error(transparent)]
    Libvirt(#[from] LibvirtError),
    #[error(transparent)]
    Store(#[from] StoreError),
}
