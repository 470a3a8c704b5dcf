//! The stand-in user-mode driver: what an application's driver inside a VM does with a pooled
//! device, reduced to what a migration can break. It streams numbered work items to a session,
//! keeps its own state (the next item to submit, which results it holds), follows the session
//! when it moves to another host (told by [`DriverHandle::move_to`], or by re-reading the
//! session when the pool refuses the old host), and reports what it lost, what came twice, what
//! came wrong, and the longest time without a result (the pause a move cost).
//!
//! A library, so that tests and the demo run it in-process next to the code that moves the
//! session; `vfiod-pool drive` runs it from a shell.

use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::watch;

use crate::client::{PoolClient, PoolError};
use crate::protocol::{work_value, ErrorCode, SessionState, WorkItem};

/// How to drive a session.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    pub session: String,
    /// The host the driver starts on.
    pub host: String,
    /// How many items to stream (numbered 1..=items).
    pub items: u64,
    /// The most items submitted and without a result at any time.
    pub window: u64,
    /// The most items in one submission.
    pub batch: u64,
    /// On a refusal of its host (`not_owner`), re-read the session to learn the new owner.
    /// Off: only [`DriverHandle::move_to`] moves the driver (a VM's driver learns it from the
    /// host it runs on).
    pub follow_session: bool,
    /// The pause after a round that moved nothing.
    pub poll: Duration,
    /// The longest pause after refusals in a row (quiesced, unreachable): the pause doubles
    /// from `poll` up to this, so that a quiesced pool is not hammered for the whole window.
    pub backoff_max: Duration,
    /// Stop when nothing moved for this long; the items without a result then count as lost.
    pub give_up: Duration,
    /// Seed of the payloads (item `n` carries a payload derived from the seed and `n`).
    pub seed: u64,
}

impl DriverConfig {
    /// `items` items on `session` from `host`: window 64, batches of 16, following the session,
    /// polling every 2 ms (backing off to 50 ms while refused), giving up after 10 s without
    /// progress.
    pub fn new(session: &str, host: &str, items: u64) -> DriverConfig {
        DriverConfig {
            session: session.to_owned(),
            host: host.to_owned(),
            items,
            window: 64,
            batch: 16,
            follow_session: true,
            poll: Duration::from_millis(2),
            backoff_max: Duration::from_millis(50),
            give_up: Duration::from_secs(10),
            seed: 0x5eed,
        }
    }
}

/// The payload of item `seq`.
pub fn payload(seed: u64, seq: u64) -> u64 {
    seed.rotate_left(17) ^ seq.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// A change of host the driver made.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DriverMove {
    /// Since the driver started.
    #[serde(rename = "at_ms", serialize_with = "ser_ms")]
    pub at: Duration,
    pub from: String,
    pub to: String,
    /// `told` (by the handle) or `session` (read from the pool after a refusal).
    pub how: &'static str,
}

/// What a drive ended with.
#[derive(Clone, Debug, Serialize)]
pub struct DriveReport {
    pub session: String,
    /// The host the driver ended on.
    pub host: String,
    /// Items submitted (and accepted by the pool).
    pub submitted: u64,
    /// Distinct results received.
    pub received: u64,
    /// Submitted items whose result never came.
    pub lost: u64,
    /// Results received for an item the driver already had a result for.
    pub duplicated: u64,
    /// Results whose value is not the item's (or for an item never submitted).
    pub wrong: u64,
    /// The longest time between two results: the pause window of a move.
    #[serde(rename = "longest_gap_ms", serialize_with = "ser_ms")]
    pub longest_gap: Duration,
    /// When that gap ended, since the start.
    #[serde(rename = "longest_gap_end_ms", serialize_with = "ser_ms")]
    pub longest_gap_end: Duration,
    /// Refusals (`not_owner`, `quiesced`) and unanswered calls the driver waited through.
    pub waits: u64,
    pub moves: Vec<DriverMove>,
    #[serde(rename = "elapsed_ms", serialize_with = "ser_ms")]
    pub elapsed: Duration,
    /// False when the driver gave up (nothing moved for `give_up`) or was stopped.
    pub complete: bool,
}

fn ser_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1000.0)
}

impl std::fmt::Display for DriveReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "session {}: {} items submitted, {} results, {} lost, {} duplicated, {} wrong",
            self.session, self.submitted, self.received, self.lost, self.duplicated, self.wrong
        )?;
        for m in &self.moves {
            writeln!(
                f,
                "  +{:.1} ms: moved from {} to {} ({})",
                ms(m.at),
                m.from,
                m.to,
                m.how
            )?;
        }
        write!(
            f,
            "longest pause without results: {:.1} ms (ended at +{:.1} ms); {:.1} ms in all{}",
            ms(self.longest_gap),
            ms(self.longest_gap_end),
            ms(self.elapsed),
            if self.complete { "" } else { " (incomplete)" }
        )
    }
}

