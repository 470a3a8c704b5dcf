//! The pool's core: the store behind one mutex, the session commands (decided by
//! [`super::state`], written to the store before the reply), the data plane of the stand-in
//! accelerator, and per session the engine its worker runs (see [`super::worker`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::Notify;

use super::state::{self, Command, Refusal, Rules, SessionRecord, Transition};
use super::store::{Store, StoreError};
use crate::protocol::{
    CreateSession, ErrorCode, PoolDevice, Quiesced, Results, Session, SessionState, Submitted,
    WorkItem,
};

/// Why a call failed: a refusal the protocol names, or the store.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error("pool store")]
    Store(#[from] StoreError),
}

/// The most results one fetch returns.
pub const MAX_FETCH: u64 = 1000;
/// The most items one submission carries.
pub const MAX_SUBMIT: usize = 1000;
/// The highest item number (and `ack`): SQLite keeps signed 64-bit integers, and item numbers
/// are ordered there, so a number of 2^63 or more would be stored negative and sort first.
pub const MAX_SEQ: u64 = i64::MAX as u64;

/// The pool-wide settings the core applies.
#[derive(Clone, Debug)]
pub struct CoreSettings {
    pub devices: Vec<PoolDevice>,
    pub lease: Duration,
    pub hosts: Option<Vec<String>>,
    /// How long the stand-in accelerator works on one item.
    pub item_time: Duration,
}

/// One session's engine: the lock its worker holds while it works on an item (a quiesce takes
/// it to wait for the clean point) and the bell that wakes the worker.
#[derive(Default)]
pub struct Engine {
    pub busy: tokio::sync::Mutex<()>,
    pub wake: Notify,
}

pub struct Core {
    store: Mutex<Store>,
    pub settings: CoreSettings,
    engines: Mutex<HashMap<String, Arc<Engine>>>,
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// RFC 3339 (UTC, milliseconds) of a Unix time in milliseconds.
pub fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

impl Core {
    pub fn new(store: Store, settings: CoreSettings) -> Core {
        Core {
            store: Mutex::new(store),
            settings,
            engines: Mutex::new(HashMap::new()),
        }
    }

    /// The store, for one short operation. A panic while it was held leaves no half-written
    /// state behind (SQLite rolls back an open transaction), so poisoning is ignored.
    pub fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn rules(&self) -> Rules<'_> {
        Rules {
            now_ms: now_ms(),
            lease_ms: self.settings.lease.as_millis() as u64,
            hosts: self.settings.hosts.as_deref(),
        }
    }

    /// The engine of session `id`, made on first use (by [`super::Service::start_worker`]).
    pub fn engine(&self, id: &str) -> Arc<Engine> {
        let mut map = self.engines.lock().unwrap_or_else(PoisonError::into_inner);
        map.entry(id.to_owned()).or_default().clone()
    }

    /// The engine of session `id` if its worker runs; never makes one, so a released
    /// session's engine, once dropped, stays dropped.
    fn live_engine(&self, id: &str) -> Option<Arc<Engine>> {
        let map = self.engines.lock().unwrap_or_else(PoisonError::into_inner);
        map.get(id).cloned()
    }

    /// Wakes session `id`'s worker, if it has one.
    fn wake(&self, id: &str) {
        if let Some(e) = self.live_engine(id) {
            e.wake.notify_one();
        }
    }

    /// Drops session `id`'s engine: its worker ended (the session was released).
    pub fn drop_engine(&self, id: &str) {
        let mut map = self.engines.lock().unwrap_or_else(PoisonError::into_inner);
        map.remove(id);
    }

