//! Leasing a pool's device to a VM, and giving it back.

use super::PooledError;
use crate::engine::Engine;
use crate::model::pool::{PooledClaim, PooledState};
use crate::pool::ForgetAnyway;
use crate::store::NewPooled;
use std::sync::Arc;

impl Engine {
    /// Leases `device` of pool `pool` to a VM (`POST /v1/sessions`), records the pooled claim,
    /// and writes the session in the domain's metadata when the domain exists.
    pub async fn lease_pooled(
        self: &Arc<Self>,
        pool: &str,
        device: &str,
        vm_name: Option<String>,
        vm_uuid: Option<String>,
        requested_by: &str,
    ) -> Result<PooledClaim, PooledError> {
        let host = self.settings().host_name.clone();
        let vm = vm_name.clone().or(vm_uuid.clone()).unwrap_or_default();
        let session = self
            .pool_call(pool, &format!("cannot lease device {device}"), async |c| {
                c.create_session(device, &host, &vm).await
            })
            .await?;
        let new = NewPooled {
            pool: pool.to_string(),
            session: session.id.clone(),
            device: session.device.clone(),
            epoch: session.epoch,
            state: PooledState::Leased,
            vm_name: vm_name.clone(),
            vm_uuid,
            peer_host: None,
            requested_by: requested_by.to_string(),
        };
        let what = format!(
            "leased to {vm} on {host} by {requested_by} at epoch {}",
            session.epoch
        );
        let claim = match self
            .committed_pooled(move |s| s.insert_pooled(&new, &what))
            .await
        {
            Ok(c) => c,
            Err(e) => {
                // Not recorded: give the session back rather than leak it at the pool.
                let _ = self
                    .pool_call(pool, "release", async |c| {
                        c.release(&session.id, session.epoch).await
                    })
                    .await;
                return Err(e);
            }
        };
        tracing::info!(pooled_claim = claim.id, pool, session = %claim.session, vm, "pooled device leased");
        self.write_pooled_metadata(&claim).await;
        Ok(claim)
    }

    /// Gives pooled claim `id` back to its pool (`DELETE` with its epoch). A refusal that ends
    /// the claim here all the same ([`crate::pool::release_refused`]: the pool has no such
    /// session any more, or fenced this host out) is said in its event; any other failure (an
    /// unreachable pool) leaves it as it is, to try again.
    pub async fn release_pooled(
        self: &Arc<Self>,
        id: i64,
        requested_by: &str,
    ) -> Result<PooledClaim, PooledError> {
        let claim = self
            .store_op(move |s| s.pooled_claim(id))
            .await?
            .ok_or(PooledError::NoSuchClaim(id))?;
        if let Some(what) = crate::pool::unreleasable(claim.state) {
            return Err(PooledError::Wrong {
                id,
                state: claim.state,
                what,
            });
        }
        let released = self
            .pool_call(
                &claim.pool,
                &format!("cannot release session {}", claim.session),
                async |c| c.release(&claim.session, claim.epoch).await,
            )
            .await;
        let after = match released {
            Ok(()) => {
                self.step(
                    id,
                    PooledState::Released,
                    None,
                    String::new(),
                    format!("released by {requested_by}"),
                )
                .await?
            }
            Err(e) => match crate::pool::release_refused(e.refusal()) {
                Some(ForgetAnyway { reason, event }) => {
                    self.step(
                        id,
                        PooledState::Forgotten,
                        None,
                        reason,
                        format!("released by {requested_by}: {event}"),
                    )
                    .await?
                }
                None => {
                    self.note(
                        &claim,
                        format!(
                            "release by {requested_by} failed: {}",
                            crate::error_chain(&e)
                        ),
                    )
                    .await;
                    return Err(e);
                }
            },
        };
        self.write_pooled_metadata(&after).await;
        Ok(after)
    }

    /// The standing pooled claims, or all of them with `history`.
    pub async fn pooled_claims(&self, history: bool) -> Result<Vec<PooledClaim>, PooledError> {
        self.store_op(move |s| s.pooled_claims(history)).await
    }
}
