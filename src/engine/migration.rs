//! Live migration with passthrough devices, both ends (see [`crate::migration`]).
//!
//! - Source: [`Engine::migrate_domain`] starts the migrate job for a domain's claims.
//! - Destination: the `migrate` hook claims devices equivalent to the ones the domain's
//!   metadata lists (or refuses the migration before any memory is copied), and the claims wait
//!   until libvirt says the domain runs here (a hook must not call libvirt back); then they are
//!   attached. A migration that fails after that point ends with the domain's `stopped` and
//!   `release` hooks, which release those claims.

use super::job::{migrate::claims_of, MigrateJob};
use super::{Engine, JobError};
use crate::hook::{DomainId, Verdict};
use crate::host::libvirt::{self, DomainEvent, DomainEventKind, Migration};
use crate::store::{StoreError, TaskRecord};
use std::collections::HashMap;
use std::sync::Arc;

/// libvirt's `VIR_DOMAIN_EVENT_STARTED_MIGRATED`: an incoming migration has begun (the domain is
/// paused until it ends).
const STARTED_MIGRATED: i32 = 1;

/// Claims made by the `migrate` hook, by domain UUID, to attach once the domain runs here.
#[derive(Default)]
pub(super) struct Incoming {
    waiting: std::sync::Mutex<HashMap<String, Vec<i64>>>,
}

