//! The flow's pool calls on one session: quiesce, resume, and what follows a refusal (the
//! pool's newer epoch adopted, or the claim fenced).

use super::PooledError;
use crate::engine::Engine;
use crate::model::pooled::{PooledClaim, PooledState};
use crate::pool::client::PoolError;
use crate::pooled::fenced;
use std::time::Duration;

/// How often a resume that could not reach the pool is tried again, and how long apart: the VM
/// already runs here, and its accelerator work waits for this call.
const RESUME_ATTEMPTS: u32 = 5;
const RESUME_RETRY: Duration = Duration::from_millis(300);

impl Engine {
    /// After a stale-epoch refusal: when the pool says the session is still this host's (its
    /// quiesce lease expired and it resumed here, or a failed migration's destination gave it
    /// back), the pool's epoch is adopted and the step may be tried once more; `None` when
    /// another host owns it (fenced).
    pub(super) async fn adopt(&self, claim: &PooledClaim) -> Option<PooledClaim> {
        let me = self.settings().host_name.clone();
        let s = self
            .pool_call(&claim.pool, "cannot read the session", async |c| {
                c.session(&claim.session).await
            })
            .await
            .ok()?;
        if s.host != me || s.epoch <= claim.epoch {
            return None;
        }
        let state = match s.state {
            crate::pool::protocol::SessionState::Running => PooledState::Leased,
            crate::pool::protocol::SessionState::Quiesced => PooledState::Quiesced,
            crate::pool::protocol::SessionState::Released => return None,
        };
        let what = format!(
            "the pool moved the session on to epoch {} on this host{}: adopted",
            s.epoch,
            s.last_note
                .as_deref()
                .map(|n| format!(" ({n})"))
                .unwrap_or_default()
        );
        self.step(claim.id, state, Some(s.epoch), String::new(), what)
            .await
            .ok()
    }

    /// `quiesce(epoch)`, recorded. A stale epoch puts the claim in error (fenced), for good,
    /// unless the pool still gives the session to this host (then its epoch is adopted).
    pub(super) async fn quiesce_one(
        &self,
        claim: &PooledClaim,
        when: &str,
    ) -> Result<PooledClaim, PooledError> {
        let stale = match self.quiesce_once(claim, when).await {
            Err(
                e @ PooledError::Pool {
                    source: PoolError::StaleEpoch { .. },
                    ..
                },
            ) => e,
            other => return other,
        };
        match self.adopt(claim).await {
            Some(adopted) if adopted.state == PooledState::Quiesced => Ok(adopted),
            Some(adopted) => match self.quiesce_once(&adopted, when).await {
                Err(e) => Err(self.refused(&adopted, e).await),
                ok => ok,
            },
            None => Err(self.refused(claim, stale).await),
        }
    }

    /// One `quiesce(epoch)`, recorded; a stale epoch is returned unrecorded (the caller looks
    /// whether to adopt), other refusals are recorded.
    async fn quiesce_once(
        &self,
        claim: &PooledClaim,
        when: &str,
    ) -> Result<PooledClaim, PooledError> {
        let done = self
            .pool_call(
                &claim.pool,
                &format!("cannot quiesce session {}", claim.session),
                async |c| c.quiesce(&claim.session, claim.epoch).await,
            )
            .await;
        match done {
            Ok(q) => {
                self.step(
                    claim.id,
                    PooledState::Quiesced,
                    Some(q.epoch),
                    String::new(),
                    format!("quiesced {when} ({} in flight)", q.in_flight),
                )
                .await
            }
            Err(
                e @ PooledError::Pool {
                    source: PoolError::StaleEpoch { .. },
                    ..
                },
            ) => Err(e),
            Err(e) => Err(self.refused(claim, e).await),
        }
    }

    /// `resume(epoch, host)`, recorded with the new epoch; a pool that cannot be reached is
    /// tried again a few times.
    pub(super) async fn resume_one(
        &self,
        claim: &PooledClaim,
        host: &str,
    ) -> Result<PooledClaim, PooledError> {
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
            match done {
                Ok(s) => return self.record_resumed(claim, host, s.epoch).await,
                Err(PooledError::Pool {
                    source: PoolError::Unreachable(ref why),
                    ..
                }) if attempt < RESUME_ATTEMPTS => {
                    self.note(
                        claim,
                        format!("resume on {host}: the pool is unreachable ({why}); trying again"),
                    )
                    .await;
                    tokio::time::sleep(RESUME_RETRY).await;
                }
                Err(
                    e @ PooledError::Pool {
                        source: PoolError::StaleEpoch { .. },
                        ..
                    },
                ) if attempt < RESUME_ATTEMPTS => match self.adopt(claim).await {
                    // Resumed here already (a lease expiry on its last owner): done.
                    Some(adopted)
                        if adopted.state == PooledState::Leased
                            && host == self.settings().host_name =>
                    {
                        return Ok(adopted)
                    }
                    _ => return Err(self.refused(claim, e).await),
                },
                Err(e) => return Err(self.refused(claim, e).await),
            }
        }
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

    /// Records a pool's refusal: a stale epoch or a session the pool no longer has ends the
    /// claim in error (never retried); anything else is an event, the claim as it was.
    pub(super) async fn refused(&self, claim: &PooledClaim, e: PooledError) -> PooledError {
        let reason = match &e {
            PooledError::Pool {
                source: PoolError::StaleEpoch { current },
                ..
            } => Some(fenced(*current)),
            PooledError::Pool {
                source: PoolError::NotFound,
                ..
            } => Some(format!("the pool has no session {}", claim.session)),
            _ => None,
        };
        let text = crate::error_chain(&e);
        match reason {
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
