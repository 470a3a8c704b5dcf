//! The durable side of claims: a claim row per VM's hold on a device, the functions it holds
//! (`claim_functions`), and the events that record each change.
//!
//! A claim is decided and recorded in one `BEGIN IMMEDIATE` transaction: the snapshot the choice
//! is made from (devices, held functions, busy functions) is read under the write lock, so no
//! other claim or task can slip in between the choice and its insert. Concurrent claim changes
//! share that transaction and its one fsync ([`Store::change_claims`]), each in a savepoint of
//! its own and decided after the ones before it. The database refuses a
//! double booking on its own (a unique index on active functions, a trigger that keeps a PF apart
//! from its VFs), should any writer ever get that wrong.

use super::device_row::{DecodeError, Fields};
use super::task::active_sql;
use super::{insert_event, now_ms, NewEvent, Store, StoreError};
use crate::claim::lifecycle::{self, Step};
use crate::claim::{self, ClaimFunction, Held, Owner, Requirements, Snapshot};
use crate::model::claim::ClaimState;
use crate::model::device::Kind;
use crate::model::event::EventKind;
use crate::model::pci::PciAddress;
use rusqlite::{named_params, params, Connection, ErrorCode, OptionalExtension, Row};
use serde::Serialize;

/// One claim as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ClaimRecord {
    /// Increasing, never reused: the claim's D-Bus object is `/org/vfiod/Vfiod1/claim/<id>`.
    pub id: i64,
    /// The device the claim was made for.
    pub address: PciAddress,
    /// Every function it holds: the device first, then its IOMMU group-mates.
    pub functions: Vec<PciAddress>,
    pub vm_name: Option<String>,
    pub vm_uuid: Option<String>,
    /// The claimed device's kind when it was claimed; `None` for a row older than kinds.
    pub kind: Option<Kind>,
    pub state: ClaimState,
    /// The device's address inside the guest, once attached.
    pub guest_address: Option<String>,
    pub requested_by: String,
    /// Unix milliseconds.
    pub created_ms: i64,
    pub updated_ms: i64,
    /// When an unattached claim lapses; `None` for no lease.
    pub lease_expires_ms: Option<i64>,
    pub persistent: bool,
    pub released_ms: Option<i64>,
}

impl ClaimRecord {
    /// The name, else the UUID: how messages name the VM.
    pub fn vm(&self) -> &str {
        self.vm_name
            .as_deref()
            .or(self.vm_uuid.as_deref())
            .unwrap_or("?")
    }

    /// "claim 7 on 0000:3b:02.1 for vm1", the subject of its events.
    fn subject(&self) -> String {
        format!("claim {} on {} for {}", self.id, self.address, self.vm())
    }
}

const LAPSED_EXISTS: &str = "SELECT EXISTS (SELECT 1 FROM claims WHERE state = 'claimed' \
     AND lease_expires_ms IS NOT NULL AND lease_expires_ms <= ?1)";

const SELECT: &str =
    "SELECT id, address, vm_name, vm_uuid, kind, state, guest_address, requested_by, \
     created_ms, updated_ms, lease_expires_ms, persistent, released_ms FROM claims";

fn decode(row: &Row<'_>) -> Result<ClaimRecord, DecodeError> {
    let id: i64 = row.get("id").unwrap_or_default();
    let f = Fields {
        row,
        table: "claims",
        key: id.to_string(),
        columns: &[],
    };
    Ok(ClaimRecord {
        id,
        address: f.parse("address")?,
        functions: Vec::new(),
        vm_name: f.get("vm_name")?,
        vm_uuid: f.get("vm_uuid")?,
        kind: {
            let text: String = f.get("kind")?;
            if text.is_empty() {
                None
            } else {
                Some(f.parse("kind")?)
            }
        },
        state: f.parse("state")?,
        guest_address: f.get("guest_address")?,
        requested_by: f.get("requested_by")?,
        created_ms: f.get("created_ms")?,
        updated_ms: f.get("updated_ms")?,
        lease_expires_ms: f.get("lease_expires_ms")?,
        persistent: f.flag("persistent")?,
        released_ms: f.get("released_ms")?,
    })
}