    /// How many engines exist (one per session whose worker runs).
    pub fn engines(&self) -> usize {
        self.engines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// The ids of the sessions not released, oldest first.
    pub fn live_sessions(&self) -> Result<Vec<String>, CoreError> {
        Ok(self.store().live_sessions()?)
    }

    /// The protocol's view of a record.
    pub fn view(&self, store: &Store, rec: &SessionRecord) -> Result<Session, CoreError> {
        // A release dropped the session's items and results: nothing to count.
        let (in_flight, undelivered) = if rec.state == SessionState::Released {
            (0, 0)
        } else {
            store.counts(&rec.id)?
        };
        Ok(Session {
            id: rec.id.clone(),
            device: rec.device.clone(),
            host: rec.host.clone(),
            vm: rec.vm.clone(),
            epoch: rec.epoch,
            state: rec.state,
            in_flight,
            undelivered,
            moving_to: rec.moving_to.clone(),
            quiesce_deadline: rec.quiesce_deadline_ms.map(rfc3339),
            last_note: rec.last_note.clone(),
        })
    }

    fn record(store: &Store, id: &str) -> Result<SessionRecord, CoreError> {
        if !crate::protocol::valid_name(id) {
            return Err(
                Refusal::new(ErrorCode::Invalid, format!("{id:?} is not a session id")).into(),
            );
        }
        store
            .session(id)?
            .ok_or_else(|| Refusal::new(ErrorCode::NotFound, format!("no session {id}")).into())
    }

    pub fn devices(&self) -> Result<Vec<PoolDevice>, CoreError> {
        let store = self.store();
        let mut out = self.settings.devices.clone();
        for d in &mut out {
            d.session = store.session_of_device(&d.id)?;
        }
        Ok(out)
    }

    pub fn sessions(&self) -> Result<Vec<Session>, CoreError> {
        let store = self.store();
        store
            .sessions()?
            .iter()
            .map(|r| self.view(&store, r))
            .collect()
    }

    pub fn session(&self, id: &str) -> Result<Session, CoreError> {
        let store = self.store();
        let rec = Self::record(&store, id)?;
        self.view(&store, &rec)
    }

    /// Creates a session; the caller starts its worker.
    pub fn create(&self, req: &CreateSession) -> Result<Session, CoreError> {
        let mut store = self.store();
        if !self.settings.devices.iter().any(|d| d.id == req.device) {
            return Err(Refusal::new(
                ErrorCode::NotFound,
                format!("this pool has no device {:?}", req.device),
            )
            .into());
        }
        if let Some(holder) = store.session_of_device(&req.device)? {
            return Err(Refusal::new(
                ErrorCode::DeviceTaken,
                format!("device {} is held by session {holder}", req.device),
            )
            .into());
        }
        let num = store.next_session_number()?;
        let rec = state::create(&format!("s-{num}"), req, &self.rules())?;
        store.insert_session(num, &rec)?;
        self.view(&store, &rec)
    }

    /// Applies `cmd` to session `id`, writes the change, and answers with the session after.
    /// Read, decision and write happen under the store lock: two commands on one session are
    /// serialised, so an epoch check cannot race a resume.
    pub fn command(&self, id: &str, cmd: &Command) -> Result<(SessionRecord, bool), CoreError> {
        let mut store = self.store();
        let rec = Self::record(&store, id)?;
        match state::apply(&rec, cmd, &self.rules())? {
            Transition::Changed(next) => {
                store.update_session(&next)?;
                Ok((next, true))
            }
            Transition::Unchanged => Ok((rec, false)),
        }
    }

    /// Quiesce: record it, then wait for the worker to finish the item it is on (the clean
    /// point), so that when the reply says `quiesced` no item is being worked on.
    pub async fn quiesce(&self, id: &str, epoch: u64) -> Result<Quiesced, CoreError> {
        let (rec, changed) = self.command(id, &Command::Quiesce { epoch })?;
        if changed {
            tracing::info!(session = id, epoch, host = rec.host, "quiesced");
        }
        // No engine: the worker has ended (a release raced this quiesce), so no item is in
        // progress; the read below answers.
        if let Some(engine) = self.live_engine(id) {
            drop(engine.busy.lock().await);
        }
        let store = self.store();
        // Read again: the lease may have expired meanwhile (a lease shorter than an item).
        let now = Self::record(&store, id)?;
        if now.state != SessionState::Quiesced || now.epoch != epoch {
            return Err(Refusal {
                code: ErrorCode::StaleEpoch,
                message: format!(
                    "session {id} moved on to epoch {} while quiescing",
                    now.epoch
                ),
                current_epoch: Some(now.epoch),
            }
            .into());
        }
        let (in_flight, undelivered) = store.counts(id)?;
        Ok(Quiesced {
            epoch: now.epoch,
            state: now.state,
            in_flight,
            undelivered,
            quiesce_deadline: now.quiesce_deadline_ms.map(rfc3339),
        })
    }

    /// Applies `cmd` and answers with the session, waking its worker (a resume restarts it, a
    /// release ends it).
    pub fn change(&self, id: &str, cmd: &Command) -> Result<Session, CoreError> {
        let (rec, changed) = self.command(id, cmd)?;
        if changed {
            tracing::info!(session = id, epoch = rec.epoch, host = rec.host, state = %rec.state,
                note = rec.last_note.as_deref().unwrap_or(""), "session changed");
            self.wake(id);
        }
        let store = self.store();
        self.view(&store, &rec)
    }

    /// Resumes every quiesced session whose lease ran out on its last owner. Returns the ids.
    /// Reads only those sessions (an indexed query), so its cost does not grow with the
    /// history of released sessions.
    pub fn expire_leases(&self) -> Result<Vec<String>, CoreError> {
        let mut store = self.store();
        let rules = self.rules();
        let mut out = Vec::new();
        for rec in store.expired_leases(rules.now_ms)? {
            if let Transition::Changed(next) = state::apply(&rec, &Command::ExpireLease, &rules)? {
                store.update_session(&next)?;
                tracing::warn!(
                    session = rec.id,
                    epoch = next.epoch,
                    host = next.host,
                    "{}",
                    next.last_note.as_deref().unwrap_or("quiesce lease expired")
                );
                out.push(rec.id);
            }
        }
        drop(store);
        for id in &out {
            self.wake(id);
        }
        Ok(out)
    }

    /// Data plane: the owner `host` submits items.
    pub fn submit(&self, id: &str, host: &str, items: &[WorkItem]) -> Result<Submitted, CoreError> {
        if items.len() > MAX_SUBMIT {
            return Err(Refusal::new(
                ErrorCode::Invalid,
                format!(
                    "{} items in one submission (at most {MAX_SUBMIT})",
                    items.len()
                ),
            )
            .into());
        }
        if items.windows(2).any(|w| w[1].seq <= w[0].seq)
            || items.first().is_some_and(|i| i.seq == 0)
        {
            return Err(Refusal::new(
                ErrorCode::Invalid,
                "items must be numbered from 1, in increasing order",
            )
            .into());
        }
        if let Some(last) = items.last().filter(|i| i.seq > MAX_SEQ) {
            return Err(Refusal::new(
                ErrorCode::Invalid,
                format!(
                    "item number {} is too large: items are numbered up to {MAX_SEQ} (2^63 - 1)",
                    last.seq
                ),
            )
            .into());
        }
        let mut store = self.store();
        let rec = Self::record(&store, id)?;
        state::check_data_plane(&rec, host)?;
        let (accepted, repeated, last_seq) = store.submit(id, items)?;
        drop(store);
        if accepted > 0 {
            self.wake(id);
        }
        Ok(Submitted {
            accepted,
            repeated,
            last_seq,
            epoch: rec.epoch,
        })
    }

    /// Data plane: the owner `host` acknowledges results up to `ack` and fetches the next.
    pub fn fetch(
        &self,
        id: &str,
        host: &str,
        ack: u64,
        max: Option<u64>,
    ) -> Result<Results, CoreError> {
        if ack > MAX_SEQ {
            return Err(Refusal::new(
                ErrorCode::Invalid,
                format!("ack {ack} is too large: items are numbered up to {MAX_SEQ} (2^63 - 1)"),
            )
            .into());
        }
        let mut store = self.store();
        let rec = Self::record(&store, id)?;
        state::check_data_plane(&rec, host)?;
        let results = store.fetch(id, ack, max.unwrap_or(MAX_FETCH).clamp(1, MAX_FETCH))?;
        let (in_flight, _) = store.counts(id)?;
        Ok(Results {
            epoch: rec.epoch,
            results,
            in_flight,
        })
    }
}
