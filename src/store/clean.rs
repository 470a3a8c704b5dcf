//! Cleaning between tenants, recorded (issue 23): which functions are held out of the pool for
//! a clean (`cleaning`), and each function's reset history (`reset_health`).
//!
//! The hold is written in the transaction that ends a claim ([`Store::hold_released`], called
//! wherever a claim is marked released), so that no claim can take a function between its
//! claim's end and its clean: the claim rules read the holds in the claim's own transaction
//! (`claim_snapshot`). Which functions a claim's end holds is the configuration's
//! ([`CleanPolicy`], set by the engine at start and at each reload); what a clean found is the
//! clean job's ([`CleanOutcome`]), recorded here with its history.

use super::{insert_event, now_ms, ClaimRecord, NewEvent, Store, StoreError};
use crate::config::{CleanMode, Selector, Settings};
use crate::model::clean::{CleanHold, HoldState, ResetHealth};
use crate::model::device::Device;
use crate::model::event::EventKind;
use crate::model::pci::PciAddress;
use rusqlite::{params, Connection, OptionalExtension, Row};
use std::sync::Arc;

/// Which functions the end of a claim holds for a clean: the configuration's answer, as plain
/// data the store can apply inside the transaction that ends the claim.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CleanPolicy {
    /// `[claims] clean = "reset"`: every managed function.
    every_managed: bool,
    /// `[[clean]]` entries: the functions they match, whatever `[claims] clean` says.
    rules: Vec<Selector>,
}

impl CleanPolicy {
    /// Nothing is cleaned: what a store opened without a daemon does.
    pub fn none() -> CleanPolicy {
        CleanPolicy::default()
    }

    /// The policy of `settings` (see [`Settings::cleans_at_claim_end`]).
    pub fn of(settings: &Settings) -> CleanPolicy {
        CleanPolicy {
            every_managed: settings.claims.clean == CleanMode::Reset,
            rules: settings.clean.iter().map(|r| r.selector.clone()).collect(),
        }
    }

    /// Whether the end of a claim on `d` holds it for a clean. Only a managed function: vfiod
    /// changes nothing else, and claims never hold anything else.
    pub fn applies(&self, d: &Device) -> bool {
        d.managed
            && (self.every_managed
                || self
                    .rules
                    .iter()
                    .any(|s| s.matches(d.address, d.vendor_id, d.device_id, d.class)))
    }
}

/// What a clean found for one function, as the clean job reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FunctionClean {
    pub address: PciAddress,
    /// The reset that worked and how long it took (ms); `None` when no reset worked or none
    /// was done.
    pub reset: Option<(String, i64)>,
    /// What went wrong; `None` when the function is clean.
    pub failure: Option<String>,
    /// Whether the failure keeps it out of the pool until an operator clears it.
    pub quarantine: bool,
}

/// What a clean found, per function of its group.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CleanOutcome {
    pub functions: Vec<FunctionClean>,
}

const HOLD_COLUMNS: &str = "SELECT address, state, reason, claim_id, since_ms FROM cleaning";

fn decode_hold(row: &Row<'_>) -> rusqlite::Result<Option<CleanHold>> {
    let (address, state): (String, String) = (row.get(0)?, row.get(1)?);
    // A row this build cannot read holds nothing it knows of; it is left alone.
    let (Ok(address), Ok(state)) = (address.parse(), state.parse::<HoldState>()) else {
        return Ok(None);
    };
    Ok(Some(CleanHold {
        address,
        state,
        reason: row.get(2)?,
        claim_id: row.get(3)?,
        since_ms: row.get(4)?,
    }))
}

fn decode_health(row: &Row<'_>) -> rusqlite::Result<ResetHealth> {
    Ok(ResetHealth {
        method: row.get(0)?,
        duration_ms: row.get(1)?,
        ok_ms: row.get(2)?,
        failure: row.get(3)?,
        failure_ms: row.get(4)?,
        failures_in_row: u32::try_from(row.get::<_, i64>(5)?).unwrap_or(u32::MAX),
        cleans: u32::try_from(row.get::<_, i64>(6)?).unwrap_or(u32::MAX),
    })
}

impl Store {
    /// Replaces the policy the end of a claim applies (the engine's, from its settings).
    pub fn set_clean_policy(&self, policy: CleanPolicy) {
        *self.clean_policy.lock().unwrap_or_else(|p| p.into_inner()) = policy;
    }