/// What a step of a claim records besides its new state; `None` leaves a field as it is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimDetails {
    /// The domain's name and UUID as libvirt knows them (an attach fills in the one the claim
    /// was not made with).
    pub vm_name: Option<String>,
    pub vm_uuid: Option<String>,
    /// `Some(None)` clears it.
    pub guest_address: Option<Option<String>>,
}

/// One change of the claims, for [`Store::change_claims`].
#[derive(Clone, Debug)]
pub enum ClaimChange {
    /// Claim the best device matching `requirements` for `owner` (see [`Store::claim`]).
    Claim {
        requirements: Requirements,
        owner: Owner,
        requested_by: String,
    },
    /// Release claim `id` (see [`Store::release_claim`]).
    Release { id: i64, by: String, why: String },
}

impl Store {
    /// Chooses the best claimable device for `req` (see [`claim::choice`]) and records a claim
    /// on it and its IOMMU group-mates for `owner`, atomically and durably. Nothing claimable:
    /// `Unclaimable` with the reasons.
    pub fn claim(
        &self,
        req: &Requirements,
        owner: &Owner,
        requested_by: &str,
    ) -> Result<ClaimRecord, StoreError> {
        self.change_one(ClaimChange::Claim {
            requirements: req.clone(),
            owner: owner.clone(),
            requested_by: requested_by.to_string(),
        })
    }

    /// Releases claim `id`: its functions are free again; the row stays as history. Releasing a
    /// released claim is `ClaimReleased`.
    pub fn release_claim(&self, id: i64, by: &str, why: &str) -> Result<ClaimRecord, StoreError> {
        self.change_one(ClaimChange::Release {
            id,
            by: by.to_string(),
            why: why.to_string(),
        })
    }

    /// A domain is gone (undefined): releases its claims that are not persistent, and records
    /// for each persistent one that it is kept. Matches the claim's VM by UUID, else by name.
    /// Returns the claims released.
    pub fn domain_undefined(&self, name: &str, uuid: &str) -> Result<Vec<ClaimRecord>, StoreError> {
        let action = "release the claims of an undefined domain";
        let uuid = uuid.to_ascii_lowercase();
        self.write(action, |conn| {
            let ids: Vec<i64> = conn
                .prepare_cached(
                    "SELECT id FROM claims WHERE state <> 'released' \
                     AND (vm_uuid = ?2 OR (vm_uuid IS NULL AND vm_name = ?1)) ORDER BY id",
                )
                .and_then(|mut stmt| {
                    stmt.query_map(params![name, uuid], |r| r.get(0))?
                        .collect::<rusqlite::Result<_>>()
                })
                .map_err(|e| self.sqlite(action, e))?;
            let mut released = Vec::new();
            for id in ids {
                let claim = self.must_read_claim(conn, action, id)?;
                if claim.state != ClaimState::Claimed && !claim.persistent {
                    // A running domain that is undefined lives on as a transient one, with the
                    // device: the claim goes when the domain stops (the engine reconciles it then).
                    self.claim_event(
                        conn,
                        action,
                        &claim,
                        format!(
                            "{}: domain {name} was undefined while the claim is {}; it ends \
                             when the domain no longer runs",
                            claim.subject(),
                            claim.state
                        ),
                        now_ms(),
                    )?;
                } else if claim.persistent {
                    self.claim_event(
                        conn,
                        action,
                        &claim,
                        format!(
                            "{}: domain {name} was undefined; the claim is persistent and stays",
                            claim.subject()
                        ),
                        now_ms(),
                    )?;
                } else {
                    let why = format!("released: its domain {name} was undefined");
                    released.push(self.mark_released(conn, action, &claim, &why)?);
                }
            }
            Ok(released)
        })
    }

