//! Pooled claims, carried out: leases and releases through the pool's HTTP API, and the
//! migration flow [`crate::pool`] decides, driven by the `migrate` hook and libvirt's domain
//! events. Every step is committed with its event (`vfioctl events`, kind `pool`) before it is
//! answered.
//!
//! These files decide nothing: what a step means, the order of a resume, retry or give up,
//! adopt or fence, who owns a session, are pure functions of [`crate::pool`] (its header has
//! the table). The files here read the records and the pool's answers, ask those functions,
//! and carry out what they answer.
//!
//! | file           | job                                                                    |
//! |----------------|------------------------------------------------------------------------|
//! | `mod.rs`       | the pool clients (one per `[[pool]]`), [`Engine::pool_devices`], `pool_call`, the store helpers |
//! | `lease.rs`     | lease and release ([`Engine::lease_pooled`], [`Engine::release_pooled`]) |
//! | `flow.rs`      | libvirt's domain events, queued, and each step's actions carried out ([`Engine::pooled_step`]) |
//! | `session.rs`   | the flow's calls on one session: quiesce, resume, adopt after a stale epoch, a refusal recorded |
//! | `incoming.rs`  | the destination's `migrate begin` hook: prepare-move each session here |
//! | `metadata.rs`  | the sessions written in the domain's `<metadata>`                      |
//! | `reconcile.rs` | at start-up, the steps missed while vfiod was down ([`Engine::reconcile_pooled`]) |
//!
//! Pool calls are async HTTP on the engine's runtime, never inside [`super::Engine::read`] (the
//! blocking pool that holds the store) and never under a lock of the engine; each is bounded by
//! its pool's deadlines (`connect_timeout_ms` + `request_timeout_ms`), so a D-Bus call or a hook
//! waits at most that long for a pool. A hook never calls libvirt: the metadata is written when
//! an event or a D-Bus call (not a hook) changes the session.

mod flow;
mod incoming;
mod lease;
mod metadata;
mod reconcile;
mod session;

pub use flow::PooledOutcome;

use super::{Engine, EngineError};
use crate::config::PoolSettings;
use crate::model::pool::{PooledClaim, PooledState};
use crate::pool::client::{PoolClient, PoolEndpoint, PoolError};
use crate::pool::DomainStep;
use crate::store::{PooledStep, StoreError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use tokio::sync::mpsc;

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

impl PooledError {
    /// The pool's answer, when the error is one (what the rules of [`crate::pool`] read): not
    /// a pool this host does not know, nor the store.
    fn refusal(&self) -> Option<&PoolError> {
        match self {
            PooledError::Pool { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// One pool client per `[[pool]]`, made on first use and remade when its settings change (a
/// reload).
#[derive(Default)]
pub(super) struct Pools {
    clients: Mutex<HashMap<String, (PoolSettings, Arc<PoolClient>)>>,
    /// The queue of domain steps from libvirt's events, served in order by one task.
    steps: OnceLock<mpsc::UnboundedSender<(String, Option<String>, DomainStep)>>,
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
