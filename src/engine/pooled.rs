//! Pooled claims, carried out: leases and releases through the pool's HTTP API, and the
//! migration flow [`crate::pooled`] decides, driven by the `migrate` hook and libvirt's domain
//! events. Every step is committed with its event (`vfioctl events`, kind `pool`) before it is
//! answered.
//!
//! Pool calls are async HTTP on the engine's runtime, never inside [`super::Engine::read`] (the
//! blocking pool that holds the store) and never under a lock of the engine; each is bounded by
//! its pool's deadlines (`connect_timeout_ms` + `request_timeout_ms`), so a D-Bus call or a hook
//! waits at most that long for a pool. A hook never calls libvirt: the metadata is written when
//! an event or a D-Bus call (not a hook) changes the session.
//!
//! The libvirt event handlers call [`Engine::pooled_step`] (through one queue, in the order the
//! events came); [`Engine::quiesce_pooled`] and [`Engine::resume_pooled`] are the same code for
//! one step, for a caller that plays libvirt's part (tests, the demo).

use super::{Engine, EngineError};
use crate::config::PoolSettings;
use crate::host::libvirt::{self, xml::MetadataPooled, Affect, Definition, LibvirtError};
use crate::model::pooled::{PooledClaim, PooledState};
use crate::pool::client::{PoolClient, PoolEndpoint, PoolError};
use crate::pooled::{Action, DomainStep};
use crate::store::{NewPooled, PooledStep, StoreError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;
use tokio::sync::mpsc;

/// How often a resume that could not reach the pool is tried again, and how long apart: the VM
/// already runs here, and its accelerator work waits for this call.
const RESUME_ATTEMPTS: u32 = 5;
const RESUME_RETRY: Duration = Duration::from_millis(300);

/// Errors of pooled claims.
#[derive(Debug, thiserror::Error)]
pub enum PooledError {
    #[error("no [[pool]] named {0:?} is configured")]
    NoSuchPool(String),
    #[error("no pooled claim {0}")]
    NoSuchClaim(i64),
    #[error("pooled claim {id} is {state}: {what}")]
    Wrong {
        id: i64,
        state: PooledState,
        what: &'static str,
    },
    #[error("pool {pool}: {call}")]
    Pool {
        pool: String,
        call: String,
        #[source]
        source: PoolError,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// One pool client per `[[pool]]`, made on first use and remade when its settings change (a
/// reload).
#[derive(Default)]
pub(super) struct Pools {
    clients: Mutex<HashMap<String, (PoolSettings, Arc<PoolClient>)>>,
    /// The queue of domain steps from libvirt's events, served in order by one task.
    steps: OnceLock<mpsc::UnboundedSender<(String, Option<String>, DomainStep)>>,
}

/// What one action did to one pooled claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PooledOutcome {
    pub claim: i64,
    /// The claim after the action, as recorded.
    pub after: Option<PooledClaim>,
    /// A pool call that failed and left the claim as it was (it may be tried again).
    pub error: Option<String>,
}

fn endpoint(p: &PoolSettings) -> Result<PoolEndpoint, PoolError> {
    let url =
        url::Url::parse(&p.url).map_err(|e| PoolError::Config(format!("url {:?}: {e}", p.url)))?;
    Ok(PoolEndpoint {
        url,
        ca_file: p.ca_file.clone(),
        cert_file: p.cert_file.clone(),
        key_file: p.key_file.clone(),
        connect_timeout: p.connect_timeout,
        request_timeout: p.request_timeout,
    })
}

/// A step's result as its event says it.
fn fenced(current: u64) -> String {
    format!(
        "fenced: the pool's session is at epoch {current}, another host owns it; this host \
         does not retry"
    )
}

impl Engine {
    /// The client of pool `name`, as configured now.
    fn pool_client(&self, name: &str) -> Result<(PoolSettings, Arc<PoolClient>), PooledError> {
        let settings = self.settings();
        let p = settings
            .pool(name)
            .ok_or_else(|| PooledError::NoSuchPool(name.to_string()))?;
        let mut clients = self
            .pools
            .clients
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some((s, c)) = clients.get(name) {
            if s == p {
                return Ok((s.clone(), Arc::clone(c)));
            }
        }
        crate::pool::client::install_crypto_provider();
        let client = Arc::new(endpoint(p).and_then(|ep| PoolClient::new(&ep)).map_err(
            |source| PooledError::Pool {
                pool: name.to_string(),
                call: "cannot make its client".into(),
                source,
            },
        )?);
        clients.insert(name.to_string(), (p.clone(), Arc::clone(&client)));
        Ok((p.clone(), client))
    }

    /// Runs `f` with pool `pool`'s client, within the pool's deadlines (the client has its
    /// own; this bounds the whole call, retries of the client included). `call` says what
    /// failed, in the error. `f` may borrow the caller's values: it is awaited here.
    async fn pool_call<T>(
        &self,
        pool: &str,
        call: &str,
        f: impl AsyncFnOnce(&PoolClient) -> Result<T, PoolError>,
    ) -> Result<T, PooledError> {
        let (settings, client) = self.pool_client(pool).inspect_err(|e| {
            if let PooledError::Pool { source, .. } = e {
                self.metrics.pool_call_failed(pool, source);
            }
        })?;
        let bound = settings.connect_timeout + settings.request_timeout;
        let wrap = |source| {
            self.metrics.pool_call_failed(pool, &source);
            PooledError::Pool {
                pool: pool.to_string(),
                call: call.to_string(),
                source,
            }
        };
        match tokio::time::timeout(bound, f(&client)).await {
            Ok(r) => r
                .inspect(|_| self.metrics.pool_call_answered(pool))
                .map_err(wrap),
            Err(_) => Err(wrap(PoolError::Unreachable(format!(
                "no answer within {} ms",
                bound.as_millis()
            )))),
        }
    }

    async fn store_op<T: Send + 'static>(
        &self,
        f: impl FnOnce(&crate::store::Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, PooledError> {
        Ok(self.read(move |core| f(core.store())).await??)
    }

    /// Runs a change of one pooled claim on the blocking pool, and sends its event before
    /// anyone else can send a later one (the engine's publishing lock, as for PCI claims).
    async fn committed_pooled(
        &self,
        f: impl FnOnce(&crate::store::Store) -> Result<PooledClaim, StoreError> + Send + 'static,
    ) -> Result<PooledClaim, PooledError> {
        let (publishing, events) = (Arc::clone(&self.publishing), self.events.clone());
        self.store_op(move |store| {
            let _publishing = publishing.lock().unwrap_or_else(PoisonError::into_inner);
            let c = f(store)?;
            let _ = events.send(super::EngineEvent::Pooled(c.clone()));
            Ok(c)
        })
        .await
    }

    async fn step(
        &self,
        id: i64,
        state: PooledState,
        epoch: Option<u64>,
        reason: String,
        what: String,
    ) -> Result<PooledClaim, PooledError> {
        self.committed_pooled(move |s| {
            s.step_pooled(
                id,
                &PooledStep {
                    state,
                    epoch,
                    reason,
                },
                &what,
            )
        })
        .await
    }

    async fn note(&self, claim: &PooledClaim, what: String) {
        let c = claim.clone();
        if let Err(e) = self.store_op(move |s| s.note_pooled(&c, &what)).await {
            tracing::error!(
                pooled_claim = claim.id,
                "cannot record an event: {}",
                crate::error_chain(&e)
            );
        }
    }

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

    /// Gives pooled claim `id` back to its pool (`DELETE` with its epoch). A pool that has no
    /// such session any more, or that fenced this host out, ends the claim here all the same
    /// (said in its event); an unreachable pool leaves it as it is, to try again.
    pub async fn release_pooled(
        self: &Arc<Self>,
        id: i64,
        requested_by: &str,
    ) -> Result<PooledClaim, PooledError> {
        let claim = self
            .store_op(move |s| s.pooled_claim(id))
            .await?
            .ok_or(PooledError::NoSuchClaim(id))?;
        if claim.state.ended() {
            return Err(PooledError::Wrong {
                id,
                state: claim.state,
                what: "already ended",
            });
        }
        if claim.state == PooledState::Moving {
            return Err(PooledError::Wrong {
                id,
                state: claim.state,
                what: "a migration is bringing it here; it is released where the VM runs",
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
            Err(PooledError::Pool {
                source: PoolError::NotFound,
                ..
            }) => {
                self.step(
                    id,
                    PooledState::Forgotten,
                    None,
                    "the pool has no such session any more".into(),
                    format!("released by {requested_by}: the pool no longer has the session"),
                )
                .await?
            }
            Err(PooledError::Pool {
                source: PoolError::StaleEpoch { current },
                ..
            }) => {
                self.step(
                    id,
                    PooledState::Forgotten,
                    None,
                    fenced(current),
                    format!("released by {requested_by}: {}", fenced(current)),
                )
                .await?
            }
            Err(e) => {
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
        };
        self.write_pooled_metadata(&after).await;
        Ok(after)
    }

    /// The standing pooled claims, or all of them with `history`.
    pub async fn pooled_claims(&self, history: bool) -> Result<Vec<PooledClaim>, PooledError> {
        self.store_op(move |s| s.pooled_claims(history)).await
    }

    /// A libvirt domain event, for the pooled flow: queued, and carried out in the order the
    /// events came (a failed migration's suspended and resumed events must not cross), off the
    /// loop (pool calls take time).
    pub(super) fn pooled_event(self: &Arc<Self>, d: &libvirt::DomainEvent) {
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

    /// What `step` of domain `name` means for its pooled claims here ([`crate::pooled::on_step`]),
    /// carried out: what the libvirt event handlers and the `stopped`/`release` hooks call.
    pub async fn pooled_step(
        self: &Arc<Self>,
        name: &str,
        uuid: Option<&str>,
        step: DomainStep,
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
        let mut out = Vec::new();
        for action in crate::pooled::on_step(step, &claims) {
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
            Action::ResumeHere { .. } => {
                // The source quiesced at its switchover, most likely: resume at once (one round
                // trip inside the pause window, not two).
                if claim.state == PooledState::Moving {
                    let first = self
                        .pool_call(&claim.pool, "resume", async |c| {
                            c.resume(&claim.session, claim.epoch, &host).await
                        })
                        .await;
                    if let Ok(s) = first {
                        let after = self.record_resumed(claim, &host, s.epoch).await?;
                        self.write_pooled_metadata(&after).await;
                        return Ok(after);
                    }
                }
                let claim = if claim.state == PooledState::Quiesced {
                    claim.clone()
                } else {
                    // The source has not quiesced (yet: its event and ours race, or its vfiod
                    // is down): quiesce is idempotent, and the VM is paused there by now.
                    self.quiesce_one(claim, "before resuming on this host")
                        .await?
                };
                if claim.state != PooledState::Quiesced {
                    return Ok(claim);
                }
                let after = self.resume_one(&claim, &host).await?;
                self.write_pooled_metadata(&after).await;
                Ok(after)
            }
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

    /// After a stale-epoch refusal: when the pool says the session is still this host's (its
    /// quiesce lease expired and it resumed here, or a failed migration's destination gave it
    /// back), the pool's epoch is adopted and the step may be tried once more; `None` when
    /// another host owns it (fenced).
    async fn adopt(&self, claim: &PooledClaim) -> Option<PooledClaim> {
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
    async fn quiesce_one(
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
    async fn resume_one(
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
    async fn record_resumed(
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
    async fn refused(&self, claim: &PooledClaim, e: PooledError) -> PooledError {
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

    /// The destination's `migrate begin` hook, for the pooled sessions the domain's metadata
    /// carries: prepare-move each to this host (and quiesce with `quiesce_at = "begin"`), and
    /// record it `moving` (or `quiesced`). `Err` is the hook's one line; what was recorded
    /// before the failure is forgotten again.
    pub(super) async fn hook_migrate_pooled(
        self: &Arc<Self>,
        name: &str,
        uuid: Option<&str>,
        sessions: &[MetadataPooled],
    ) -> Result<Vec<i64>, String> {
        let here = self
            .store_op(|s| s.pooled_claims(false))
            .await
            .map_err(|e| format!("vfiod: {}", crate::error_chain(&e)))?;
        let settings = self.settings();
        let plan = crate::pooled::migrate_begin(
            name,
            sessions,
            |p| settings.pool(p).map(|p| p.quiesce_at),
            &here,
        )?;
        let host = settings.host_name.clone();
        let mut made: Vec<i64> = Vec::new();
        let fail = |made: Vec<i64>, line: String| async move {
            for id in made {
                let _ = self
                    .step(
                        id,
                        PooledState::Forgotten,
                        None,
                        "the migration was refused".into(),
                        "forgotten: the migration was refused".into(),
                    )
                    .await;
            }
            line
        };
        for incoming in plan {
            let s = &incoming.session;
            if incoming.existing.is_some() {
                continue;
            }
            let mut s = s.clone();
            let mut prepared = self.prepare_move(&s, &host).await;
            if let Err(PooledError::Pool {
                source: PoolError::StaleEpoch { current },
                ..
            }) = &prepared
            {
                // The metadata's epoch is old, but the pool may still give the session to the
                // host the metadata names (its quiesce lease expired there, or an earlier
                // failed migration gave it back, each a new epoch): then that host is still the
                // owner this migration moves it from, at the pool's epoch.
                if self.owned_by(&s, *current).await {
                    s.epoch = *current;
                    prepared = self.prepare_move(&s, &host).await;
                }
            }
            if let Err(e) = prepared {
                return Err(fail(
                    made,
                    format!(
                        "vfiod: domain {name} cannot come here: {}",
                        crate::error_chain(&e)
                    ),
                )
                .await);
            }
            let s = &s;
            let mut state = PooledState::Moving;
            let mut what = format!(
                "incoming migration of {name} from {}: the pool accepted to move the session to {host} (prepare-move at epoch {})",
                if s.host.is_empty() { "?" } else { &s.host },
                s.epoch
            );
            if incoming.quiesce {
                match self
                    .pool_call(
                        &s.pool,
                        &format!("cannot quiesce session {}", s.session),
                        async |c| c.quiesce(&s.session, s.epoch).await,
                    )
                    .await
                {
                    Ok(q) => {
                        state = PooledState::Quiesced;
                        what.push_str(&format!(
                            "; quiesced at migrate begin (quiesce_at = \"begin\", {} in flight)",
                            q.in_flight
                        ));
                    }
                    Err(e) => {
                        return Err(fail(
                            made,
                            format!(
                                "vfiod: domain {name} cannot come here: {}",
                                crate::error_chain(&e)
                            ),
                        )
                        .await)
                    }
                }
            }
            let new = NewPooled {
                pool: s.pool.clone(),
                session: s.session.clone(),
                device: s.device.clone(),
                epoch: s.epoch,
                state,
                vm_name: Some(name.to_string()),
                vm_uuid: uuid.map(str::to_string),
                peer_host: Some(s.host.clone()).filter(|h| !h.is_empty()),
                requested_by: crate::hooks::BY_INCOMING.to_string(),
            };
            match self
                .committed_pooled(move |st| st.insert_pooled(&new, &what))
                .await
            {
                Ok(c) => made.push(c.id),
                Err(e) => {
                    return Err(fail(
                        made,
                        format!("vfiod: domain {name}: {}", crate::error_chain(&e)),
                    )
                    .await)
                }
            }
        }
        Ok(made)
    }

    async fn prepare_move(
        &self,
        s: &MetadataPooled,
        host: &str,
    ) -> Result<crate::pool::client::Session, PooledError> {
        self.pool_call(
            &s.pool,
            &format!("refused to move session {} here", s.session),
            async |c| c.prepare_move(&s.session, s.epoch, host).await,
        )
        .await
    }

    /// Whether the pool gives session `s` to the host its metadata names, at epoch `current`.
    async fn owned_by(&self, s: &MetadataPooled, current: u64) -> bool {
        if s.host.is_empty() {
            return false;
        }
        let found = self
            .pool_call(&s.pool, "cannot read the session", async |c| {
                c.session(&s.session).await
            })
            .await;
        matches!(found, Ok(session) if session.host == s.host
            && session.epoch == current
            && session.state != crate::pool::protocol::SessionState::Released)
    }

    /// Writes the domain's pooled sessions in its `<metadata>` (keeping the devices vfiod
    /// recorded there), through the libvirt worker, off the async threads. Not a hook's work
    /// (a hook must never call libvirt). A domain libvirt does not have (yet), or no libvirt,
    /// is an event, not an error: the claim stands in the store.
    pub(super) async fn write_pooled_metadata(self: &Arc<Self>, claim: &PooledClaim) {
        let domain = claim
            .vm_uuid
            .clone()
            .or(claim.vm_name.clone())
            .unwrap_or_default();
        // No libvirt on this host (`libvirt_uri = ""`): no domain to write into.
        if domain.is_empty() || self.settings().libvirt_uri.is_none() {
            return;
        }
        let (name, uuid) = (
            claim.vm_name.clone().unwrap_or_default(),
            claim.vm_uuid.clone(),
        );
        let host = self.settings().host_name.clone();
        let written = self
            .read(move |core| -> Result<(), String> {
                let claims = core
                    .store()
                    .pooled_of_domain(&name, uuid.as_deref())
                    .map_err(|e| crate::error_chain(&e))?;
                let lv = core.libvirt();
                let message = |e: LibvirtError| crate::error_chain(&e);
                let info = lv.lookup(&domain).map_err(message)?;
                let which = if info.active {
                    Definition::Live
                } else {
                    Definition::Persistent
                };
                let xml = lv.domain_xml(&info.name, which).map_err(message)?;
                let devices = libvirt::xml::parse_domain(&xml)?.metadata;
                let pooled = crate::pooled::metadata_of(&claims, &host);
                let affect = match (info.active, info.persistent) {
                    (true, true) => Affect::Both,
                    (true, false) => Affect::Live,
                    _ => Affect::Persistent,
                };
                let element = (!devices.is_empty() || !pooled.is_empty())
                    .then(|| libvirt::xml::metadata_xml_with(&devices, &pooled));
                lv.set_metadata(&info.name, element.as_deref(), affect)
                    .map_err(message)
            })
            .await;
        let failed = match written {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e,
            Err(e) => crate::error_chain(&e),
        };
        self.note(claim, format!("domain metadata not written: {failed}"))
            .await;
    }
}

impl Engine {
    /// The devices pool `pool` offers (`GET /v1/devices`), within its deadlines.
    pub async fn pool_devices(
        &self,
        pool: &str,
    ) -> Result<Vec<crate::pool::client::PoolDevice>, PooledError> {
        self.pool_call(pool, "cannot list its devices", async |c| c.devices().await)
            .await
    }
}

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
            .filter(|c| matches!(c.state, PooledState::Moving | PooledState::Quiesced))
        {
            let domain = c.vm_uuid.clone().or(c.vm_name.clone()).unwrap_or_default();
            let found = self.read(move |core| core.libvirt().lookup(&domain)).await;
            let gone = match found {
                Ok(Ok(info)) => !info.active,
                Ok(Err(LibvirtError::NoSuchDomain { .. })) => true,
                // libvirt cannot say: nothing is decided on a guess.
                _ => false,
            };
            if !gone {
                continue;
            }
            let name = c.vm_name.clone().unwrap_or_default();
            let done = self
                .pooled_step(
                    &name,
                    c.vm_uuid.as_deref(),
                    DomainStep::Stopped { migrated: false },
                )
                .await;
            changed += done.iter().filter(|o| o.error.is_none()).count();
        }
        if changed > 0 {
            tracing::info!("reconciled {changed} pooled claim(s) with libvirt's domains");
        }
        changed
    }
}