impl Incoming {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<i64>>> {
        self.waiting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Engine {
    /// Starts the migrate job for `domain` (a name or UUID): its claims travel (see
    /// [`MigrateJob`]). Returns the task, as it is once prepared.
    pub async fn migrate_domain(
        self: &Arc<Self>,
        domain: &str,
        migration: Migration,
        requested_by: &str,
    ) -> Result<TaskRecord, JobError> {
        let name = domain.to_string();
        let found = self
            .read(move |core| {
                let info = core.libvirt().lookup(&name);
                let claims = core.store().active_claim_records();
                (info, claims)
            })
            .await
            .map_err(|e| JobError::Internal(crate::error_chain(&e)))?;
        let info = found.0.map_err(|e| {
            JobError::Store(StoreError::InvalidArgument {
                reason: crate::error_chain(&e),
            })
        })?;
        let claims = claims_of(found.1?, &info.name, &info.uuid);
        if claims.is_empty() {
            return Err(JobError::Store(StoreError::InvalidArgument {
                reason: format!(
                    "domain {} has no device vfiod manages: migrate it with libvirt (virsh migrate)",
                    info.name
                ),
            }));
        }
        let job = MigrateJob::new(&info.name, claims, migration);
        self.start_task(Box::new(job), requested_by).await
    }

    /// The destination's `migrate begin` hook: claims what the domain's metadata lists and the
    /// incoming XML does not carry as a hostdev (the source detached it), or refuses.
    pub(super) async fn hook_migrate(
        self: &Arc<Self>,
        name: &str,
        xml: &str,
        timing: crate::hook::deadline::Timing,
    ) -> Verdict {
        // Both parses off the async threads: the deadline must be able to fire while they run.
        let text = xml.to_string();
        let both = super::hook::off_the_executor(move || {
            Ok((
                libvirt::xml::parse_domain(&text)?,
                libvirt::xml::parse_pooled(&text)?,
            ))
        })
        .await;
        let (parsed, pooled) = match both {
            Ok(p) => p,
            Err(e) => {
                return Verdict::fail(format!("vfiod: cannot read the XML of domain {name}: {e}"))
            }
        };
        // The host guard, before anything is claimed or any memory copied: a hostdev the
        // incoming XML keeps as it is (not one vfiod retargets to an equivalent here, which is
        // then its claim) must not be a function this host uses.
        let kept: Vec<_> = parsed
            .hostdevs
            .iter()
            .map(|h| h.source)
            .filter(|f| !parsed.metadata.iter().any(|m| m.source == *f))
            .collect();
        if let Err(refusal) = self.host_guard(name, "come here", &kept).await {
            return Verdict::fail(refusal);
        }
        if parsed.metadata.is_empty() && pooled.is_empty() {
            return Verdict::pass("");
        }
        // The claims name the domain as a D-Bus `Claim` would, through the same checks.
        let owner = match super::hook::hook_owner(name, parsed.uuid.as_deref(), "come here") {
            Ok(o) => o,
            Err(line) => return Verdict::fail(line),
        };
        let uuid = owner.vm_uuid.clone();
        // What the source detached (no hostdev in the XML) and what moves with the VM (its
        // driver migrates its state: the hostdev stays, and must land on a function of ours).
        let moving = |m: &crate::host::libvirt::xml::MetadataDevice| {
            parsed.hostdevs.iter().any(|h| h.source == m.source)
        };
        // The same hook twice (libvirt retrying): what the domain already holds counts.
        let (n, u) = (name.to_string(), uuid.clone());
        let held = self
            .read(move |core| {
                core.store().active_claim_records().map(|all| {
                    all.into_iter()
                        .filter(|c| {
                            DomainId {
                                name: &n,
                                uuid: u.as_deref(),
                            }
                            .owns(c)
                        })
                        .count()
                })
            })
            .await;
        let held = match held {
            Ok(Ok(n)) => n,
            _ => 0,
        };
        let mut made = Vec::new();
        let mut waiting = Vec::new();
        let mut retarget = Vec::new();
        for m in parsed.metadata.iter().skip(held) {
            let req = match crate::migration::requirements_for(&m.kind, &m.id, &m.role) {
                Ok(r) => r,
                Err(e) => {
                    self.release_all(&made, "its migration was refused").await;
                    return Verdict::fail(format!(
                        "vfiod: domain {name} cannot come here: its metadata names {}: {e}",
                        m.source
                    ));
                }
            };
            match self
                .claim(req, owner.clone(), crate::hook::BY_INCOMING)
                .await
            {
                Ok(c) => {
                    made.push(c.id);
                    if moving(m) {
                        retarget.push((m.source, c.address));
                    } else {
                        waiting.push(c.id);
                    }
                }
                Err(e) => {
                    self.release_all(&made, "its migration was refused").await;
                    return Verdict::fail(format!(
                        "vfiod: domain {name} cannot come here: no free {} {} {} on this host for \
                         its {} ({})",
                        m.kind,
                        m.role,
                        m.id,
                        m.source,
                        crate::error_chain(&e)
                    ));
                }
            }
        }
        // The pooled sessions: the pool confirms it can serve this host before any memory is
        // copied (and quiesces now in the conservative mode).
        let moving_pooled = if pooled.is_empty() {
            Vec::new()
        } else {
            match self
                .hook_migrate_pooled(name, uuid.as_deref(), &pooled)
                .await
            {
                Ok(ids) => ids,
                Err(line) => {
                    self.release_all(&made, "its migration was refused").await;
                    return Verdict::fail(line);
                }
            }
        };
        // The moving devices' hostdevs point at our functions in the XML libvirt goes on with.
        let stdout = if retarget.is_empty() {
            String::new()
        } else {
            match libvirt::xml::retarget_hostdevs(xml, &retarget) {
                Ok(x) => x,
                Err(e) => {
                    self.release_all(&made, "its migration was refused").await;
                    return Verdict::fail(format!("vfiod: domain {name}: {e}"));
                }
            }
        };
        // Done after the hook gave up: libvirt refused the migration, so no claim of this run
        // may stay, and no pool move it made: the sessions it moved here go back to their
        // source, as for an incoming domain that never ran here (those an earlier run moved
        // stay where they are).
        if !crate::hook::deadline::in_time(crate::hook::deadline::Stamp::now(), timing) {
            self.release_all(
                &made,
                "its hook gave up before vfiod answered: the migration was refused",
            )
            .await;
            if !moving_pooled.is_empty() {
                self.pooled_step_of(
                    name,
                    uuid.as_deref(),
                    crate::pool::DomainStep::Stopped { migrated: false },
                    Some(&moving_pooled),
                )
                .await;
            }
            self.flush().await;
            return Verdict::fail(format!(
                "vfiod: domain {name} cannot come here: vfiod answered after the hook's deadline; \
                 what it claimed for it is released, the pooled sessions it moved here given \
                 back"
            ));
        }
        let made_text = made
            .iter()
            .map(|i| format!("claim {i}"))
            .collect::<Vec<_>>()
            .join(", ");
        let made = waiting;
        if let Some(u) = uuid {
            if !made.is_empty() {
                self.incoming.lock().entry(u).or_default().extend(&made);
            }
        }
        self.flush().await;
        let mut message = if made_text.is_empty() {
            String::new()
        } else {
            format!("claimed {made_text} for {name}")
        };
        if !moving_pooled.is_empty() {
            if !message.is_empty() {
                message.push_str("; ");
            }
            message.push_str(&format!(
                "pooled claims {} moving here",
                moving_pooled
                    .iter()
                    .map(|i| i.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        Verdict {
            exit_code: 0,
            stdout,
            message,
        }
    }

    pub(super) async fn release_all(&self, ids: &[i64], why: &str) {
        for id in ids {
            let _ = self.release_claim(*id, "libvirt hook", why).await;
        }
    }

    /// A lifecycle event of a domain that came in by migration: once it runs here (resumed, or
    /// started other than by an incoming migration), the claims made for it are attached.
    pub(super) async fn incoming_event(self: &Arc<Self>, d: &DomainEvent) {
        let ready = match d.kind {
            DomainEventKind::Resumed => true,
            DomainEventKind::Started => d.detail != STARTED_MIGRATED,
            DomainEventKind::Stopped | DomainEventKind::Undefined => {
                // It never ran here: the stopped/release hooks release the claims.
                self.incoming.lock().remove(&d.uuid.to_ascii_lowercase());
                return;
            }
            _ => false,
        };
        if !ready {
            return;
        }
        let Some(ids) = self.incoming.lock().remove(&d.uuid.to_ascii_lowercase()) else {
            return;
        };
        for id in ids {
            let me = Arc::clone(self);
            let name = d.name.clone();
            // Each its own task; the loop goes on meanwhile.
            tokio::spawn(async move {
                match me
                    .attach_claim(id, &name, Vec::new(), "vfiod (incoming migration)")
                    .await
                {
                    Ok(c) => {
                        tracing::info!(claim_id = id, domain = %name, "attached after its migration here: {}", c.address)
                    }
                    Err(e) => {
                        tracing::error!(claim_id = id, domain = %name, "not attached after its migration here: {}", crate::error_chain(&e))
                    }
                }
            });
        }
    }
}