    /// Releases every claim whose lease has run out while it was only claimed (an attach under
    /// way or done keeps it), in one transaction; returns them released.
    pub fn release_lapsed_claims(&self, now: i64) -> Result<Vec<ClaimRecord>, StoreError> {
        let action = "release lapsed claims";
        // Looked for every second: a read first, so that a host without lapsed claims takes no
        // write lock for it.
        let any: bool = self
            .lock()
            .prepare_cached(LAPSED_EXISTS)
            .and_then(|mut stmt| stmt.query_row([now], |r| r.get(0)))
            .map_err(|e| self.sqlite(action, e))?;
        if !any {
            return Ok(Vec::new());
        }
        self.write(action, |conn| {
            let ids: Vec<i64> = conn
                .prepare_cached(
                    "SELECT id FROM claims WHERE state = 'claimed' \
                     AND lease_expires_ms IS NOT NULL AND lease_expires_ms <= ?1 ORDER BY id",
                )
                .and_then(|mut stmt| {
                    stmt.query_map([now], |r| r.get(0))?
                        .collect::<rusqlite::Result<_>>()
                })
                .map_err(|e| self.sqlite(action, e))?;
            let mut released = Vec::with_capacity(ids.len());
            for id in ids {
                let claim = self.must_read_claim(conn, action, id)?;
                let lease = (claim.lease_expires_ms.unwrap_or(now) - claim.created_ms) / 1000;
                let why = format!("released: its lease of {lease} s ran out before an attach");
                released.push(self.mark_released(conn, action, &claim, &why)?);
            }
            Ok(released)
        })
    }

    fn change_one(&self, change: ClaimChange) -> Result<ClaimRecord, StoreError> {
        self.change_claims(vec![change])
            .pop()
            .expect("one result per change")
    }

    /// Makes `changes` in order, as if one after the other, in one transaction with one commit
    /// (one fsync however many there are: concurrent requests share it). Each change is decided
    /// from what the changes before it left and is undone alone if it fails; a change that
    /// succeeded is durable when this returns, and if the transaction cannot commit every change
    /// fails. One result per change, in order.
    pub fn change_claims(&self, changes: Vec<ClaimChange>) -> Vec<Result<ClaimRecord, StoreError>> {
        let action = "record claim changes";
        // Devices and tasks are read once for the batch: claim changes do not write them, and
        // the write lock keeps everyone else from doing so until the commit.
        let mut snapshot: Option<Snapshot> = None;
        self.write_each(action, changes, |conn, change| match change {
            ClaimChange::Claim {
                requirements,
                owner,
                requested_by,
            } => {
                let s = match &mut snapshot {
                    Some(s) => s,
                    None => snapshot.insert(self.snapshot_in(conn, action)?),
                };
                s.held = self.held_in(conn, action)?;
                self.claim_in(conn, s, &requirements, &owner, &requested_by)
            }
            ClaimChange::Release { id, by, why } => self.release_in(conn, id, &by, &why),
        })
    }

    fn claim_in(
        &self,
        conn: &Connection,
        snapshot: &Snapshot,
        req: &Requirements,
        owner: &Owner,
        requested_by: &str,
    ) -> Result<ClaimRecord, StoreError> {
        if requested_by.trim().is_empty() {
            return Err(StoreError::InvalidArgument {
                reason: "requested_by must not be empty".into(),
            });
        }
        let action = "record a claim";
        let choice = claim::choose(snapshot, req).map_err(StoreError::Unclaimable)?;
        let now = now_ms();
        let lease = owner
            .lease_seconds
            .map(|s| now.saturating_add(i64::from(s) * 1000));
        let inserted = conn
            .prepare_cached(
                "INSERT INTO claims (address, vm_name, vm_uuid, kind, state, requested_by, \
                 created_ms, updated_ms, lease_expires_ms, persistent) \
                 VALUES (:address, :vm_name, :vm_uuid, :kind, :state, :requested_by, :now, \
                 :now, :lease, :persistent)",
            )
            .and_then(|mut stmt| {
                stmt.execute(named_params! {
                    ":address": choice.device.to_string(),
                    ":vm_name": owner.vm_name,
                    ":vm_uuid": owner.vm_uuid,
                    ":kind": choice.kind.as_str(),
                    ":state": ClaimState::Claimed.as_str(),
                    ":requested_by": requested_by,
                    ":now": now,
                    ":lease": lease,
                    ":persistent": owner.persistent,
                })
            });
        self.constraint_is_conflict(action, inserted)?;
        let id = conn.last_insert_rowid();
        for f in &choice.functions {
            self.hold(conn, action, id, f)?;
        }
        let claim = self.must_read_claim(conn, action, id)?;
        let mates: Vec<String> = claim.functions[1..].iter().map(|a| a.to_string()).collect();
        let with = if mates.is_empty() {
            String::new()
        } else {
            format!(" with {}", mates.join(", "))
        };
        let lease = match owner.lease_seconds {
            Some(s) => format!(", lease {s} s"),
            None => String::new(),
        };
        self.claim_event(
            conn,
            action,
            &claim,
            format!(
                "{}{with}: claimed by {requested_by}{lease}{}",
                claim.subject(),
                if claim.persistent { ", persistent" } else { "" }
            ),
            now,
        )?;
        Ok(claim)
    }

