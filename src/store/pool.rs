//! Pooled claims (a remote pool's session leased to a VM): their rows, and each step recorded
//! with its event in one transaction, so that `vfioctl events` shows every step with the time
//! it was committed.

use super::device_row::{DecodeError, Fields};
use super::{insert_event, now_ms, NewEvent, Store, StoreError};
use crate::model::event::EventKind;
use crate::model::pool::{PooledClaim, PooledState};
use rusqlite::{params, Connection, OptionalExtension, Row};

const SELECT: &str = "SELECT id, pool, session, device, epoch, state, reason, vm_name, vm_uuid, \
     peer_host, requested_by, created_ms, updated_ms FROM pooled_claims";

fn decode(row: &Row<'_>) -> Result<PooledClaim, DecodeError> {
    let id: i64 = row.get("id").unwrap_or_default();
    let f = Fields {
        row,
        table: "pooled_claims",
        key: id.to_string(),
        columns: &[],
    };
    Ok(PooledClaim {
        id,
        pool: f.get("pool")?,
        session: f.get("session")?,
        device: f.get("device")?,
        epoch: f.int("epoch")?,
        state: f.parse("state")?,
        reason: f.get("reason")?,
        vm_name: f.get("vm_name")?,
        vm_uuid: f.get("vm_uuid")?,
        peer_host: f.get("peer_host")?,
        requested_by: f.get("requested_by")?,
        created_ms: f.get("created_ms")?,
        updated_ms: f.get("updated_ms")?,
    })
}

/// A pooled claim to record: the session the pool gave (or is moving here).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewPooled {
    pub pool: String,
    pub session: String,
    pub device: String,
    pub epoch: u64,
    pub state: PooledState,
    pub vm_name: Option<String>,
    pub vm_uuid: Option<String>,
    pub peer_host: Option<String>,
    pub requested_by: String,
}

/// One step of a pooled claim: its new state, epoch and reason (`None` keeps the epoch).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PooledStep {
    pub state: PooledState,
    pub epoch: Option<u64>,
    pub reason: String,
}

impl Store {
    /// Records a new pooled claim and its event ("`what`"). A session that already has a
    /// standing claim on this host is refused.
    pub fn insert_pooled(&self, new: &NewPooled, what: &str) -> Result<PooledClaim, StoreError> {
        let action = "record a pooled claim";
        self.write(action, |conn| {
            let now = now_ms();
            let epoch = i64::try_from(new.epoch).map_err(|_| StoreError::InvalidArgument {
                reason: format!("epoch {} is out of range", new.epoch),
            })?;
            conn.execute(
                "INSERT INTO pooled_claims (pool, session, device, epoch, state, vm_name, \
                 vm_uuid, peer_host, requested_by, created_ms, updated_ms) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?10)",
                params![
                    new.pool,
                    new.session,
                    new.device,
                    epoch,
                    new.state.as_str(),
                    new.vm_name,
                    new.vm_uuid,
                    new.peer_host,
                    new.requested_by,
                    now
                ],
            )
            .map_err(|e| match e {
                rusqlite::Error::SqliteFailure(f, _)
                    if f.code == rusqlite::ErrorCode::ConstraintViolation =>
                {
                    StoreError::InvalidArgument {
                        reason: format!(
                            "session {} of pool {} already has a pooled claim on this host",
                            new.session, new.pool
                        ),
                    }
                }
                e => self.sqlite(action, e),
            })?;
            let id = conn.last_insert_rowid();
            let claim = self
                .read_pooled_in(conn, action, id)?
                .expect("just inserted");
            insert_event(conn, &pooled_event(&claim, what), now)
                .map_err(|e| self.sqlite(action, e))?;
            Ok(claim)
        })
    }

