//! The migration flow, carried out: libvirt's domain events become [`DomainStep`]s, served in
//! the order they came by one queue, and each step's actions ([`crate::pool::on_step`]) are
//! carried out here.
//!
//! The libvirt event handlers call [`Engine::pooled_step`] (through that queue);
//! [`Engine::quiesce_pooled`] and [`Engine::resume_pooled`] are the same code for one step, for
//! a caller that plays libvirt's part (tests, the demo).

use super::PooledError;
use crate::engine::Engine;
use crate::host::libvirt;
use crate::model::pool::{PooledClaim, PooledState};
use crate::pool::{Action, DomainStep, ResumeCall};
use std::sync::Arc;
use tokio::sync::mpsc;

/// What one action did to one pooled claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PooledOutcome {
    pub claim: i64,
    /// The claim after the action, as recorded.
    pub after: Option<PooledClaim>,
    /// A pool call that failed and left the claim as it was (it may be tried again).
    pub error: Option<String>,
}

impl Engine {
    /// A libvirt domain event, for the pooled flow: queued, and carried out in the order the
    /// events came (a failed migration's suspended and resumed events must not cross), off the
    /// loop (pool calls take time).
    pub(in crate::engine) fn pooled_event(self: &Arc<Self>, d: &libvirt::DomainEvent) {
        let Some(step) = DomainStep::of_event(&d.kind, d.detail) else {
            return;
        };
        let tx = self.pools.steps.get_or_init(|| {
            let (tx, mut rx) = mpsc::unbounded_channel::<(String, Option<String>, DomainStep)>();
            // Weak: the queue must not keep a stopped engine alive.
            let me = Arc::downgrade(self);
            tokio::spawn(async move {
                while let Some((name, uuid, step)) = rx.recv().await {
                    let Some(engine) = me.upgrade() else { break };
                    engine.pooled_step(&name, uuid.as_deref(), step).await;
                }
            });
            tx
        });
        let uuid = (!d.uuid.is_empty()).then(|| d.uuid.to_ascii_lowercase());
        let _ = tx.send((d.name.clone(), uuid, step));
    }

    /// The source's switchover (libvirt's suspended-for-migration event): quiesces the domain's
    /// running pooled sessions. The same as [`Engine::pooled_step`] with
    /// [`DomainStep::SuspendedForMigration`].
    pub async fn quiesce_pooled(
        self: &Arc<Self>,
        name: &str,
        uuid: Option<&str>,
    ) -> Vec<PooledOutcome> {
        self.pooled_step(name, uuid, DomainStep::SuspendedForMigration)
            .await
    }

    /// The domain runs here (libvirt's resumed event): resumes its moving or quiesced pooled
    /// sessions on this host. The same as [`Engine::pooled_step`] with [`DomainStep::Resumed`].
    pub async fn resume_pooled(
        self: &Arc<Self>,
        name: &str,
        uuid: Option<&str>,
    ) -> Vec<PooledOutcome> {
        self.pooled_step(name, uuid, DomainStep::Resumed).await
    }

    /// What `step` of domain `name` means for its pooled claims here ([`crate::pool::on_step`]),
    /// carried out: what the libvirt event handlers and the `stopped`/`release` hooks call.
    pub async fn pooled_step(
        self: &Arc<Self>,
        name: &str,
        uuid: Option<&str>,
        step: DomainStep,
    ) -> Vec<PooledOutcome> {
        self.pooled_step_of(name, uuid, step, None).await
    }

