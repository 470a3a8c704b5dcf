//! The flow's pool calls on one session, quiesce and resume, carried out: what follows a
//! refusal (call again, look at the owner, give up) is [`decide::after_refusal`]'s answer, the
//! owner looked at is [`decide::adoption`]'s and [`decide::after_adoption`]'s, and whether a
//! refusal ends the claim is [`decide::refusal_ends`]'s. Each answer of the pool is recorded
//! with its event before the caller gets it.

use super::PooledError;
use crate::engine::Engine;
use crate::model::pool::{PooledClaim, PooledState};
use crate::pool::{self as decide, Adoption, AfterAdoption, Call, Retry};

impl Engine {
    /// `quiesce(epoch)`, recorded `quiesced`. A refusal is recorded as [`Engine::refused`]
    /// says, unless the pool still gives the session to this host (its newer epoch adopted).
    pub(super) async fn quiesce_one(
        &self,
        claim: &PooledClaim,
        when: &str,
    ) -> Result<PooledClaim, PooledError> {
        let mut claim = claim.clone();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let done = self
                .pool_call(
                    &claim.pool,
                    &format!("cannot quiesce session {}", claim.session),
                    async |c| c.quiesce(&claim.session, claim.epoch).await,
                )
                .await;
            let e = match done {
                Ok(q) => {
                    return self
                        .step(
                            claim.id,
                            PooledState::Quiesced,
                            Some(q.epoch),
                            String::new(),
                            format!("quiesced {when} ({} in flight)", q.in_flight),
                        )
                        .await
                }
                Err(e) => e,
            };
            match decide::after_refusal(Call::Quiesce, e.refusal(), attempt) {
                Retry::Again { after, why } => {
                    self.note(
                        &claim,
                        format!("quiesce {when}: the pool is unreachable ({why}); trying again"),
                    )
                    .await;
                    tokio::time::sleep(after).await;
                }
                Retry::AskOwner => {
                    let adopted = self.adopt(&claim).await;
                    let next =
                        decide::after_adoption(Call::Quiesce, adopted.as_ref().map(|c| c.state));
                    match (next, adopted) {
                        (AfterAdoption::Done, Some(adopted)) => return Ok(adopted),
                        (AfterAdoption::Again, Some(adopted)) => claim = adopted,
                        _ => return Err(self.refused(&claim, e).await),
                    }
                }
                Retry::GiveUp => return Err(self.refused(&claim, e).await),
            }
        }
    }

    /// `resume(epoch, host)`, recorded with the new epoch (see [`Engine::record_resumed`]). A
    /// pool that cannot be reached is called again a few times; a refusal is recorded as
    /// [`Engine::refused`] says, unless the pool already runs the session here.
    pub(super) async fn resume_one(
        &self,
        claim: &PooledClaim,
        host: &str,
    ) -> Result<PooledClaim, PooledError> {
        let mut claim = claim.clone();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let done = self
                .pool_call(
                    &claim.pool,
                    &format!("cannot resume session {} on {host}", claim.session),
                    async |c| c.resume(&claim.session, claim.epoch, host).await,
                )
                .await;
            let e = match done {
                Ok(s) => return self.record_resumed(&claim, host, s.epoch).await,
                Err(e) => e,
            };
            let call = Call::Resume {
                here: host == self.settings().host_name,
            };
            match decide::after_refusal(call, e.refusal(), attempt) {
                Retry::Again { after, why } => {
                    self.note(
                        &claim,
                        format!("resume on {host}: the pool is unreachable ({why}); trying again"),
                    )
                    .await;
                    tokio::time::sleep(after).await;
                }
                Retry::AskOwner => {
                    let adopted = self.adopt(&claim).await;
                    match (
                        decide::after_adoption(call, adopted.as_ref().map(|c| c.state)),
                        adopted,
                    ) {
                        // Resumed here already (a lease expiry on its last owner): done.
                        (AfterAdoption::Done, Some(adopted)) => return Ok(adopted),
                        (AfterAdoption::Again, Some(adopted)) => claim = adopted,
                        _ => return Err(self.refused(&claim, e).await),
                    }
                }
                Retry::GiveUp => return Err(self.refused(&claim, e).await),
            }
        }
    }

    /// After a stale-epoch refusal: reads the pool's session and, when it is still this host's
    /// at a newer epoch ([`decide::adoption`]), records the claim at the pool's epoch and state.
    /// `None` when fenced, or when the adoption cannot be recorded.
    async fn adopt(&self, claim: &PooledClaim) -> Option<PooledClaim> {
        let me = self.settings().host_name.clone();
        let s = self
            .pool_call(&claim.pool, "cannot read the session", async |c| {
                c.session(&claim.session).await
            })
            .await
            .ok();
        let Adoption::Adopt { state, epoch } = decide::adoption(claim.epoch, &me, s.as_ref())
        else {
            return None;
        };
        let why = s
            .and_then(|s| s.last_note)
            .map(|n| format!(" ({n})"))
            .unwrap_or_default();
        let what =
            format!("the pool moved the session on to epoch {epoch} on this host{why}: adopted");
        self.step(claim.id, state, Some(epoch), String::new(), what)
            .await
            .ok()
    }

    /// Records the pool's answer to a resume: the claim leased here (or, resumed on another
    /// host, to be forgotten by the caller) at the pool's new epoch.
    pub(super) async fn record_resumed(
        &self,
        claim: &PooledClaim,
        host: &str,
        epoch: u64,
    ) -> Result<PooledClaim, PooledError> {
        self.step(
            claim.id,
            PooledState::Leased,
            Some(epoch),
            String::new(),
            format!("resumed on {host} at epoch {epoch}"),
        )
        .await
    }

    /// Records a failed call of the flow and hands its error back: a refusal that ends the
    /// claim ([`decide::refusal_ends`]: fenced, or a session the pool no longer has) puts it in
    /// `error` for good; anything else is an event, the claim as it was.
    async fn refused(&self, claim: &PooledClaim, e: PooledError) -> PooledError {
        let text = crate::error_chain(&e);
        match decide::refusal_ends(e.refusal(), &claim.session) {
            Some(reason) => {
                if let Err(s) = self
                    .step(claim.id, PooledState::Error, None, reason, text)
                    .await
                {
                    tracing::error!(
                        pooled_claim = claim.id,
                        "cannot record: {}",
                        crate::error_chain(&s)
                    );
                }
            }
            None => self.note(claim, text).await,
        }
        e
    }
}