/// The pause after a round that moved nothing: `poll`, doubled for each refusal in a row, at
/// most `max` (and never below `poll`).
pub fn pause(poll: Duration, max: Duration, refusals: u32) -> Duration {
    let doubled = poll.saturating_mul(1u32 << refusals.min(16));
    doubled.min(max).max(poll)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Where a running driver is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub submitted: u64,
    pub received: u64,
    pub host: String,
}

/// Why a drive stopped without a report.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("session {session}: {what}")]
    Pool {
        session: String,
        what: &'static str,
        #[source]
        source: PoolError,
    },
    /// The session has items numbered past any this driver sent: another driver streamed to it
    /// before. Its results went to that driver, so this one would wait for them forever.
    #[error(
        "session {session}: the pool has items up to {last_seq}, this driver sent up to {ours}: \
         another driver numbered this session's items (a driver streams to a session once)"
    )]
    Foreign {
        session: String,
        last_seq: u64,
        ours: u64,
    },
}

/// Tells a running driver where it runs, and shows its progress.
pub struct DriverHandle {
    host: watch::Sender<String>,
    progress: watch::Receiver<Progress>,
    stop: watch::Sender<bool>,
}

impl DriverHandle {
    /// The driver now runs on `host` (the VM landed there).
    pub fn move_to(&self, host: &str) {
        self.host.send_replace(host.to_owned());
    }

    /// Where the driver is.
    pub fn progress(&self) -> Progress {
        self.progress.borrow().clone()
    }

    /// Waits until the driver holds at least `n` results (or it ended).
    pub async fn wait_received(&self, n: u64) -> Progress {
        let mut rx = self.progress.clone();
        let _ = rx.wait_for(|p| p.received >= n).await;
        let p = rx.borrow().clone();
        p
    }

    /// Asks the driver to stop after its current round; its report says `complete: false`.
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }
}

/// A driver ready to run.
pub struct Driver {
    client: PoolClient,
    cfg: DriverConfig,
    host: watch::Receiver<String>,
    progress: watch::Sender<Progress>,
    stop: watch::Receiver<bool>,
}

/// A driver for `cfg` through `client`, and its handle.
pub fn driver(client: PoolClient, cfg: DriverConfig) -> (Driver, DriverHandle) {
    let (host_tx, host_rx) = watch::channel(cfg.host.clone());
    let (progress_tx, progress_rx) = watch::channel(Progress {
        host: cfg.host.clone(),
        ..Progress::default()
    });
    let (stop_tx, stop_rx) = watch::channel(false);
    (
        Driver {
            client,
            cfg,
            host: host_rx,
            progress: progress_tx,
            stop: stop_rx,
        },
        DriverHandle {
            host: host_tx,
            progress: progress_rx,
            stop: stop_tx,
        },
    )
}

/// The driver's own state: what it submitted, which results it holds.
struct Tally {
    start: Instant,
    next: u64,
    have: Vec<bool>,
    received: u64,
    duplicated: u64,
    wrong: u64,
    /// The highest item whose result the driver holds: acknowledged to the pool.
    ack: u64,
    last_result: Option<Instant>,
    longest_gap: Duration,
    longest_gap_end: Duration,
}

impl Tally {
    fn take(&mut self, seq: u64, value: u64, seed: u64, now: Instant) {
        if seq == 0 || seq >= self.next {
            self.wrong += 1;
            return;
        }
        let slot = &mut self.have[seq as usize];
        if *slot {
            self.duplicated += 1;
            return;
        }
        *slot = true;
        self.received += 1;
        self.ack = self.ack.max(seq);
        if value != work_value(seq, payload(seed, seq)) {
            self.wrong += 1;
        }
        if let Some(last) = self.last_result {
            let gap = now - last;
            if gap > self.longest_gap {
                self.longest_gap = gap;
                self.longest_gap_end = now - self.start;
            }
        }
        self.last_result = Some(now);
    }
}