    fn release_in(
        &self,
        conn: &Connection,
        id: i64,
        by: &str,
        why: &str,
    ) -> Result<ClaimRecord, StoreError> {
        let action = "release a claim";
        let claim = self.must_read_claim(conn, action, id)?;
        if !claim.state.holds() {
            return Err(StoreError::ClaimReleased(id));
        }
        lifecycle::next(id, claim.state, Step::Release).map_err(StoreError::ClaimStep)?;
        self.mark_released(conn, action, &claim, &format!("released by {by} ({why})"))
    }

    fn mark_released(
        &self,
        conn: &Connection,
        action: &'static str,
        claim: &ClaimRecord,
        what: &str,
    ) -> Result<ClaimRecord, StoreError> {
        let now = now_ms();
        conn.prepare_cached(
            "UPDATE claims SET state = 'released', released_ms = ?2, updated_ms = ?2 \
             WHERE id = ?1",
        )
        .and_then(|mut stmt| stmt.execute(params![claim.id, now]))
        .and_then(|_| {
            conn.prepare_cached("UPDATE claim_functions SET active = 0 WHERE claim_id = ?1")
        })
        .and_then(|mut stmt| stmt.execute(params![claim.id]))
        .map_err(|e| self.sqlite(action, e))?;
        let released = self.must_read_claim(conn, action, claim.id)?;
        self.claim_event(
            conn,
            action,
            &released,
            format!("{}: {what}", released.subject()),
            now,
        )?;
        // In the same transaction: nothing can claim a function between its claim's end and
        // its clean.
        self.hold_released(conn, action, &released, now)?;
        Ok(released)
    }

    /// Takes `step` on claim `id` (see [`lifecycle::next`]) and records `details` with it; `what`
    /// says what happened, for the claim's event. A step to `released` frees the functions.
    pub fn step_claim(
        &self,
        id: i64,
        step: Step,
        details: ClaimDetails,
        what: &str,
    ) -> Result<ClaimRecord, StoreError> {
        let action = "record a claim's step";
        self.write(action, |conn| {
            let claim = self.must_read_claim(conn, action, id)?;
            if !claim.state.holds() {
                return Err(StoreError::ClaimReleased(id));
            }
            let state = lifecycle::next(id, claim.state, step).map_err(StoreError::ClaimStep)?;
            if state == ClaimState::Released {
                return self.mark_released(conn, action, &claim, what);
            }
            let now = now_ms();
            conn.prepare_cached(
                "UPDATE claims SET state = :state, updated_ms = :now, \
                 vm_name = COALESCE(:vm_name, vm_name), vm_uuid = COALESCE(:vm_uuid, vm_uuid), \
                 guest_address = CASE WHEN :set_guest THEN :guest ELSE guest_address END, \
                 lease_expires_ms = CASE WHEN :attached THEN NULL ELSE lease_expires_ms END \
                 WHERE id = :id",
            )
            .and_then(|mut stmt| {
                stmt.execute(named_params! {
                    ":state": state.as_str(),
                    ":now": now,
                    ":vm_name": details.vm_name,
                    ":vm_uuid": details.vm_uuid.map(|u| u.to_ascii_lowercase()),
                    ":set_guest": details.guest_address.is_some(),
                    ":guest": details.guest_address.flatten(),
                    // An attached claim never lapses, nor does one that was attached once.
                    ":attached": state == ClaimState::Attached,
                    ":id": id,
                })
            })
            .map_err(|e| self.sqlite(action, e))?;
            let changed = self.must_read_claim(conn, action, id)?;
            self.claim_event(
                conn,
                action,
                &changed,
                format!("{}: {what}", changed.subject()),
                now,
            )?;
            Ok(changed)
        })
    }