    /// [`Engine::pooled_step`] on the domain's pooled claims `only` names (all of them when
    /// `None`): a late `migrate` run undoes its own moves, not an earlier run's.
    pub(in crate::engine) async fn pooled_step_of(
        self: &Arc<Self>,
        name: &str,
        uuid: Option<&str>,
        step: DomainStep,
        only: Option<&[i64]>,
    ) -> Vec<PooledOutcome> {
        let (n, u) = (name.to_string(), uuid.map(str::to_string));
        let claims = match self
            .store_op(move |s| s.pooled_of_domain(&n, u.as_deref()))
            .await
        {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(
                    domain = name,
                    "cannot read the pooled claims: {}",
                    crate::error_chain(&e)
                );
                return Vec::new();
            }
        };
        let claims: Vec<PooledClaim> = claims
            .into_iter()
            .filter(|c| only.is_none_or(|ids| ids.contains(&c.id)))
            .collect();
        let mut out = Vec::new();
        for action in crate::pool::on_step(step, &claims) {
            let claim = match &action {
                Action::Quiesce { id }
                | Action::ResumeHere { id }
                | Action::ResumeOn { id, .. }
                | Action::Forget { id, .. } => claims.iter().find(|c| c.id == *id).cloned(),
            };
            let Some(claim) = claim else { continue };
            let done = self.carry_out(&claim, action).await;
            let outcome = match done {
                Ok(after) => PooledOutcome {
                    claim: claim.id,
                    after: Some(after),
                    error: None,
                },
                Err(e) => {
                    let text = crate::error_chain(&e);
                    tracing::warn!(pooled_claim = claim.id, domain = name, "{text}");
                    PooledOutcome {
                        claim: claim.id,
                        after: None,
                        error: Some(text),
                    }
                }
            };
            out.push(outcome);
        }
        out
    }

    /// One action of [`crate::pool::on_step`] on `claim`, carried out and recorded.
    async fn carry_out(
        self: &Arc<Self>,
        claim: &PooledClaim,
        action: Action,
    ) -> Result<PooledClaim, PooledError> {
        let host = self.settings().host_name.clone();
        match action {
            Action::Quiesce { .. } => {
                self.quiesce_one(claim, "at the migration's switchover")
                    .await
            }
            Action::ResumeHere { .. } => self.resume_here(claim, &host).await,
            Action::ResumeOn { host: peer, .. } => {
                let resumed = self.resume_one(claim, &peer).await;
                let why = match &resumed {
                    Ok(_) => format!("the migration failed: resumed on its source {peer}"),
                    Err(e) => format!(
                        "the migration failed, and resuming on its source {peer} failed too \
                         (the pool's quiesce lease resumes it there): {}",
                        crate::error_chain(e)
                    ),
                };
                let forgotten = match resumed {
                    // resume_one recorded it leased (to the source): end it here.
                    Ok(c) => c,
                    Err(_) => claim.clone(),
                };
                self.step(forgotten.id, PooledState::Forgotten, None, why.clone(), why)
                    .await
            }
            Action::Forget { why, .. } => {
                self.step(
                    claim.id,
                    PooledState::Forgotten,
                    None,
                    why.to_string(),
                    format!("forgotten, no pool call: {why}"),
                )
                .await
            }
        }
    }

    /// [`Action::ResumeHere`]: the calls [`crate::pool::resume_order`] gives, in order; the
    /// domain's metadata follows a resume.
    async fn resume_here(
        self: &Arc<Self>,
        claim: &PooledClaim,
        host: &str,
    ) -> Result<PooledClaim, PooledError> {
        let mut claim = claim.clone();
        for call in crate::pool::resume_order(claim.state) {
            match call {
                ResumeCall::TryResume => {
                    let first = self
                        .pool_call(&claim.pool, "resume", async |c| {
                            c.resume(&claim.session, claim.epoch, host).await
                        })
                        .await;
                    // A refusal here is not recorded: the calls that follow decide.
                    if let Ok(s) = first {
                        let after = self.record_resumed(&claim, host, s.epoch).await?;
                        self.write_pooled_metadata(&after).await;
                        return Ok(after);
                    }
                }
                ResumeCall::Quiesce => {
                    claim = self
                        .quiesce_one(&claim, "before resuming on this host")
                        .await?
                }
                ResumeCall::Resume => {
                    let after = self.resume_one(&claim, host).await?;
                    self.write_pooled_metadata(&after).await;
                    return Ok(after);
                }
            }
        }
        Ok(claim)
    }
}
