//! Claims through the engine: the store decides and records them atomically (see
//! [`crate::claim`]); the engine runs that off the async threads and publishes each change in
//! the order it was committed.
//!
//! Concurrent claim changes share their commit (group commit): each request joins a queue, and
//! one committer on the blocking pool takes everything queued, records it in one transaction
//! with one fsync ([`crate::store::Store::change_claims`]), publishes the committed changes in
//! order and only then answers each request. While it commits, new requests queue for the next
//! batch, so the more clients wait, the more each fsync carries; a lone request is committed at
//! once, as before.

use super::{EngineError, EngineEvent};
use crate::claim::{Owner, Requirements};
use crate::model::pci::PciAddress;
use crate::store::{ClaimChange, ClaimRecord, StoreError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use tokio::sync::oneshot;

/// The most changes one transaction carries, so that one batch's wait stays short however many
/// requests pile up.
const MAX_BATCH: usize = 64;

/// How long a claim waits for a matching device that is being cleaned after its last claim
/// (a device released a moment ago: `vfioctl detach`, then `vfioctl claim`), within a D-Bus
/// caller's default 25 s. A clean takes a reset's time, usually well under a second.
const CLEAN_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

type Reply = oneshot::Sender<Result<ClaimRecord, StoreError>>;

/// Claim changes waiting for the committer, and whether one is at work.
#[derive(Default)]
pub(super) struct ClaimQueue {
    pending: Vec<(ClaimChange, Reply)>,
    committing: bool,
}

impl super::Engine {
    /// Claims the best matching device for `owner` (recorded durably before this returns).
    /// When nothing is claimable now but a matching device is being cleaned, waits for its
    /// clean (at most [`CLEAN_WAIT`]) and tries again.
    pub async fn claim(
        &self,
        req: Requirements,
        owner: Owner,
        requested_by: &str,
    ) -> Result<ClaimRecord, ClaimError> {
        self.read(|core| crate::host::sysfs::iommu::read(core.sysfs()))
            .await
            .map_err(ClaimError::Engine)?
            .passthrough()
            .map_err(ClaimError::NoIommu)?;
        self.settle_host_use().await;
        let deadline = tokio::time::Instant::now() + CLEAN_WAIT;
        let mut changes = self.subscribe_changes();
        loop {
            let outcome = self
                .committed(ClaimChange::Claim {
                    requirements: req.clone(),
                    owner: owner.clone(),
                    requested_by: requested_by.to_string(),
                })
                .await;
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match outcome {
                Err(ClaimError::Store(StoreError::Unclaimable(u)))
                    if !left.is_zero() && (u.cleaning_soon() || self.cleans(&u.tasks()).await) =>
                {
                    // A clean's end is a task change; the poll covers a wake-up lost between.
                    let pause = left.min(std::time::Duration::from_millis(100));
                    let _ = tokio::time::timeout(pause, changes.changed()).await;
                }
                other => return other,
            }
        }
    }

    /// A pass first when the uses read now (`crate::hostuse`, through the holder index) are
    /// not what the records say (a holder came or went since the last pass: no PCI uevent
    /// announces an LVM volume, a mount, a process opening a node or a QEMU started by hand),
    /// so that a claim chooses among what is usable now. A failure to read leaves the records
    /// as they are, and says so. The holder index's background refresh asks the same.
    pub(super) async fn settle_host_use(&self) {
        let stale = self
            .read(|core| {
                let now = core.uses_now()?;
                core.store()
                    .devices()
                    .map(|devices| crate::inventory::host_use_is_stale(&devices, &now))
            })
            .await;
        match stale {
            Ok(Ok(false)) => {}
            Ok(Ok(true)) => {
                if let Err(e) = self.refresh().await {
                    tracing::warn!(
                        "the host's uses changed, but the pass that records them failed: {}",
                        crate::error_chain(&e)
                    );
                }
            }
            Ok(Err(e)) => tracing::warn!("{}", crate::error_chain(&e)),
            Err(e) => tracing::warn!("{}", crate::error_chain(&e)),
        }
    }

    /// Whether one of `tasks` is a clean (it ends with its device back in the pool, or
    /// quarantined). Finished or not: a clean drops its hold a moment before its task ends, so
    /// a claim decided in between sees it busy and finds it done when asking here; trying
    /// again then finds the device free.
    async fn cleans(&self, tasks: &[i64]) -> bool {
        if tasks.is_empty() {
            return false;
        }
        let tasks = tasks.to_vec();
        self.read(move |core| {
            tasks.iter().any(|id| {
                core.store()
                    .task(*id)
                    .ok()
                    .flatten()
                    .is_some_and(|t| t.kind == crate::model::task::TaskKind::Clean)
            })
        })
        .await
        .unwrap_or(false)
    }

    /// Releases claim `id`; its functions return to the pool.
    pub async fn release_claim(
        &self,
        id: i64,
        by: &str,
        why: &str,
    ) -> Result<ClaimRecord, ClaimError> {
        self.committed(ClaimChange::Release {
            id,
            by: by.to_string(),
            why: why.to_string(),
        })
        .await
    }

    /// Releases the claims whose lease ran out before an attach (each recorded as an event).
    pub async fn expire_leases(&self) -> Result<Vec<ClaimRecord>, ClaimError> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        let released = self
            .committed_all(move |core| core.store().release_lapsed_claims(now))
            .await?;
        for c in &released {
            tracing::info!(claim_id = c.id, device = %c.address, vm = c.vm(), "claim's lease ran out: released");
        }
        Ok(released)
    }

    /// libvirt says a domain was undefined: its claims go, but for persistent ones (kept, and
    /// reported).
    pub async fn domain_undefined(
        &self,
        name: &str,
        uuid: &str,
    ) -> Result<Vec<ClaimRecord>, ClaimError> {
        let (name, uuid) = (name.to_string(), uuid.to_string());
        let released = self
            .committed_all(move |core| core.store().domain_undefined(&name, &uuid))
            .await?;
        for c in &released {
            tracing::info!(claim_id = c.id, device = %c.address, vm = c.vm(), "domain undefined: claim released");
        }
        Ok(released)
    }

    /// The claimable devices that match `req`, best first.
    pub async fn find_devices(&self, req: Requirements) -> Result<Vec<PciAddress>, ClaimError> {
        let snapshot = self
            .read(|core| core.store().claim_snapshot())
            .await
            .map_err(ClaimError::Engine)??;
        Ok(crate::claim::candidates(&snapshot, &req))
    }

    /// Runs a change of several claims (leases, an undefined domain) on the blocking pool and
    /// sends its events before anyone else can send a later one.
    async fn committed_all<F>(&self, change: F) -> Result<Vec<ClaimRecord>, ClaimError>
    where
        F: FnOnce(&super::Core) -> Result<Vec<ClaimRecord>, StoreError> + Send + 'static,
    {
        let (publishing, events) = (Arc::clone(&self.publishing), self.events.clone());
        let changes = Arc::clone(&self.changes);
        let claims = self
            .read(move |core| {
                let _publishing = publishing.lock().unwrap_or_else(|p| p.into_inner());
                let claims = change(core)?;
                for c in &claims {
                    let _ = events.send(EngineEvent::Claim(c.clone()));
                }
                if !claims.is_empty() {
                    super::bump(&changes);
                }
                Ok::<_, StoreError>(claims)
            })
            .await
            .map_err(ClaimError::Engine)??;
        Ok(claims)
    }

    /// Queues a claim change for the committer (starting one if none is at work) and waits
    /// until it is committed and its event sent: the bus sees claims in commit order.
    async fn committed(&self, change: ClaimChange) -> Result<ClaimRecord, ClaimError> {
        let (reply, answer) = oneshot::channel();
        let start = {
            let mut q = lock(&self.claims);
            q.pending.push((change, reply));
            !std::mem::replace(&mut q.committing, true)
        };
        if start {
            let committer = Committer {
                core: Arc::clone(&self.core),
                queue: Arc::clone(&self.claims),
                publishing: Arc::clone(&self.publishing),
                events: self.events.clone(),
                changes: Arc::clone(&self.changes),
            };
            tokio::task::spawn_blocking(move || committer.run());
        }
        match answer.await {
            Ok(result) => Ok(result?),
            // The committer panicked (its guard dropped the queued replies).
            Err(_) => Err(ClaimError::Engine(EngineError::Internal(
                "the claim committer failed".into(),
            ))),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Commits queued claim changes, batch after batch, until the queue is empty.
struct Committer {
    core: Arc<super::Core>,
    queue: Arc<Mutex<ClaimQueue>>,
    publishing: Arc<Mutex<()>>,
    events: super::event::EventSender,
    changes: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Committer {
    fn run(self) {
        let _guard = Stopping(&self.queue);
        loop {
            let batch: Vec<_> = {
                let mut q = lock(&self.queue);
                if q.pending.is_empty() {
                    // Under the queue's lock: a request queued after this sees no committer and
                    // starts one.
                    q.committing = false;
                    return;
                }
                let n = q.pending.len().min(MAX_BATCH);
                q.pending.drain(..n).collect()
            };
            let (changes, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
            // Held from the commit to the last event sent, as a pass and a task change hold it
            // from their read to their event: events leave in commit order.
            let publishing = lock(&self.publishing);
            let results = self.core.store().change_claims(changes);
            let mut answers = Vec::with_capacity(results.len());
            for (result, reply) in results.into_iter().zip(replies) {
                if let Ok(claim) = &result {
                    let _ = self.events.send(EngineEvent::Claim(claim.clone()));
                }
                answers.push((result, reply));
            }
            drop(publishing);
            super::bump(&self.changes);
            for (result, reply) in answers {
                // The caller may have gone (a dropped D-Bus call): the change stands anyway.
                let _ = reply.send(result);
            }
        }
    }
}

/// Leaves the queue usable if the committer panics: the queued requests are answered with an
/// error (their replies are dropped), and the next request starts a new committer.
struct Stopping<'a>(&'a Mutex<ClaimQueue>);

impl Drop for Stopping<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let mut q = lock(self.0);
            q.pending.clear();
            q.committing = false;
        }
    }
}

/// Errors of claim requests.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Engine(EngineError),
    /// The host has no IOMMU: nothing can be claimed for passthrough.
    #[error(transparent)]
    NoIommu(crate::model::iommu::NoIommu),
}