impl Driver {
    /// Streams the items until every result is in, nothing moved for `give_up`, or the handle
    /// asked to stop.
    pub async fn run(mut self) -> Result<DriveReport, DriverError> {
        let cfg = self.cfg.clone();
        let mut host = self.host.borrow_and_update().clone();
        let mut moves = Vec::new();
        let mut waits = 0;
        let mut t = Tally {
            start: Instant::now(),
            next: 1,
            have: vec![false; cfg.items as usize + 1],
            received: 0,
            duplicated: 0,
            wrong: 0,
            ack: 0,
            last_result: None,
            longest_gap: Duration::ZERO,
            longest_gap_end: Duration::ZERO,
        };
        let mut last_progress = Instant::now();
        let mut refusals = 0u32;
        let mut sent_up_to = 0;
        let complete = loop {
            if *self.stop.borrow() {
                break false;
            }
            if self.host.has_changed().unwrap_or(false) {
                let to = self.host.borrow_and_update().clone();
                if to != host {
                    moves.push(DriverMove {
                        at: t.start.elapsed(),
                        from: host.clone(),
                        to: to.clone(),
                        how: "told",
                    });
                    host = to;
                }
            }
            if t.received == cfg.items {
                break true;
            }
            let mut moved = false;
            let mut refused = None;
            let outstanding = (t.next - 1) - t.received;
            if t.next <= cfg.items && outstanding < cfg.window {
                let end = (t.next + cfg.batch.max(1))
                    .min(cfg.items + 1)
                    .min(t.next + (cfg.window - outstanding));
                let batch: Vec<WorkItem> = (t.next..end)
                    .map(|seq| WorkItem {
                        seq,
                        payload: payload(cfg.seed, seq),
                    })
                    .collect();
                sent_up_to = sent_up_to.max(end - 1);
                match self.client.submit_items(&cfg.session, &host, &batch).await {
                    // A retried batch may be repeated; numbers this driver never sent may not.
                    Ok(sub) if sub.last_seq > sent_up_to => {
                        return Err(DriverError::Foreign {
                            session: cfg.session.clone(),
                            last_seq: sub.last_seq,
                            ours: sent_up_to,
                        })
                    }
                    Ok(_) => {
                        t.next = end;
                        moved = true;
                    }
                    Err(e) => refused = Some(e),
                }
            }
            if refused.is_none() {
                match self
                    .client
                    .fetch_results(&cfg.session, &host, t.ack, None)
                    .await
                {
                    Ok(r) => {
                        let now = Instant::now();
                        for res in &r.results {
                            t.take(res.seq, res.value, cfg.seed, now);
                        }
                        moved |= !r.results.is_empty();
                    }
                    Err(e) => refused = Some(e),
                }
            }
            if let Some(e) = refused {
                waits += 1;
                refusals = refusals.saturating_add(1);
                if let Some(to) = self.after_refusal(e, &host).await? {
                    moves.push(DriverMove {
                        at: t.start.elapsed(),
                        from: host.clone(),
                        to: to.clone(),
                        how: "session",
                    });
                    host = to;
                    moved = true;
                }
            }
            self.progress.send_replace(Progress {
                submitted: t.next - 1,
                received: t.received,
                host: host.clone(),
            });
            if moved {
                last_progress = Instant::now();
                refusals = 0;
            } else {
                if last_progress.elapsed() >= cfg.give_up {
                    break false;
                }
                tokio::time::sleep(pause(cfg.poll, cfg.backoff_max, refusals)).await;
            }
        };
        let submitted = t.next - 1;
        Ok(DriveReport {
            session: cfg.session,
            host,
            submitted,
            received: t.received,
            lost: submitted - t.received,
            duplicated: t.duplicated,
            wrong: t.wrong,
            longest_gap: t.longest_gap,
            longest_gap_end: t.longest_gap_end,
            waits,
            moves,
            elapsed: t.start.elapsed(),
            complete,
        })
    }

    /// What a refusal means for the driver: `Some(new host)` when the session moved and the
    /// driver follows it, `None` to wait and retry, an error when the session is gone or the
    /// pool refuses the driver for good.
    async fn after_refusal(&self, e: PoolError, host: &str) -> Result<Option<String>, DriverError> {
        let session = &self.cfg.session;
        let fatal = |what, source| {
            Err(DriverError::Pool {
                session: session.clone(),
                what,
                source,
            })
        };
        match &e {
            // The pool restarting, a timeout: wait.
            PoolError::Unreachable(_) | PoolError::Protocol(_) => Ok(None),
            PoolError::Refused { code, .. } if code == ErrorCode::Quiesced.as_str() => Ok(None),
            PoolError::Refused { code, .. } if code == ErrorCode::NotOwner.as_str() => {
                if !self.cfg.follow_session {
                    return Ok(None);
                }
                match self.client.session(session).await {
                    Ok(s) if s.state == SessionState::Running && s.host != host => Ok(Some(s.host)),
                    Ok(s) if s.state == SessionState::Released => fatal("released while driven", e),
                    Ok(_) | Err(PoolError::Unreachable(_)) => Ok(None),
                    Err(other) => fatal("re-reading the session", other),
                }
            }
            _ => fatal("the pool refused the driver", e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pause_doubles_with_refusals_up_to_its_cap() {
        let (poll, max) = (Duration::from_millis(2), Duration::from_millis(50));
        let waits: Vec<u128> = (0..8).map(|r| pause(poll, max, r).as_millis()).collect();
        assert_eq!(waits, [2, 4, 8, 16, 32, 50, 50, 50]);
        // However many refusals: no overflow, the cap holds.
        assert_eq!(pause(poll, max, u32::MAX), max);
        // A cap below the poll interval does not make the driver spin.
        assert_eq!(pause(poll, Duration::ZERO, 3), poll);
    }
}