    /// Records `what` about claim `id` as its event, changing nothing else.
    pub fn claim_note(&self, id: i64, what: &str) -> Result<ClaimRecord, StoreError> {
        let action = "record a claim's event";
        self.write(action, |conn| {
            let claim = self.must_read_claim(conn, action, id)?;
            self.claim_event(
                conn,
                action,
                &claim,
                format!("{}: {what}", claim.subject()),
                now_ms(),
            )?;
            Ok(claim)
        })
    }

    /// The claim with this id, in any state.
    pub fn claim_record(&self, id: i64) -> Result<Option<ClaimRecord>, StoreError> {
        let conn = self.lock();
        self.read_claim(&conn, "read a claim", id)
    }

    /// Every claim that holds its functions, oldest first.
    pub fn active_claim_records(&self) -> Result<Vec<ClaimRecord>, StoreError> {
        let action = "read the active claims";
        let conn = self.lock();
        let ids: Vec<i64> = conn
            // The active claims by their partial index, not a walk of the whole history.
            .prepare_cached(
                "SELECT id FROM claims INDEXED BY claims_one_active_per_address \
                 WHERE state <> 'released' ORDER BY id",
            )
            .and_then(|mut stmt| {
                stmt.query_map([], |r| r.get(0))?
                    .collect::<rusqlite::Result<_>>()
            })
            .map_err(|e| self.sqlite(action, e))?;
        ids.into_iter()
            .map(|id| self.must_read_claim(&conn, action, id))
            .collect()
    }

    /// What a claim is decided from, read at one moment.
    pub fn claim_snapshot(&self) -> Result<Snapshot, StoreError> {
        let conn = self.lock();
        self.snapshot_in(&conn, "read what can be claimed")
    }

    /// Active claims (any state but released) holding any of `addresses`: (address, VM).
    pub fn active_claims(
        &self,
        addresses: &[PciAddress],
    ) -> Result<Vec<(PciAddress, String)>, StoreError> {
        let action = "read claims";
        let conn = self.lock();
        let mut out = Vec::new();
        for held in self.held_in(&conn, action)? {
            if addresses.contains(&held.address) {
                let claim = self.must_read_claim(&conn, action, held.claim_id)?;
                out.push((held.address, claim.vm().to_string()));
            }
        }
        Ok(out)
    }

    fn snapshot_in(&self, conn: &Connection, action: &'static str) -> Result<Snapshot, StoreError> {
        let devices = self.devices_in(conn)?;
        let splits = self
            .split_policy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .splits(&devices);
        Ok(Snapshot {
            devices,
            held: self.held_in(conn, action)?,
            busy: self.busy_in(conn, action)?,
            cleaning: self.clean_holds_in(conn, action)?,
            splits,
        })
    }

    /// Replaces the policy that says which PFs are split (the engine's, from its settings).
    pub fn set_split_policy(&self, policy: crate::claim::SplitPolicy) {
        *self.split_policy.lock().unwrap_or_else(|p| p.into_inner()) = policy;
    }

    fn held_in(&self, conn: &Connection, action: &'static str) -> Result<Vec<Held>, StoreError> {
        // The partial index holds only the active rows; without INDEXED BY, SQLite walks the
        // primary key (every function ever claimed) to save itself a sort of a few.
        let sql = "SELECT address, claim_id FROM claim_functions \
                   INDEXED BY claim_functions_one_active_per_address \
                   WHERE active = 1 ORDER BY claim_id";
        Ok(self
            .addresses_with_ids(conn, action, sql)?
            .into_iter()
            .map(|(address, claim_id)| Held { address, claim_id })
            .collect())
    }

