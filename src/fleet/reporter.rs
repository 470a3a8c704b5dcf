//! The host's side of the fleet: a task of its own that reports the store's state to the
//! fleet database after every committed change and at least every interval (the heartbeat),
//! and turns the host's fleet reservations into local claims.
//!
//! It never holds up the daemon: the engine only bumps a counter in a watch channel (newest
//! value wins; nothing queues), and the reporter reads the store on the blocking pool like any
//! reader. A report that fails is not kept: after a backoff the reporter reconnects and sends
//! the state as it is then (the backlog is one report). LISTEN/NOTIFY wakes it for a new
//! reservation; every heartbeat also looks for pending ones, in case a notification was lost
//! with a connection.

use super::backoff;
use super::credentials;
use super::db::{self, HostMeta, Reservation};
use super::record::Report;
use super::FleetError;
use crate::claim::{Owner, Requirements};
use crate::config::FleetSettings;
use crate::engine::Engine;
use crate::model::pci::PciAddress;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{oneshot, watch};

/// What the reporter was last able to do, for tests and logs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Status {
    /// Reports committed since start.
    pub reports: u64,
    /// Consecutive failures (0: the last attempt worked).
    pub failures: u32,
    pub last_error: Option<String>,
}

/// The running reporter; stopping it (or dropping it) ends its task.
pub struct Reporter {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    status: watch::Receiver<Status>,
}

impl Reporter {
    /// Starts reporting for `engine`'s host. `interval`: the heartbeat.
    pub fn start(
        engine: Arc<Engine>,
        settings: &FleetSettings,
        host: String,
        interval: Duration,
    ) -> Reporter {
        let (stop, stopped) = oneshot::channel();
        let (status_tx, status) = watch::channel(Status::default());
        let worker = Worker {
            settings: settings.clone(),
            warned_reload: std::sync::atomic::AtomicBool::new(false),
            changes: engine.subscribe_changes(),
            engine,
            credentials: settings.credentials_file.clone(),
            meta: HostMeta {
                host,
                interval_ms: i32::try_from(interval.as_millis()).unwrap_or(i32::MAX),
                down_after: settings.down_after as i32,
                version: env!("CARGO_PKG_VERSION").to_string(),
            },
            interval,
            status: status_tx,
        };
        let task = tokio::spawn(worker.run(stopped));
        Reporter {
            stop: Some(stop),
            task,
            status,
        }
    }

    pub fn status(&self) -> watch::Receiver<Status> {
        self.status.clone()
    }