    /// Takes `step` on pooled claim `id` and records its event ("`what`"), in one transaction.
    pub fn step_pooled(
        &self,
        id: i64,
        step: &PooledStep,
        what: &str,
    ) -> Result<PooledClaim, StoreError> {
        let action = "record a pooled claim's step";
        self.write(action, |conn| {
            let now = now_ms();
            let old = self
                .read_pooled_in(conn, action, id)?
                .ok_or(StoreError::NoSuchClaim(id))?;
            if old.state.ended() {
                return Err(StoreError::ClaimReleased(id));
            }
            let epoch = step.epoch.unwrap_or(old.epoch);
            let epoch = i64::try_from(epoch).map_err(|_| StoreError::InvalidArgument {
                reason: format!("epoch {epoch} is out of range"),
            })?;
            conn.execute(
                // A session that runs here (leased) has landed: it is no longer incoming, and
                // a later stop of its domain must not take it for a failed incoming migration.
                "UPDATE pooled_claims SET state = ?2, epoch = ?3, reason = ?4, updated_ms = ?5, \
                 peer_host = CASE WHEN ?2 = 'leased' THEN NULL ELSE peer_host END WHERE id = ?1",
                params![id, step.state.as_str(), epoch, step.reason, now],
            )
            .map_err(|e| self.sqlite(action, e))?;
            let claim = self
                .read_pooled_in(conn, action, id)?
                .expect("just updated");
            insert_event(conn, &pooled_event(&claim, what), now)
                .map_err(|e| self.sqlite(action, e))?;
            Ok(claim)
        })
    }

    /// Records an event about pooled claim `claim` without changing it (a call that will be
    /// retried, a metadata write that failed).
    pub fn note_pooled(&self, claim: &PooledClaim, what: &str) -> Result<(), StoreError> {
        self.record_event(pooled_event(claim, what)).map(drop)
    }

    pub fn pooled_claim(&self, id: i64) -> Result<Option<PooledClaim>, StoreError> {
        let conn = self.lock();
        self.read_pooled_in(&conn, "read a pooled claim", id)
    }

    /// The pooled claims, oldest first: the standing ones (leased, moving, quiesced, error), or
    /// every one with `history`.
    pub fn pooled_claims(&self, history: bool) -> Result<Vec<PooledClaim>, StoreError> {
        let action = "read the pooled claims";
        let conn = self.lock();
        let sql = if history {
            format!("{SELECT} ORDER BY id")
        } else {
            format!("{SELECT} WHERE state NOT IN ('released', 'forgotten') ORDER BY id")
        };
        let mut stmt = conn
            .prepare_cached(&sql)
            .map_err(|e| self.sqlite(action, e))?;
        let mut rows = stmt.query([]).map_err(|e| self.sqlite(action, e))?;
        let mut out = Vec::new();
        while let Some(row) = rows.next().map_err(|e| self.sqlite(action, e))? {
            out.push(decode(row).map_err(|e| self.decode(e))?);
        }
        Ok(out)
    }

    /// The standing pooled claims of a domain (by UUID when known, else by name).
    pub fn pooled_of_domain(
        &self,
        name: &str,
        uuid: Option<&str>,
    ) -> Result<Vec<PooledClaim>, StoreError> {
        Ok(self
            .pooled_claims(false)?
            .into_iter()
            .filter(|c| c.of_domain(name, uuid))
            .collect())
    }

    fn read_pooled_in(
        &self,
        conn: &Connection,
        action: &'static str,
        id: i64,
    ) -> Result<Option<PooledClaim>, StoreError> {
        let mut stmt = conn
            .prepare_cached(&format!("{SELECT} WHERE id = ?1"))
            .map_err(|e| self.sqlite(action, e))?;
        let found = stmt
            .query_row(params![id], |row| Ok(decode(row)))
            .optional()
            .map_err(|e| self.sqlite(action, e))?;
        found.transpose().map_err(|e| self.decode(e))
    }
}

/// The history entry of a pooled claim's step: no PCI address (the device is the pool's).
fn pooled_event(c: &PooledClaim, what: &str) -> NewEvent {
    NewEvent::new(
        None,
        EventKind::Pool,
        format!(
            "pooled claim {} (pool {}, session {}, device {}, VM {}): {what} [{} epoch {}]",
            c.id,
            c.pool,
            c.session,
            c.device,
            c.vm(),
            c.state,
            c.epoch
        ),
    )
}
