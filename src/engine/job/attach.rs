//! The attach job: a claim's functions onto `vfio-pci` (vfiod owns the binding), then into a
//! libvirt domain as `<hostdev managed='no'>`, live and/or in its configuration, and the guest
//! address read back. A failure takes back what was attached, puts the functions back on the
//! drivers they had, and releases the claim (the rule: a failed attach gives the device back, as
//! it was), with libvirt's message.

use super::guard;
use crate::claim::lifecycle::{self, Affect, Step};
use crate::engine::context::JobContext;
use crate::engine::job::{Admission, Job, JobError, JobFailure, Phase, Progress};
use crate::host::libvirt::{self, Definition, DomainInfo, LibvirtError};
use crate::mode::policy::VFIO_PCI;
use crate::mode::{convert, plan};
use crate::model::claim::ClaimState;
use crate::model::pci::PciAddress;
use crate::model::task::TaskKind;
use crate::store::{ClaimDetails, ClaimRecord, StoreError};

const BIND: Phase = Phase::new("bind to vfio-pci", 10);
const ATTACH: Phase = Phase::new("attach to the domain", 80);
const READ_BACK: Phase = Phase::new("read the guest address", 10);

/// Why libvirt cannot be used at all: `--simulate`, or `libvirt_uri = ""`.
pub const LIBVIRT_OFF: &str =
    "libvirt is off in this configuration (libvirt_uri = \"\"): claims work, attach and detach \
     need libvirt";

pub struct AttachJob {
    claim: ClaimRecord,
    domain: String,
    flags: Vec<String>,
    /// What run did, for the rollback: the drivers it changed, the domain, what it changed,
    /// the aliases attached.
    bound: Bound,
    done: Option<(DomainInfo, Affect)>,
    attached: Vec<String>,
    /// Why run failed, for the claim's release.
    failure: Option<String>,
}

impl AttachJob {
    /// Attach `claim` (as read when the request came) to `domain` (a name or UUID).
    pub fn new(claim: ClaimRecord, domain: &str, flags: Vec<String>) -> AttachJob {
        AttachJob {
            claim,
            domain: domain.to_string(),
            flags,
            bound: Bound::default(),
            done: None,
            attached: Vec::new(),
            failure: None,
        }
    }

    fn fail(&mut self, message: String) -> JobFailure {
        self.failure = Some(message.clone());
        JobFailure::new(message)
    }
}

/// The refusal of a job whose claim's state does not allow it.
pub(super) fn claim_refusal(claim: &ClaimRecord, step: Step) -> Result<(), JobError> {
    if !claim.state.holds() {
        return Err(JobError::Store(StoreError::ClaimReleased(claim.id)));
    }
    lifecycle::next(claim.id, claim.state, step)
        .map(drop)
        .map_err(|r| JobError::Store(StoreError::ClaimStep(r)))
}

/// The claim as the store has it now.
pub(super) fn current(cx: &JobContext, id: i64) -> Result<ClaimRecord, JobError> {
    cx.store
        .claim_record(id)?
        .ok_or(JobError::Store(StoreError::NoSuchClaim(id)))
}

/// Whether a request names the claim's VM: by name or UUID, whichever the claim has.
fn names_vm(claim: &ClaimRecord, domain: &str) -> bool {
    claim.vm_name.as_deref() == Some(domain)
        || claim
            .vm_uuid
            .as_deref()
            .is_some_and(|u| u.eq_ignore_ascii_case(domain))
}

/// libvirt's own message, without vfiod's wrapping: what an operator can act on.
pub(super) fn libvirt_message(e: &LibvirtError) -> String {
    crate::error_chain(e)
}

/// What [`bind_to_vfio`] changed, so that [`give_back`] can undo it: the functions' bindings
/// before its first write, and those whose original driver it recorded.
#[derive(Clone, Debug, Default)]
pub struct Bound {
    before: Vec<plan::Binding>,
    recorded: Vec<PciAddress>,
}

impl Bound {
    /// Whether anything was (or may have been) written.
    pub fn is_empty(&self) -> bool {
        self.before.is_empty()
    }
}