    /// Ends the task (a report under way is abandoned: its transaction rolls back).
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if tokio::time::timeout(Duration::from_secs(2), &mut self.task)
            .await
            .is_err()
        {
            self.task.abort();
        }
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Worker {
    /// `[fleet]` as it was at the start: what this reporter runs with until vfiod restarts.
    settings: FleetSettings,
    /// Whether the log already says that a reload changed `[fleet]`.
    warned_reload: std::sync::atomic::AtomicBool,
    engine: Arc<Engine>,
    changes: watch::Receiver<u64>,
    credentials: PathBuf,
    meta: HostMeta,
    interval: Duration,
    status: watch::Sender<Status>,
}

/// Why the reporter woke.
enum Wake {
    Changed,
    Heartbeat,
    Reservation,
    Stop,
}

impl Worker {
    async fn run(mut self, mut stopped: oneshot::Receiver<()>) {
        let spread = backoff::spread_of(&self.meta.host);
        loop {
            match self.session(&mut stopped).await {
                Ok(()) => return,
                Err(e) => {
                    let message = crate::error_chain(&e);
                    let mut failures = 0;
                    self.status.send_modify(|s| {
                        s.failures += 1;
                        failures = s.failures;
                        s.last_error = Some(message.clone());
                    });
                    let wait = backoff::delay(failures, self.interval, spread);
                    // The first failure of a run is worth a warning; the rest repeat it.
                    if failures == 1 {
                        tracing::warn!(host = %self.meta.host, "fleet: {message}; retrying (backing off up to {:?})", self.interval.clamp(Duration::from_secs(5), Duration::from_secs(60)));
                    } else {
                        tracing::debug!(host = %self.meta.host, failures, "fleet: {message}; retrying in {wait:?}");
                    }
                    tokio::select! {
                        _ = &mut stopped => return,
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
    }

    /// One connection's life: `Ok` when asked to stop, `Err` when the database failed.
    async fn session(&mut self, stopped: &mut oneshot::Receiver<()>) -> Result<(), FleetError> {
        let path = self.credentials.clone();
        let config = tokio::task::spawn_blocking(move || credentials::read(&path))
            .await
            .map_err(|e| FleetError::Internal(e.to_string()))??;
        let bound = self.bound();
        let ca_file = self.settings.ca_file.clone();
        let connection = tokio::select! {
            c = tokio::time::timeout(bound, super::tls::connect(&config, ca_file.as_deref())) => {
                c.map_err(|_| FleetError::Timeout(bound))??
            }
            _ = &mut *stopped => return Ok(()),
        };
        let super::tls::Connection {
            mut client,
            mut notes,
            driver: _driver,
        } = connection;
        let version = self.bounded(db::schema_version(&client)).await?;
        if version < super::schema::VERSION {
            return Err(FleetError::SchemaTooOld {
                found: version,
                needed: super::schema::VERSION,
            });
        }
        // The server ends this session's transaction and statements past the same bound: a
        // session this side gave up on (a partition) must not keep the host's rows locked
        // until TCP notices, or the next session would wait on its own host's row.
        let ms = bound.as_millis();
        self.bounded(client.batch_execute(&format!(
            "SET idle_in_transaction_session_timeout = {ms}; SET statement_timeout = {ms}; \
             LISTEN {}",
            db::RESERVE_CHANNEL
        )))
        .await?;
        let mut heartbeat = tokio::time::interval(self.interval);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        heartbeat.tick().await;
        // The first turn reports and looks for reservations made while this host was away.
        let mut wake = Wake::Heartbeat;
        loop {
            match wake {
                Wake::Stop => return Ok(()),
                Wake::Changed | Wake::Heartbeat => {
                    self.changes.borrow_and_update();
                    self.bounded(self.report(&mut client)).await?;
                    if matches!(wake, Wake::Heartbeat) {
                        self.bounded(self.take_reservations(&mut client)).await?;
                    }
                }
                Wake::Reservation => {
                    self.bounded(self.take_reservations(&mut client)).await?;
                    // The claims changed the host's rows: report them now.
                    self.changes.borrow_and_update();
                    self.bounded(self.report(&mut client)).await?;
                }
            }
            wake = loop {
                tokio::select! {
                    _ = &mut *stopped => break Wake::Stop,
                    r = self.changes.changed() => match r {
                        Ok(()) => break Wake::Changed,
                        // The engine is gone: the daemon stops.
                        Err(_) => break Wake::Stop,
                    },
                    _ = heartbeat.tick() => break Wake::Heartbeat,
                    n = notes.recv() => match n {
                        Some(host) if host == self.meta.host => break Wake::Reservation,
                        Some(_) => continue,
                        None => return Err(FleetError::ConnectionClosed),
                    },
                }
            };
        }
    }

    /// How long one exchange with the database may take: a database that stops answering
    /// without closing the connection (a partition) must not hold the reporter forever.
    fn bound(&self) -> Duration {
        (self.interval * 2).clamp(Duration::from_secs(5), Duration::from_secs(60))
    }

    /// `work` within [`Worker::bound`]; past it the session ends (the connection is dropped
    /// with it, and its transaction rolls back) and the reporter reconnects.
    async fn bounded<T, E>(
        &self,
        work: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, FleetError>
    where
        FleetError: From<E>,
    {
        let bound = self.bound();
        match tokio::time::timeout(bound, work).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(FleetError::Timeout(bound)),
        }
    }

    async fn report(&self, client: &mut tokio_postgres::Client) -> Result<(), FleetError> {
        if self.engine.settings().fleet.as_ref() != Some(&self.settings)
            && !self
                .warned_reload
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                "a reload changed [fleet]: the reporter keeps the settings it started with until \
                 vfiod restarts"
            );
        }
        let report = self
            .engine
            .read(|core| {
                let store = core.store();
                let snapshot = store.claim_snapshot()?;
                let claims = store.active_claim_records()?;
                Ok::<_, crate::store::StoreError>(Report::build(&snapshot, &claims))
            })
            .await
            .map_err(|e| FleetError::Local(crate::error_chain(&e)))?
            .map_err(|e| FleetError::Local(crate::error_chain(&e)))?;
        let outcome = db::report(client, &self.meta, &report).await?;
        if !outcome.heartbeat_only {
            tracing::debug!(host = %self.meta.host, ?outcome, "fleet report");
        }
        self.engine.metrics().fleet_reported();
        self.status.send_modify(|s| {
            s.reports += 1;
            s.failures = 0;
            s.last_error = None;
        });
        Ok(())
    }

    /// Turns each pending reservation of this host into a local claim through the engine (the
    /// same path as a D-Bus Claim), or refuses it with the reason the engine gives.
    async fn take_reservations(
        &self,
        client: &mut tokio_postgres::Client,
    ) -> Result<(), FleetError> {
        let host = self.meta.host.clone();
        for r in db::pending_reservations(client, &host).await? {
            match self.claim_for(&r).await {
                Ok(claim_id) => {
                    if !db::reservation_claimed(client, &host, r.id, claim_id).await? {
                        // Withdrawn meanwhile (its requester gave up, or this host was marked
                        // down): the claim made for it goes back.
                        let _ = self
                            .engine
                            .release_claim(
                                claim_id,
                                "vfiod fleet",
                                "the fleet reservation was withdrawn",
                            )
                            .await;
                    } else {
                        tracing::info!(reservation = r.id, device = %r.address, vm = %r.vm_name, claim_id, "fleet reservation taken as a local claim");
                    }
                }
                Err(reason) => {
                    tracing::info!(reservation = r.id, device = %r.address, vm = %r.vm_name, "fleet reservation refused: {reason}");
                    db::reservation_refused(client, &host, r.id, &reason).await?;
                }
            }
        }
        Ok(())
    }

    /// The local claim for reservation `r`: the one a previous run made for it (a restart
    /// between the claim and its record in the fleet), else a new one.
    async fn claim_for(&self, r: &Reservation) -> Result<i64, String> {
        let address: PciAddress = r
            .address
            .parse()
            .map_err(|e| format!("not a PCI address: {e}"))?;
        let tag = reservation_tag(r.id);
        let existing = self
            .engine
            .read(|core| core.store().active_claim_records())
            .await
            .map_err(|e| crate::error_chain(&e))?
            .map_err(|e| crate::error_chain(&e))?
            .into_iter()
            .find(|c| c.requested_by.starts_with(&tag));
        if let Some(c) = existing {
            return Ok(c.id);
        }
        let lease = self.engine.settings().claims.default_lease_seconds;
        let owner = Owner::new(Some(&r.vm_name), None, lease, false)?;
        let req = Requirements {
            address: Some(address),
            ..Requirements::default()
        };
        let by = format!("{tag}by {}", r.requested_by);
        self.engine
            .claim(req, owner, &by)
            .await
            .map(|c| c.id)
            .map_err(|e| crate::error_chain(&e))
    }
}

/// How a local claim names the fleet reservation it was made for (`requested_by` starts so).
pub fn reservation_tag(id: i64) -> String {
    format!("fleet reservation {id} ")
}