    fn clean_policy(&self) -> CleanPolicy {
        self.clean_policy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Woken after a write held functions for a clean (a permit is kept if nobody waits).
    pub fn clean_wanted(&self) -> Arc<tokio::sync::Notify> {
        Arc::clone(&self.clean_wanted)
    }

    /// Inside the transaction that ended `claim`: holds each of its functions the policy
    /// cleans, and records it. A function already held (quarantined, say) keeps its hold.
    pub(super) fn hold_released(
        &self,
        conn: &Connection,
        action: &'static str,
        claim: &ClaimRecord,
        now: i64,
    ) -> Result<(), StoreError> {
        let policy = self.clean_policy();
        let mut held = Vec::new();
        for &address in &claim.functions {
            // Gone meanwhile: nothing to clean (a VF that comes back is a new function).
            let Some(device) = self.device_in(conn, address)? else {
                continue;
            };
            if !policy.applies(&device) {
                continue;
            }
            let reason = format!("claim {} of VM {} ended", claim.id, claim.vm());
            let inserted = conn
                .prepare_cached(
                    "INSERT INTO cleaning (address, state, reason, claim_id, since_ms) \
                     VALUES (?1, 'pending', ?2, ?3, ?4) ON CONFLICT (address) DO NOTHING",
                )
                .and_then(|mut stmt| {
                    stmt.execute(params![address.to_string(), reason, claim.id, now])
                })
                .map_err(|e| self.sqlite(action, e))?;
            if inserted > 0 {
                held.push(address);
            }
        }
        for address in &held {
            let message = format!(
                "{address} is held out of the pool until it is cleaned (claim {} ended)",
                claim.id
            );
            insert_event(
                conn,
                &NewEvent::new(Some(*address), EventKind::Clean, message),
                now,
            )
            .map_err(|e| self.sqlite(action, e))?;
        }
        if !held.is_empty() {
            // The cleaner reads after this transaction: it needs the connection this holds.
            self.clean_wanted.notify_one();
        }
        Ok(())
    }

    /// Every function held for a clean, in address order.
    pub fn clean_holds(&self) -> Result<Vec<CleanHold>, StoreError> {
        let conn = self.lock();
        self.clean_holds_in(&conn, "read the cleaning holds")
    }

    pub(super) fn clean_holds_in(
        &self,
        conn: &Connection,
        action: &'static str,
    ) -> Result<Vec<CleanHold>, StoreError> {
        let mut holds: Vec<CleanHold> = conn
            .prepare_cached(HOLD_COLUMNS)
            .and_then(|mut stmt| {
                stmt.query_map([], decode_hold)?
                    .collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(|e| self.sqlite(action, e))?
            .into_iter()
            .flatten()
            .collect();
        holds.sort_by_key(|h| h.address);
        Ok(holds)
    }

    /// The hold on `address`, if any.
    pub fn clean_hold(&self, address: PciAddress) -> Result<Option<CleanHold>, StoreError> {
        let action = "read a cleaning hold";
        let conn = self.lock();
        conn.prepare_cached(&format!("{HOLD_COLUMNS} WHERE address = ?1"))
            .and_then(|mut stmt| {
                stmt.query_row([address.to_string()], decode_hold)
                    .optional()
            })
            .map(Option::flatten)
            .map_err(|e| self.sqlite(action, e))
    }

    /// An operator's clean of `addresses` (`Device.Clean`): each is held until it succeeds, as
    /// after a claim. A function already held keeps its hold.
    pub fn hold_on_demand(&self, addresses: &[PciAddress], by: &str) -> Result<(), StoreError> {
        let action = "hold functions for a clean";
        self.write(action, |conn| {
            let now = now_ms();
            for address in addresses {
                conn.prepare_cached(
                    "INSERT INTO cleaning (address, state, reason, claim_id, since_ms) \
                     VALUES (?1, 'pending', ?2, NULL, ?3) ON CONFLICT (address) DO NOTHING",
                )
                .and_then(|mut stmt| {
                    stmt.execute(params![
                        address.to_string(),
                        format!("cleaning asked for by {by}"),
                        now
                    ])
                })
                .map_err(|e| self.sqlite(action, e))?;
            }
            Ok(())
        })
    }

    /// Records what a clean found: a clean function leaves its hold (back in the pool), a
    /// failed one keeps it, quarantined when the outcome says so; the reset history of each is
    /// updated; each gets an event.
    pub fn clean_finished(&self, outcome: &CleanOutcome) -> Result<(), StoreError> {
        let action = "record a clean";
        self.write(action, |conn| {
            let now = now_ms();
            for f in &outcome.functions {
                let address = f.address.to_string();
                let (method, duration) = f
                    .reset
                    .clone()
                    .map_or((None, None), |(m, d)| (Some(m), Some(d)));
                conn.prepare_cached(
                    "INSERT INTO reset_health (address) VALUES (?1) \
                     ON CONFLICT (address) DO NOTHING",
                )
                .and_then(|mut stmt| stmt.execute([&address]))
                .map_err(|e| self.sqlite(action, e))?;
                let message = match &f.failure {
                    None => {
                        conn.prepare_cached(
                            "UPDATE reset_health SET method = coalesce(?2, method), \
                             duration_ms = coalesce(?3, duration_ms), ok_ms = ?4, \
                             failures_in_row = 0, cleans = cleans + 1 WHERE address = ?1",
                        )
                        .and_then(|mut stmt| stmt.execute(params![address, method, duration, now]))
                        .and_then(|_| {
                            conn.prepare_cached("DELETE FROM cleaning WHERE address = ?1")
                        })
                        .and_then(|mut stmt| stmt.execute([&address]))
                        .map_err(|e| self.sqlite(action, e))?;
                        match &f.reset {
                            Some((m, d)) => format!(
                                "{address} is clean (reset: {m}, {d} ms; healthy): back in the pool"
                            ),
                            None => format!("{address} is clean (healthy): back in the pool"),
                        }
                    }
                    Some(failure) => {
                        conn.prepare_cached(
                            "UPDATE reset_health SET method = coalesce(?2, method), \
                             duration_ms = coalesce(?3, duration_ms), failure = ?4, \
                             failure_ms = ?5, failures_in_row = failures_in_row + 1 \
                             WHERE address = ?1",
                        )
                        .and_then(|mut stmt| {
                            stmt.execute(params![address, method, duration, failure, now])
                        })
                        .map_err(|e| self.sqlite(action, e))?;
                        if f.quarantine {
                            conn.prepare_cached(
                                "INSERT INTO cleaning (address, state, reason, claim_id, since_ms) \
                                 VALUES (?1, 'quarantined', ?2, NULL, ?3) \
                                 ON CONFLICT (address) DO UPDATE SET state = 'quarantined', \
                                 reason = excluded.reason, since_ms = excluded.since_ms",
                            )
                            .and_then(|mut stmt| stmt.execute(params![address, failure, now]))
                            .map_err(|e| self.sqlite(action, e))?;
                            format!(
                                "{address} is quarantined: {failure} (out of the pool until an \
                                 operator resets its task: vfioctl task reset {address})"
                            )
                        } else {
                            format!("{address} could not be cleaned: {failure}")
                        }
                    }
                };
                insert_event(
                    conn,
                    &NewEvent::new(Some(f.address), EventKind::Clean, message),
                    now,
                )
                .map_err(|e| self.sqlite(action, e))?;
            }
            Ok(())
        })
    }

    /// The reset history of `address`, if it was ever cleaned.
    pub fn reset_health(&self, address: PciAddress) -> Result<Option<ResetHealth>, StoreError> {
        let action = "read a reset history";
        let conn = self.lock();
        conn.prepare_cached(
            "SELECT method, duration_ms, ok_ms, failure, failure_ms, failures_in_row, cleans \
             FROM reset_health WHERE address = ?1",
        )
        .and_then(|mut stmt| {
            stmt.query_row([address.to_string()], decode_health)
                .optional()
        })
        .map_err(|e| self.sqlite(action, e))
    }

    /// Inside the transaction that resets a clean's task: an operator cleared it, so each of
    /// `addresses` that is quarantined is held for a new clean, with its failures in a row
    /// forgotten; it returns to the pool only when that clean succeeds. One that was held but
    /// not quarantined keeps its count. Returns those released.
    pub(super) fn release_quarantine_in(
        &self,
        conn: &Connection,
        action: &'static str,
        addresses: &[PciAddress],
        by: &str,
        now: i64,
    ) -> Result<Vec<PciAddress>, StoreError> {
        let mut released = Vec::new();
        for address in addresses {
            let changed = conn
                .prepare_cached(
                    "UPDATE cleaning SET state = 'pending', reason = ?2, since_ms = ?3 \
                     WHERE address = ?1 AND state = 'quarantined'",
                )
                .and_then(|mut stmt| {
                    stmt.execute(params![
                        address.to_string(),
                        format!("quarantine cleared by {by}: cleaned again before it returns"),
                        now
                    ])
                })
                .map_err(|e| self.sqlite(action, e))?;
            if changed > 0 {
                // Only a quarantine's end forgets the failures: a failed clean that was not
                // quarantined counts on, so that the next failure in a row quarantines.
                conn.prepare_cached(
                    "UPDATE reset_health SET failures_in_row = 0 WHERE address = ?1",
                )
                .and_then(|mut stmt| stmt.execute([address.to_string()]))
                .map_err(|e| self.sqlite(action, e))?;
                insert_event(
                    conn,
                    &NewEvent::new(
                        Some(*address),
                        EventKind::Clean,
                        format!(
                            "{address}: quarantine cleared by {by}; it is cleaned again before \
                             it returns to the pool"
                        ),
                    ),
                    now,
                )
                .map_err(|e| self.sqlite(action, e))?;
                released.push(*address);
            }
        }
        // The reset frees the functions of the task: their holds want a new clean.
        self.clean_wanted.notify_one();
        Ok(released)
    }

    /// Lets go of the hold on a function that is gone (nothing left to clean), with `why`.
    pub fn drop_clean_hold(&self, address: PciAddress, why: &str) -> Result<(), StoreError> {
        let action = "drop a cleaning hold";
        self.write(action, |conn| {
            let removed = conn
                .prepare_cached("DELETE FROM cleaning WHERE address = ?1")
                .and_then(|mut stmt| stmt.execute([address.to_string()]))
                .map_err(|e| self.sqlite(action, e))?;
            if removed > 0 {
                insert_event(
                    conn,
                    &NewEvent::new(
                        Some(address),
                        EventKind::Clean,
                        format!("{address}: cleaning hold dropped: {why}"),
                    ),
                    now_ms(),
                )
                .map_err(|e| self.sqlite(action, e))?;
            }
            Ok(())
        })
    }
}
