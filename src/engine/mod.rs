//! The running daemon: the engine (settings, sysfs, store) and the loop that keeps the store in
//! step with the kernel: at start, on every uevent, at each poll tick, and on reload.
//!
//! The engine's passes are serialized: one inventory pass at a time, whoever asked for it (the
//! loop, a D-Bus call). Each pass commits to the store before anything is published on D-Bus,
//! so the bus never shows a state the store does not hold.

pub mod tasks;

use crate::config::{ConfigError, Settings};
use crate::host::sysfs::{Sysfs, SysfsError};
use crate::host::uevent::{EventReceiver, Uevent};
use crate::inventory;
use crate::model::device::Device;
use crate::model::pci::PciAddress;
use crate::store::{Counts, DeviceChange, Event, NewEvent, Store, StoreError};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid configuration")]
    Config(#[from] ConfigError),
    #[error("state store failed")]
    Store(#[from] StoreError),
    #[error("cannot list PCI functions")]
    Sysfs(#[from] SysfsError),
    #[error("inventory pass did not finish")]
    Join(#[from] tokio::task::JoinError),
}

/// Where the settings come from, so a reload reads the same files.
#[derive(Clone, Debug)]
pub struct ConfigSource {
    pub main: PathBuf,
    pub dropin_dir: Option<PathBuf>,
    pub main_required: bool,
    /// Applied after every load (e.g. `--simulate` pins the sysfs root and state dir).
    pub pin_sysfs_root: Option<PathBuf>,
    pub pin_state_dir: Option<PathBuf>,
}

impl ConfigSource {
    pub fn load(&self) -> Result<Settings, ConfigError> {
        let mut s = Settings::load(&self.main, self.dropin_dir.as_deref(), self.main_required)?;
        if let Some(r) = &self.pin_sysfs_root {
            s.sysfs_root = r.clone();
        }
        if let Some(d) = &self.pin_state_dir {
            s.state_dir = d.clone();
        }
        Ok(s)
    }
}

/// The result of one inventory pass.
#[derive(Debug, Default)]
pub struct Pass {
    pub changes: Vec<DeviceChange>,
    pub events: Vec<Event>,
}

/// Settings, the kernel and the store: everything a pass needs.
pub struct Engine {
    sysfs: Sysfs,
    store: Arc<Store>,
    settings: RwLock<Arc<Settings>>,
    source: Option<ConfigSource>,
}

impl Engine {
    pub fn new(
        settings: Settings,
        source: Option<ConfigSource>,
        sysfs: Sysfs,
        store: Arc<Store>,
    ) -> Self {
        Engine {
            sysfs,
            store,
            settings: RwLock::new(Arc::new(settings)),
            source,
        }
    }

    pub fn settings(&self) -> Arc<Settings> {
        Arc::clone(&self.settings.read().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    pub fn sysfs(&self) -> &Sysfs {
        &self.sysfs
    }

    /// One inventory pass: scan, diff against the store, commit. Blocking (sysfs and SQLite).
    pub fn refresh(&self) -> Result<Pass, EngineError> {
        let settings = self.settings();
        let previous: BTreeMap<PciAddress, Device> = self
            .store
            .devices()?
            .into_iter()
            .map(|d| (d.address, d))
            .collect();
        let scanned = inventory::scan(&self.sysfs, &settings, &previous)?;
        let (changes, new_events) = inventory::diff(&previous, &scanned);
        if changes.is_empty() && new_events.is_empty() {
            return Ok(Pass::default());
        }
        let events = self.store.apply_changes(&changes, &new_events)?;
        // A function that vanishes or breaks deserves the operator's attention; VFs removed
        // because their PF's VF count went down do not (a restore removes 64 at once).
        let vfs_removed: Vec<PciAddress> = changes
            .iter()
            .filter_map(|c| match c {
                DeviceChange::Removed(d) if d.role == crate::model::device::Role::Vf => {
                    Some(d.address)
                }
                _ => None,
            })
            .collect();
        for e in &events {
            let expected = e.address.is_some_and(|a| vfs_removed.contains(&a));
            match e.kind.as_str() {
                "broken" => tracing::warn!("{}", e.message),
                "removed" if !expected => tracing::warn!("{}", e.message),
                _ => tracing::info!("{}", e.message),
            }
        }
        Ok(Pass { changes, events })
    }

    /// Re-reads the config files. A bad file is rejected and the old settings stay in force;
    /// either way the outcome is recorded as an event.
    pub fn reload(&self) -> Result<Arc<Settings>, EngineError> {
        let Some(source) = &self.source else {
            return Ok(self.settings());
        };
        match source.load() {
            Ok(new) => {
                let old = self.settings();
                if new.sysfs_root != old.sysfs_root || new.state_dir != old.state_dir {
                    // Moving the store or the kernel tree under a running daemon would split
                    // its state; those two take effect at restart.
                    tracing::warn!(
                        "sysfs_root and state_dir changes take effect at the next start"
                    );
                }
                let mut effective = new;
                effective.sysfs_root = old.sysfs_root.clone();
                effective.state_dir = old.state_dir.clone();
                let effective = Arc::new(effective);
                *self.settings.write().unwrap_or_else(|p| p.into_inner()) = Arc::clone(&effective);
                self.store.record_event(NewEvent {
                    address: None,
                    kind: "config".into(),
                    message: format!(
                        "configuration reloaded from {}",
                        effective
                            .sources
                            .iter()
                            .map(|p| p.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                })?;
                tracing::info!("configuration reloaded");
                Ok(effective)
            }
            Err(e) => {
                let msg = format!(
                    "configuration reload rejected, previous settings kept: {}",
                    crate::error_chain(&e)
                );
                tracing::error!("{msg}");
                self.store.record_event(NewEvent {
                    address: None,
                    kind: "config".into(),
                    message: msg,
                })?;
                Err(e.into())
            }
        }
    }

    pub fn counts(&self) -> Result<Counts, StoreError> {
        self.store.counts()
    }
}

/// Receives the outcome of each pass (the D-Bus layer publishes it).
pub trait Publish: Send + Sync + 'static {
    fn publish(&self, pass: &Pass) -> impl std::future::Future<Output = ()> + Send;
    /// The settings were replaced by a reload.
    fn settings_changed(&self) -> impl std::future::Future<Output = ()> + Send;
    /// A task was created or changed (read it from the store).
    fn task_changed(&self, id: i64) -> impl std::future::Future<Output = ()> + Send;
}

/// Serializes passes and hands their results to a publisher.
pub struct Service<P> {
    pub engine: Arc<Engine>,
    pub publisher: P,
    pass_lock: tokio::sync::Mutex<()>,
}

impl<P: Publish> Service<P> {
    pub fn new(engine: Arc<Engine>, publisher: P) -> Self {
        Service {
            engine,
            publisher,
            pass_lock: tokio::sync::Mutex::new(()),
        }
    }

    /// Runs one pass off the async threads and publishes its changes.
    pub async fn refresh(&self) -> Result<Pass, EngineError> {
        let _guard = self.pass_lock.lock().await;
        let engine = Arc::clone(&self.engine);
        let pass = tokio::task::spawn_blocking(move || engine.refresh()).await??;
        self.publisher.publish(&pass).await;
        Ok(pass)
    }

    /// Reload, then a pass under the new settings (selection and protection may change).
    pub async fn reload(&self) -> Result<Pass, EngineError> {
        let engine = Arc::clone(&self.engine);
        tokio::task::spawn_blocking(move || engine.reload()).await??;
        self.publisher.settings_changed().await;
        self.refresh().await
    }

    /// Validates a mode request and starts its task; returns at once with the task in
    /// `prepare` (the work goes on in the background and reports through the publisher).
    pub async fn start_task(
        self: &Arc<Self>,
        address: PciAddress,
        target: Option<crate::modes::policy::Target>,
        requested_by: &str,
    ) -> Result<crate::store::TaskRecord, crate::engine::tasks::TaskError> {
        let engine = Arc::clone(&self.engine);
        let who = requested_by.to_string();
        let prepared = tokio::task::spawn_blocking(move || {
            crate::engine::tasks::prepare(&engine, address, target, &who)
        })
        .await
        .map_err(|e| crate::engine::tasks::TaskError::Refused {
            address,
            reason: format!("internal error: {e}"),
        })??;
        let task = prepared.task.clone();
        self.publisher.task_changed(task.id).await;
        let me = Arc::clone(self);
        tokio::spawn(async move { me.run_task(prepared).await });
        Ok(task)
    }

    /// Runs a prepared task off the async threads, publishing each change, then refreshes the
    /// inventory (the device's VFs and drivers changed).
    async fn run_task(self: Arc<Self>, prepared: crate::engine::tasks::Prepared) {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<i64>();
        let engine = Arc::clone(&self.engine);
        let id = prepared.task.id;
        let worker = tokio::task::spawn_blocking(move || {
            let notify = move |id: i64| {
                let _ = tx.send(id);
            };
            crate::engine::tasks::run(&engine, prepared, &notify)
        });
        while let Some(changed) = rx.recv().await {
            self.publisher.task_changed(changed).await;
        }
        match worker.await {
            Ok(Ok(t)) => tracing::info!(
                "task {} {} on {}: {} ({})",
                t.id,
                t.kind,
                t.address,
                t.state.as_str(),
                t.message
            ),
            Ok(Err(e)) => tracing::error!(
                "task {id}: cannot record its state: {}",
                crate::error_chain(&e)
            ),
            Err(e) => tracing::error!("task {id} panicked: {e}"),
        }
        if let Err(e) = self.refresh().await {
            tracing::error!(
                "inventory pass after task {id} failed: {}",
                crate::error_chain(&e)
            );
        }
        self.publisher.task_changed(id).await;
    }

    /// Brings every selected device to its policy target, one task each. Devices already there
    /// get no task (a restart changes nothing); busy or refused devices are reported and skipped.
    /// Returns the tasks started.
    pub async fn reconcile(self: &Arc<Self>, requested_by: &str) -> Vec<crate::store::TaskRecord> {
        let engine = Arc::clone(&self.engine);
        let plans = match tokio::task::spawn_blocking(move || {
            crate::modes::planner::plan_all(engine.sysfs(), engine.store(), &engine.settings())
        })
        .await
        {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                tracing::error!("cannot plan modes: {}", crate::error_chain(&e));
                return Vec::new();
            }
            Err(e) => {
                tracing::error!("cannot plan modes: {e}");
                return Vec::new();
            }
        };
        let mut started = Vec::new();
        // A group program (bind, unbind) moves every member: one task per IOMMU group.
        let mut groups_taken = std::collections::BTreeSet::new();
        for p in plans {
            if matches!(
                p.program,
                crate::modes::policy::Program::Bind { .. } | crate::modes::policy::Program::Unbind
            ) {
                let group = self
                    .engine
                    .store()
                    .device(p.address)
                    .ok()
                    .flatten()
                    .and_then(|d| d.iommu_group);
                if let Some(g) = group {
                    if !groups_taken.insert(g) {
                        continue;
                    }
                }
            }
            match (&p.decision, &p.program) {
                (
                    crate::modes::policy::Decision::Target { .. },
                    crate::modes::policy::Program::Nothing,
                ) => {}
                (crate::modes::policy::Decision::Target { target, .. }, _) => {
                    match self
                        .start_task(p.address, Some(target.clone()), requested_by)
                        .await
                    {
                        Ok(t) => started.push(t),
                        Err(e) => tracing::warn!(
                            "{}: not reconciled: {}",
                            p.address,
                            crate::error_chain(&e)
                        ),
                    }
                }
                (crate::modes::policy::Decision::Refuse { reason }, _) => {
                    tracing::warn!("{}: {reason}", p.address)
                }
                _ => {}
            }
        }
        started
    }

    /// Waits until none of `tasks` is still in prepare or running.
    pub async fn wait_tasks(&self, tasks: &[crate::store::TaskRecord]) {
        for t in tasks {
            loop {
                match self.engine.store().task(t.id) {
                    Ok(Some(r)) if !r.state.is_final() => {
                        tokio::time::sleep(Duration::from_millis(20)).await
                    }
                    _ => break,
                }
            }
        }
    }

    /// Records AER recovery reports; they are health history even when the scan sees no change.
    fn note_uevent(&self, ev: &Uevent) {
        let Some((what, online)) = ev.aer_event() else {
            return;
        };
        let address = ev.pci_address();
        let message = format!(
            "AER {what} on {}{}",
            address
                .map(|a| a.to_string())
                .unwrap_or_else(|| ev.devpath.clone()),
            match online {
                Some(true) => ", device online",
                Some(false) => ", device offline",
                None => "",
            }
        );
        tracing::warn!("{message}");
        if let Err(e) = self.engine.store().record_event(NewEvent {
            address,
            kind: "aer".into(),
            message,
        }) {
            tracing::error!("cannot record AER event: {}", crate::error_chain(&e));
        }
    }

    /// The main loop: passes on uevents (batched), on the poll tick, and on SIGHUP, until
    /// `shutdown` resolves.
    pub async fn run(
        self: &Arc<Self>,
        mut events: Option<EventReceiver>,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        let mut interval = self.engine.settings().poll_interval;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let mut do_pass = false;
            tokio::select! {
                _ = &mut shutdown => break,
                ev = async {
                    match events.as_mut() {
                        Some(rx) => rx.recv().await,
                        None => std::future::pending().await,
                    }
                } => {
                    match ev {
                        Some(ev) => {
                            self.note_uevent(&ev);
                            // A split emits one event per VF; gather the burst into one pass.
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            if let Some(rx) = events.as_mut() {
                                while let Ok(more) = rx.try_recv() {
                                    self.note_uevent(&more);
                                }
                            }
                            do_pass = true;
                        }
                        None => {
                            tracing::warn!("uevent source closed; relying on polling");
                            events = None;
                        }
                    }
                }
                _ = tick.tick() => do_pass = true,
                _ = async {
                    match hup.as_mut() {
                        Some(h) => { h.recv().await; }
                        None => std::future::pending().await,
                    }
                } => {
                    tracing::info!("SIGHUP: reloading configuration");
                    match self.reload().await {
                        Ok(_) => {
                            self.reconcile("reload (SIGHUP)").await;
                        }
                        Err(e) => tracing::error!("reload failed: {}", crate::error_chain(&e)),
                    }
                }
            }
            // A reload (SIGHUP or D-Bus) may have changed the poll interval.
            let new_interval = self.engine.settings().poll_interval;
            if new_interval != interval {
                interval = new_interval;
                tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
            }
            if do_pass {
                if let Err(e) = self.refresh().await {
                    tracing::error!("inventory pass failed: {}", crate::error_chain(&e));
                }
            }
        }
    }
}