    /// (address, id) rows of `sql`; a row whose address does not parse is not a function.
    fn addresses_with_ids(
        &self,
        conn: &Connection,
        action: &'static str,
        sql: &str,
    ) -> Result<Vec<(PciAddress, i64)>, StoreError> {
        let rows: Vec<(String, i64)> = conn
            .prepare_cached(sql)
            .and_then(|mut stmt| {
                stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                    .collect::<rusqlite::Result<_>>()
            })
            .map_err(|e| self.sqlite(action, e))?;
        Ok(rows
            .into_iter()
            .filter_map(|(a, id)| a.parse().ok().map(|a| (a, id)))
            .collect())
    }

    /// Every function an active task holds: its device and its scope.
    fn busy_in(
        &self,
        conn: &Connection,
        action: &'static str,
    ) -> Result<Vec<(PciAddress, i64)>, StoreError> {
        let active = active_sql();
        let sql = format!(
            "SELECT address, id FROM tasks WHERE {active} \
             UNION ALL \
             SELECT address, task_id FROM task_scope \
             WHERE task_id IN (SELECT id FROM tasks WHERE {active})"
        );
        self.addresses_with_ids(conn, action, &sql)
    }

    fn hold(
        &self,
        conn: &Connection,
        action: &'static str,
        claim_id: i64,
        f: &ClaimFunction,
    ) -> Result<(), StoreError> {
        let inserted = conn
            .prepare_cached(
                "INSERT INTO claim_functions (claim_id, address, family, is_pf) \
                 VALUES (?1, ?2, ?3, ?4)",
            )
            .and_then(|mut stmt| {
                stmt.execute(params![
                    claim_id,
                    f.address.to_string(),
                    f.family.map(|a| a.to_string()),
                    f.is_pf
                ])
            });
        self.constraint_is_conflict(action, inserted)
    }

    /// A constraint the database refused: reachable only should a writer skip the snapshot's
    /// checks, and then a conflict rather than an I/O failure.
    fn constraint_is_conflict(
        &self,
        action: &'static str,
        result: rusqlite::Result<usize>,
    ) -> Result<(), StoreError> {
        match result {
            Ok(_) => Ok(()),
            Err(e) if e.sqlite_error_code() == Some(ErrorCode::ConstraintViolation) => {
                Err(StoreError::ClaimConflict(e.to_string()))
            }
            Err(e) => Err(self.sqlite(action, e)),
        }
    }

    fn read_claim(
        &self,
        conn: &Connection,
        action: &'static str,
        id: i64,
    ) -> Result<Option<ClaimRecord>, StoreError> {
        let claim = conn
            .prepare_cached(&format!("{SELECT} WHERE id = ?1"))
            .and_then(|mut stmt| stmt.query_row([id], |row| Ok(decode(row))).optional())
            .map_err(|e| self.sqlite(action, e))?;
        let Some(claim) = claim else {
            return Ok(None);
        };
        let mut claim = claim.map_err(|e| self.decode(e))?;
        let functions: Vec<String> = conn
            .prepare_cached(
                "SELECT address FROM claim_functions WHERE claim_id = ?1 ORDER BY rowid",
            )
            .and_then(|mut stmt| {
                stmt.query_map([id], |r| r.get(0))?
                    .collect::<rusqlite::Result<_>>()
            })
            .map_err(|e| self.sqlite(action, e))?;
        claim.functions = functions.iter().filter_map(|a| a.parse().ok()).collect();
        Ok(Some(claim))
    }

    fn must_read_claim(
        &self,
        conn: &Connection,
        action: &'static str,
        id: i64,
    ) -> Result<ClaimRecord, StoreError> {
        self.read_claim(conn, action, id)?
            .ok_or(StoreError::NoSuchClaim(id))
    }

    fn claim_event(
        &self,
        conn: &Connection,
        action: &'static str,
        claim: &ClaimRecord,
        message: String,
        now: i64,
    ) -> Result<(), StoreError> {
        insert_event(
            conn,
            &NewEvent::new(Some(claim.address), EventKind::Claim, message),
            now,
        )
        .map(drop)
        .map_err(|e| self.sqlite(action, e))
    }
}
