//! The one guard every job calls before it takes functions away (the `guard` step of
//! [`crate::engine::Job`]): who holds them. A claim in the store (any state but released), a
//! running libvirt domain they are assigned to, and a process holding their VFIO group open (a
//! VM's QEMU, libvirt's or not), and whatever else the kernel says uses them
//! ([`crate::hostuse`]: a block device below them held, busy or open, any of their nodes open in
//! a process). A job that copied these checks would drift from the others (the program job once
//! lost the VFIO one); a new kind of holder is added there, for all of them.

use super::super::context::JobContext;
use super::super::JobError;
use crate::host::sysfs::hostuse;
use crate::hostuse::Use;
use crate::model::pci::PciAddress;

/// Holders a job may leave in place: its own claim and the domain it works for.
#[derive(Clone, Copy, Debug, Default)]
pub struct Allowed<'a> {
    /// The claim the job carries out (an attach, a migration): not a user of its own functions.
    pub claims: &'a [i64],
    /// Domains the job works for, by name. Their QEMU holds the VFIO groups of the functions
    /// they have, so those groups are theirs too.
    pub domains: &'a [&'a str],
}

/// Every holder of any of `functions` but the `allowed` ones, one line each ("0000:3b:02.0 is
/// claimed by VM vm1 (claim 4)", "0000:3b:02.0 is assigned to running domain vm1", "0000:3b:02.0
/// is used by a VM: IOMMU group 40 is open by pid 77 (qemu-system-x86)", "0000:d8:00.0 is used
/// by the host: block device nvme1n1 is held by dm-0 (vg0-data)"). `device` names the job's device in the
/// error when libvirt cannot answer (then nothing may be changed).
pub fn users_of(
    cx: &JobContext,
    device: PciAddress,
    functions: &[PciAddress],
    allowed: Allowed<'_>,
) -> Result<Vec<String>, JobError> {
    let mut users = Vec::new();
    for c in cx.store.active_claim_records()? {
        if allowed.claims.contains(&c.id) {
            continue;
        }
        for f in c.functions.iter().filter(|f| functions.contains(f)) {
            users.push(format!("{f} is claimed by VM {} (claim {})", c.vm(), c.id));
        }
    }
    let domains = cx
        .domains
        .running_domains()
        .map_err(|source| JobError::Libvirt {
            address: device,
            source,
        })?;
    // Functions an allowed domain has: its QEMU is the one holding their group.
    let mut theirs = Vec::new();
    for d in &domains {
        let allowed_domain = allowed.domains.contains(&d.domain.as_str());
        for f in d.functions.iter().filter(|f| functions.contains(f)) {
            if allowed_domain {
                theirs.push(*f);
            } else {
                users.push(format!("{f} is assigned to running domain {}", d.domain));
            }
        }
    }
    // Whoever else the kernel says holds them (`crate::hostuse`): the host (a holder of a
    // block device below them, a process with one of their nodes open), or a VM through VFIO
    // (not the allowed domains': their QEMU holds the groups of the functions they have).
    let facts = hostuse::read(
        &cx.sysfs,
        hostuse::Scope::Only(functions),
        &cx.settings.host.allow_console_gpu,
    );
    for (f, uses) in crate::hostuse::uses(&facts) {
        for u in uses {
            if let Use::Vm { vm, .. } = &u {
                let allowed_vm = vm.as_deref().is_some_and(|v| allowed.domains.contains(&v));
                if theirs.contains(&f) || allowed_vm {
                    continue;
                }
            }
            users.push(u.line(f));
        }
    }
    Ok(users)
}

/// [`users_of`] as the guard's answer: `InUse` naming `device` when anyone holds them.
pub fn refuse_if_used(
    cx: &JobContext,
    device: PciAddress,
    functions: &[PciAddress],
    allowed: Allowed<'_>,
) -> Result<(), JobError> {
    let users = users_of(cx, device, functions, allowed)?;
    if users.is_empty() {
        Ok(())
    } else {
        Err(JobError::InUse {
            address: device,
            users,
        })
    }
}