/// Binds `functions` (of `device`) to vfio-pci where they are not, remembering the drivers they
/// had so that a restore can return them. `progress(done, total, step)` follows the writes.
/// `bound` learns what it is about to change before the first write, so that even a bind that
/// fails half-way can be given back.
pub fn bind_to_vfio(
    cx: &JobContext,
    device: PciAddress,
    functions: &[PciAddress],
    bound: &mut Bound,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<(), String> {
    let mut bindings = Vec::new();
    for f in functions {
        bindings.push(
            convert::binding(&cx.sysfs, *f)
                .map_err(|e| format!("cannot read {f}: {}", crate::error_chain(&e)))?,
        );
    }
    let bind = plan::bind_plan(device, &bindings, VFIO_PCI);
    if !bind
        .steps
        .iter()
        .any(|s| matches!(s, plan::Step::Write { .. }))
    {
        return Ok(());
    }
    cx.modules.ensure_loaded(&cx.sysfs, VFIO_PCI)?;
    bound.before = bindings.clone();
    for b in &bindings {
        if b.driver.as_deref() != Some(VFIO_PCI)
            && cx
                .store
                .remember_original_driver(b.address, b.driver.as_deref())
                .map_err(|e| crate::error_chain(&e))?
        {
            bound.recorded.push(b.address);
        }
    }
    convert::run(&cx.sysfs, &bind, &mut |done, total, step| {
        progress(done, total, &step.to_string())
    })
    .map_err(|e| format!("cannot bind to vfio-pci: {}", crate::error_chain(&e)))
}

/// Undoes a [`bind_to_vfio`]: each function back on the driver (and override) it had, and the
/// original drivers it recorded forgotten again. Returns the functions it moved.
pub fn give_back(
    cx: &JobContext,
    device: PciAddress,
    bound: &Bound,
) -> Result<Vec<PciAddress>, String> {
    if bound.is_empty() {
        return Ok(Vec::new());
    }
    let mut now = Vec::new();
    for b in &bound.before {
        match convert::binding(&cx.sysfs, b.address) {
            Ok(n) => now.push(n),
            // Gone meanwhile: nothing to give back.
            Err(e) if e.is_not_found() => {}
            Err(e) => {
                return Err(format!(
                    "cannot read {}: {}",
                    b.address,
                    crate::error_chain(&e)
                ))
            }
        }
    }
    let back = plan::give_back(device, &bound.before, &now);
    let moved: Vec<PciAddress> = bound
        .before
        .iter()
        .filter(|b| now.iter().any(|n| n.address == b.address && n != *b))
        .map(|b| b.address)
        .collect();
    convert::run(&cx.sysfs, &back, &mut |_, _, _| {}).map_err(|e| {
        format!(
            "cannot put back the drivers it had: {}",
            crate::error_chain(&e)
        )
    })?;
    for a in &bound.recorded {
        cx.store
            .forget_original_driver(*a)
            .map_err(|e| crate::error_chain(&e))?;
    }
    Ok(moved)
}

impl Job for AttachJob {
    fn device(&self) -> PciAddress {
        self.claim.address
    }

    fn admit(&mut self, cx: &JobContext) -> Result<Admission, JobError> {
        let address = self.claim.address;
        self.claim = current(cx, self.claim.id)?;
        claim_refusal(&self.claim, Step::Attach)?;
        JobError::unless_iommu(cx, address)?;
        if cx.libvirt.uri().is_none() {
            return Err(JobError::Unavailable {
                address,
                reason: LIBVIRT_OFF.into(),
            });
        }
        let invalid = |reason: String| JobError::Invalid { address, reason };
        if self.domain.trim().is_empty() {
            return Err(invalid("the domain must be named".into()));
        }
        if !names_vm(&self.claim, &self.domain) {
            return Err(invalid(format!(
                "claim {} is for VM {}, not {}: claim a device for {} instead",
                self.claim.id,
                self.claim.vm(),
                self.domain,
                self.domain
            )));
        }
        // The flags' names now; whether they fit the domain's state once it is looked up.
        lifecycle::affect(&self.flags, true, true).map_err(invalid)?;
        for f in &self.claim.functions {
            let d = cx.store.device(*f)?.ok_or(JobError::NoSuchDevice(*f))?;
            JobError::unless_usable(cx, &d)?;
        }
        Ok(Admission {
            kind: TaskKind::Attach,
            scope: self.claim.functions[1..].to_vec(),
            params: serde_json::json!({
                "claim": self.claim.id,
                "domain": self.domain,
                "flags": self.flags,
            }),
        })
    }

    fn prepare(&mut self, cx: &JobContext) -> Result<TaskKind, JobError> {
        // Inside the task: the claim cannot have moved on since admit without a task of its
        // own, but a release takes no task.
        self.claim = current(cx, self.claim.id)?;
        claim_refusal(&self.claim, Step::Attach)?;
        Ok(TaskKind::Attach)
    }

    fn guard(&self, cx: &JobContext) -> Result<(), JobError> {
        // A function another running domain has (assigned by hand) is that VM's, whatever the
        // records say; so is a group a QEMU outside libvirt holds open. The claim itself, and
        // the domain it is for, are not in the way.
        let names: Vec<&str> = std::iter::once(self.domain.as_str())
            .chain(self.claim.vm_name.as_deref())
            .collect();
        guard::refuse_if_used(
            cx,
            self.claim.address,
            &self.claim.functions,
            guard::Allowed {
                claims: &[self.claim.id],
                domains: &names,
            },
        )
    }

    fn phases(&self) -> Vec<Phase> {
        vec![BIND, ATTACH, READ_BACK]
    }

    fn run(&mut self, cx: &JobContext, progress: &mut Progress<'_>) -> Result<String, JobFailure> {
        let id = self.claim.id;
        self.claim = cx
            .claims
            .step(
                id,
                Step::Attach,
                ClaimDetails::default(),
                &format!("attaching to {}", self.domain),
            )
            .map_err(|e| JobFailure::from_error(&e))?;
        super::kill_point("attach:attaching");

        progress.phase(BIND.name);
        let functions = self.claim.functions.clone();
        if let Err(e) = bind_to_vfio(
            cx,
            self.claim.address,
            &functions,
            &mut self.bound,
            &mut |done, total, step| progress.step(done, total, step),
        ) {
            return Err(self.fail(e));
        }

        progress.phase(ATTACH.name);
        let info = match cx.libvirt.lookup(&self.domain) {
            Ok(i) => i,
            Err(e) => return Err(self.fail(libvirt_message(&e))),
        };
        let affect = match lifecycle::affect(&self.flags, info.active, info.persistent) {
            Ok(a) => a,
            Err(e) => return Err(self.fail(format!("domain {}: {e}", info.name))),
        };
        self.done = Some((info.clone(), affect));
        let which = match (affect.live, affect.config) {
            (true, true) => libvirt::Affect::Both,
            (true, false) => libvirt::Affect::Live,
            _ => libvirt::Affect::Persistent,
        };
        let total = self.claim.functions.len();
        for (i, f) in self.claim.functions.clone().into_iter().enumerate() {
            progress.step(i, total, &format!("attach {f}"));
            let alias = lifecycle::alias(id, i);
            let xml = libvirt::hostdev_xml(f, &alias);
            if let Err(e) = cx.libvirt.attach_device(&info.name, &xml, which) {
                return Err(self.fail(libvirt_message(&e)));
            }
            self.attached.push(alias);
        }

        super::kill_point("attach:in-libvirt");

        progress.phase(READ_BACK.name);
        let definition = if affect.live {
            Definition::Live
        } else {
            Definition::Persistent
        };
        // The attach stands even if the read-back fails: the address is then unknown.
        let guest = cx
            .libvirt
            .domain_xml(&info.name, definition)
            .ok()
            .and_then(|xml| libvirt::hostdevs(&xml).ok())
            .and_then(|h| {
                h.into_iter()
                    .find(|h| h.source == self.claim.address)
                    .and_then(|h| h.guest_address)
            });
        let place = match (affect.live, affect.config) {
            (true, true) => "live and in its configuration",
            (true, false) => "live",
            _ => "in its configuration",
        };
        let at = guest
            .as_deref()
            .map(|g| format!(" at guest address {g}"))
            .unwrap_or_default();
        let what = format!("attached to {} {place}{at}", info.name);
        self.claim = cx
            .claims
            .step(
                id,
                Step::Attached,
                ClaimDetails {
                    vm_name: Some(info.name.clone()),
                    vm_uuid: Some(info.uuid.clone()),
                    guest_address: Some(guest),
                },
                &what,
            )
            .map_err(|e| JobFailure::from_error(&e))?;
        Ok(what)
    }

    fn rollback(&mut self, cx: &JobContext) -> Result<String, JobFailure> {
        let mut undone = Vec::new();
        let mut left = Vec::new();
        if let Some((info, affect)) = &self.done {
            let which = match (affect.live, affect.config) {
                (true, true) => libvirt::Affect::Both,
                (true, false) => libvirt::Affect::Live,
                _ => libvirt::Affect::Persistent,
            };
            for (i, alias) in self.attached.iter().enumerate() {
                let f = self.claim.functions[i];
                match cx
                    .libvirt
                    .detach_device(&info.name, &libvirt::hostdev_xml(f, alias), which)
                {
                    Ok(()) => undone.push(f.to_string()),
                    Err(e) => left.push(format!("{f}: {}", libvirt_message(&e))),
                }
            }
        }
        if !left.is_empty() {
            // The domain may have the device: the claim stays (attaching) for the reconcile and
            // the operator, and the task stays in error.
            return Err(JobFailure::new(format!(
                "could not take back what was attached ({}); the claim is kept",
                left.join("; ")
            )));
        }
        // No domain has them now: back on the drivers they had before this attach.
        let given_back = give_back(cx, self.claim.address, &self.bound).map_err(|e| {
            JobFailure::new(format!("{e}; the claim is kept, and the task in error"))
        })?;
        let why = self
            .failure
            .clone()
            .unwrap_or_else(|| "the attach failed".into());
        let state = cx.store.claim_record(self.claim.id).ok().flatten();
        if state
            .as_ref()
            .is_some_and(|c| c.state == ClaimState::Attaching)
        {
            cx.claims
                .step(
                    self.claim.id,
                    Step::AttachFailed,
                    ClaimDetails::default(),
                    &format!("released: the attach to {} failed: {why}", self.domain),
                )
                .map_err(|e| JobFailure::from_error(&e))?;
        }
        let drivers = if given_back.is_empty() {
            String::new()
        } else {
            let list: Vec<String> = given_back.iter().map(|a| a.to_string()).collect();
            format!("put {} back on their drivers, ", list.join(", "))
        };
        Ok(if undone.is_empty() {
            format!("{drivers}released claim {}", self.claim.id)
        } else {
            format!(
                "detached {} again, {drivers}released claim {}",
                undone.join(", "),
                self.claim.id
            )
        })
    }

    fn settles_failures(&self) -> bool {
        true
    }
}
