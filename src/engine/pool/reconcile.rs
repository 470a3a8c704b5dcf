//! At start-up, the steps of the pooled flow missed while vfiod (or libvirt) was down: what
//! libvirt says of each domain, read here, and the step it means, decided by
//! [`crate::pool::missed_step`].

use crate::engine::Engine;
use crate::host::libvirt::LibvirtError;
use crate::pool::DomainSeen;
use std::sync::Arc;

impl Engine {
    /// Catches up with the events missed while vfiod (or libvirt) was down: a pooled claim in
    /// the middle of a migration (moving or quiesced) whose domain does not run here any more
    /// takes the step of a stopped domain (forgotten, or given back to its source). A domain
    /// that runs is left alone: its events come, and a paused one cannot be told from a
    /// running one here. Returns how many claims changed.
    pub async fn reconcile_pooled(self: &Arc<Self>) -> usize {
        let claims = match self.pooled_claims(false).await {
            Ok(c) => c,
            Err(e) => {
                tracing::error!("cannot read the pooled claims: {}", crate::error_chain(&e));
                return 0;
            }
        };
        let mut changed = 0;
        for c in claims
            .into_iter()
            .filter(|c| crate::pool::mid_migration(c.state))
        {
            let domain = c.vm_uuid.clone().or(c.vm_name.clone()).unwrap_or_default();
            let found = self.read(move |core| core.libvirt().lookup(&domain)).await;
            let seen = match found {
                Ok(Ok(info)) if info.active => DomainSeen::Running,
                Ok(Ok(_)) => DomainSeen::Inactive,
                Ok(Err(LibvirtError::NoSuchDomain { .. })) => DomainSeen::Missing,
                _ => DomainSeen::Unknown,
            };
            let Some(step) = crate::pool::missed_step(seen) else {
                continue;
            };
            let name = c.vm_name.clone().unwrap_or_default();
            let done = self.pooled_step(&name, c.vm_uuid.as_deref(), step).await;
            changed += done.iter().filter(|o| o.error.is_none()).count();
        }
        if changed > 0 {
            tracing::info!("reconciled {changed} pooled claim(s) with libvirt's domains");
        }
        changed
    }
}
