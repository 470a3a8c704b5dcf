//! The engine: everything vfiod decides and does, behind one async face. It runs inventory
//! passes (one at a time, whoever asks), reloads the settings, reconciles devices with their
//! policy, and runs tasks: any [`Job`] through the same life (see [`job`]). What happens is
//! published in order on one channel of [`EngineEvent`]s, which the D-Bus layer turns into
//! objects and signals; the engine never calls the D-Bus layer.
//!
//! Blocking work (sysfs, SQLite, libvirt) runs on the blocking pool, never on the async threads.
//! Each pass and each task change commits to the store before its event is sent, so a consumer
//! never shows a state the store does not hold.

mod attachments;
mod claim;
mod clean;
pub mod context;
mod holders;
mod hook;
mod migration;
mod pool;
mod core;
pub mod event;
pub mod removals;
pub mod job;
pub mod libvirt_link;
mod run_loop;
pub mod task;

pub use self::core::{warn_about_drivers, ConfigSource, Core, EngineError, Pass};
pub use attachments::AttachError;
pub use claim::ClaimError;
pub use context::{ClaimSteps, JobContext, Modprobe, ModuleLoader};
pub use event::{DeviceTasks, DeviceView, EngineEvent, EventStream};
pub use hook::HookCall;
pub use job::{Admission, Job, JobError, JobFailure, Phase, Progress};
pub use pool::{PooledError, PooledOutcome};

use crate::config::Settings;
use crate::mode::policy::{Decision, Program};
use crate::model::pci::PciAddress;
use crate::store::{DeviceChange, Store, StoreError, TaskRecord};
use event::EventSender;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, oneshot, watch};

pub struct Engine {
    core: Arc<Core>,
    events: EventSender,
    /// One inventory pass at a time.
    pass_lock: tokio::sync::Mutex<()>,
    /// The latest record of each unfinished task this engine runs, for [`Engine::wait_tasks`].
    watches: Mutex<HashMap<i64, watch::Sender<TaskRecord>>>,
    /// Held from reading a device's task state to sending the event that carries it, by a pass
    /// and by a task change alike: the events then leave in the order their reads were made, and
    /// a pass's view of a new VF ("its PF's task runs") can never arrive after the task's own
    /// "finished" and stay stale on the bus.
    publishing: Arc<Mutex<()>>,
    /// Claim changes waiting for their shared commit (see [`claims`]).
    claims: Arc<Mutex<claim::ClaimQueue>>,
    /// Cleans that were refused, and when each may be tried again (see [`clean`]).
    clean_retries: clean::Retries,
    /// Claims made for domains migrating here, attached once they run (see [`migration`]).
    incoming: migration::Incoming,
    /// Each domain's hook runs, one at a time, and the newest seen (see [`hook`]).
    hook_order: hook::HookOrder,
    /// The pools' clients and the queue of pooled steps (see [`pooled`]).
    pools: pool::Pools,
    /// Counts committed changes of devices, claims and tasks: a watcher (the fleet reporter)
    /// learns that something changed without the engine waiting for it or queueing anything.
    changes: Arc<watch::Sender<u64>>,
    /// The libvirt connection as the worker's events told it (see [`libvirt_link`]).
    libvirt_link: libvirt_link::LinkRecord,
    /// The Prometheus counters and histograms, updated where tasks end, hooks answer, pool
    /// calls fail and the fleet reports (see [`crate::metrics`]).
    metrics: Arc<crate::metrics::Metrics>,
    /// The host's preflight checks, given by the server (see [`HostExaminer`]).
    examiner: Mutex<Option<HostExaminer>>,
    /// Their one-line summary as of start-up or the last reload (see [`Engine::examine_host`]);
    /// "" before the first.
    doctor: Mutex<String>,
}

/// Runs the host's preflight checks under the given settings (reads only) and says how they
/// came out: a one-line summary, and one line per check that is not ok, with its fix. The server
/// passes `vfioctl doctor`'s checks (`doctor::run::host_report`); the engine sits below
/// the doctor (which asks the bus through the client) and knows only this.
pub type HostExaminer = Arc<dyn Fn(&Settings) -> (String, Vec<String>) + Send + Sync>;

impl Engine {
    /// The engine and the stream of its events (hand it to a consumer, or drop it).
    pub fn new(core: Core) -> (Arc<Engine>, EventStream) {
        let (events, stream) = mpsc::unbounded_channel();
        let engine = Engine {
            core: Arc::new(core),
            events,
            pass_lock: tokio::sync::Mutex::new(()),
            watches: Mutex::new(HashMap::new()),
            publishing: Arc::new(Mutex::new(())),
            claims: Arc::default(),
            clean_retries: clean::Retries::default(),
            incoming: migration::Incoming::default(),
            hook_order: hook::HookOrder::default(),
            pools: pool::Pools::default(),
            changes: Arc::new(watch::channel(0).0),
            libvirt_link: libvirt_link::LinkRecord::default(),
            metrics: Arc::default(),
            examiner: Mutex::default(),
            doctor: Mutex::default(),
        };
        (Arc::new(engine), stream)
    }

    /// Sets the checks [`Engine::examine_host`] runs.
    pub fn set_host_examiner(&self, examiner: HostExaminer) {
        *self.examiner.lock().unwrap_or_else(|p| p.into_inner()) = Some(examiner);
    }

    /// Runs the host's checks under the running configuration on a blocking thread and keeps
    /// their summary for `vfioctl status`; `None` when no examiner was set.
    pub async fn examine_host(&self) -> Option<(String, Vec<String>)> {
        let examiner = self
            .examiner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()?;
        let settings = self.settings();
        let said = tokio::task::spawn_blocking(move || examiner(&settings))
            .await
            .unwrap_or_else(|e| {
                let line = format!("doctor: the checks did not run ({e}), run vfioctl doctor");
                (line.clone(), vec![line])
            });
        *self.doctor.lock().unwrap_or_else(|p| p.into_inner()) = said.0.clone();
        Some(said)
    }

    /// The summary [`Engine::examine_host`] kept.
    pub fn doctor_summary(&self) -> String {
        self.doctor
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn core(&self) -> &Arc<Core> {
        &self.core
    }

    pub fn settings(&self) -> Arc<Settings> {
        self.core.settings()
    }

    pub fn store(&self) -> &Arc<Store> {
        self.core.store()
    }

    /// What a job of this engine runs with: the core's context, with claim steps published.
    pub fn job_context(&self) -> JobContext {
        let mut cx = self.core.job_context();
        cx.claims = self.claim_steps();
        cx
    }

    /// Claim steps committed and published in commit order, by jobs and by the engine itself.
    fn claim_steps(&self) -> ClaimSteps {
        let events = self.events.clone();
        ClaimSteps::new(
            Arc::clone(self.core.store()),
            Arc::clone(&self.publishing),
            Arc::new(move |c: &crate::store::ClaimRecord| {
                let _ = events.send(EngineEvent::Claim(c.clone()));
            }),
        )
    }

    /// The connection to the configured libvirt URI (None: no URI configured).
    /// The host's IOMMU as the last inventory pass found it; `None` before the first.
    pub fn iommu(&self) -> Option<crate::model::iommu::Iommu> {
        self.core.iommu()
    }

    pub fn libvirt_link(&self) -> Option<libvirt_link::Link> {
        self.libvirt_link.get(self.core.libvirt().uri().as_deref())
    }

    pub fn metrics(&self) -> &Arc<crate::metrics::Metrics> {
        &self.metrics
    }

    /// Every metric as Prometheus text, the gauges counted from the store now.
    pub async fn metrics_text(&self) -> Result<String, EngineError> {
        let settings = self.settings();
        let fleet = settings.fleet.is_some();
        let pools = settings.pools.iter().map(|p| p.name.clone()).collect();
        let (devices, claims) = self
            .read(|core| {
                let store = core.store();
                Ok::<_, StoreError>((store.devices()?, store.active_claim_records()?))
            })
            .await??;
        let state = crate::metrics::State::count(&devices, &claims, fleet, pools);
        self.metrics
            .render(&state)
            .map_err(|e| EngineError::Internal(crate::error_chain(&e)))
    }

    /// A receiver that sees the count of committed changes move (the newest value only: a
    /// slow watcher misses nothing but intermediate counts).
    pub fn subscribe_changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn changed(&self) {
        bump(&self.changes);
    }

    fn send(&self, event: EngineEvent) {
        // No consumer (a test, a benchmark): nobody to tell.
        let _ = self.events.send(event);
    }

    /// Runs `f` on the blocking pool with the core: reads of the store or of sysfs for a caller
    /// on the async threads.
    pub async fn read<T, F>(&self, f: F) -> Result<T, EngineError>
    where
        T: Send + 'static,
        F: FnOnce(&Core) -> T + Send + 'static,
    {
        let core = Arc::clone(&self.core);
        Ok(tokio::task::spawn_blocking(move || f(&core)).await?)
    }

    /// Waits until every event sent so far has been handled by the consumer (at once when there
    /// is none).
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.events.send(EngineEvent::Flush(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    /// One inventory pass, committed, then published.
    pub async fn refresh(&self) -> Result<Pass, EngineError> {
        let _guard = self.pass_lock.lock().await;
        let (publishing, events) = (Arc::clone(&self.publishing), self.events.clone());
        let changes = Arc::clone(&self.changes);
        self.read(move |core| pass_and_publish(core, &publishing, &events, &changes))
            .await?
    }

    /// [`Engine::refresh`] from a blocking thread (a task's, before its end is recorded).
    fn refresh_blocking(&self) -> Result<Pass, EngineError> {
        let _guard = self.pass_lock.blocking_lock();
        pass_and_publish(&self.core, &self.publishing, &self.events, &self.changes)
    }

    /// Re-reads the configuration, then a pass under the new settings (selection and protection
    /// may change). A bad configuration is refused and the running settings stay.
    pub async fn reload(&self) -> Result<Pass, EngineError> {
        self.read(|core| core.reload()).await??;
        self.send(EngineEvent::Settings);
        let pass = self.refresh().await;
        // What it selects may have changed, and with it the groups the checks look at.
        if let Some((summary, _)) = self.examine_host().await {
            tracing::info!("{summary}");
        }
        pass
    }

    /// Records a task change: the store has committed it; tell the consumer and the waiters.
    fn task_changed(&self, task: &TaskRecord, change: task::Change) {
        let publishing = self.publishing.lock().unwrap_or_else(|p| p.into_inner());
        let devices = match change {
            task::Change::State => self.core.covered_by(task).unwrap_or_else(|e| {
                tracing::error!(
                    task_id = task.id,
                    "cannot read the devices a task covers: {}",
                    crate::error_chain(&e)
                );
                Vec::new()
            }),
            task::Change::Progress => Vec::new(),
        };
        self.send(EngineEvent::Task {
            task: task.clone(),
            devices,
        });
        drop(publishing);
        if change == task::Change::State {
            self.changed();
        }
        // A reset keeps the row in error: it is not a second end of the task.
        if change == task::Change::State && task.state.is_final() && task.reset_ms.is_none() {
            self.metrics.task_finished(task);
        }
        let mut watches = self.watches.lock().unwrap_or_else(|p| p.into_inner());
        if task.state.is_final() {
            if let Some(w) = watches.remove(&task.id) {
                w.send_replace(task.clone());
            }
        } else {
            watches
                .entry(task.id)
                .or_insert_with(|| watch::channel(task.clone()).0)
                .send_replace(task.clone());
        }
    }

    /// Starts `job` as a task: admitted, created, prepared and guarded before this returns (a
    /// refusal is returned with its reason, and changes nothing), then run in the background,
    /// reporting through events. Returns the task as it is once prepared.
    pub async fn start_task(
        self: &Arc<Self>,
        job: Box<dyn Job>,
        requested_by: &str,
    ) -> Result<TaskRecord, JobError> {
        self.settle_protection_of(job.device()).await;
        let me = Arc::clone(self);
        let who = requested_by.to_string();
        let (cx, started) = tokio::task::spawn_blocking(move || {
            let cx = me.job_context();
            let notify = |t: &TaskRecord, c: task::Change| me.task_changed(t, c);
            task::begin(&cx, job, &who, &notify).map(|s| (cx, s))
        })
        .await
        .map_err(|e| JobError::Internal(format!("the task could not be prepared: {e}")))??;
        let task = started.task.clone();
        let me = Arc::clone(self);
        tokio::spawn(async move { me.run_task(cx, started).await });
        Ok(task)
    }

    /// Runs a started task on the blocking pool, with an inventory pass before its end is
    /// recorded (its device's VFs and drivers changed: a claim after the end must choose from
    /// what the kernel has now), and one after it (for what recording the end changed, or
    /// when the worker failed before its pass).
    async fn run_task(self: Arc<Self>, cx: JobContext, started: task::Started) {
        let id = started.task.id;
        let me = Arc::clone(&self);
        let outcome = tokio::task::spawn_blocking(move || {
            let notify = |t: &TaskRecord, c: task::Change| me.task_changed(t, c);
            // The records follow the kernel before the end is visible: a claim right after a
            // restore's end must not get a VF the restore removed (issue 33's soak).
            let settle = || {
                if let Err(e) = me.refresh_blocking() {
                    tracing::error!(
                        task_id = id,
                        "inventory pass at the end of the task failed: {}",
                        crate::error_chain(&e)
                    );
                }
            };
            let ended = task::run(&cx, started, &notify, &settle);
            // The task's end is visible from here on: what it changed must be recorded already.
            job::pause_point("task:ended");
            ended
        })
        .await;
        match outcome {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::error!(
                    task_id = id,
                    "cannot record the task's outcome: {}",
                    crate::error_chain(&e)
                )
            }
            Err(e) => {
                tracing::error!(task_id = id, "the task's worker failed: {e}");
                let me = Arc::clone(&self);
                let message = format!("internal error: the task's worker failed: {e}");
                let _ = self
                    .read(move |core| {
                        if let Ok(t) = core.store().task_failed(id, &message) {
                            me.task_changed(&t, task::Change::State);
                        }
                    })
                    .await;
            }
        }
        if let Err(e) = self.refresh().await {
            tracing::error!(
                task_id = id,
                "inventory pass after the task failed: {}",
                crate::error_chain(&e)
            );
        }
    }

    /// An operator's reset of the task in error that holds `address`. A mode task's device is
    /// then re-read and brought back to its configured mode at once (the reset says the
    /// device may be used again; a task cut short, by a failure or a kill, can have left it
    /// half-way: VFs without a driver): its task exists before this returns, so that nothing
    /// is handed out from the state the failure left.
    pub async fn reset_task(
        self: &Arc<Self>,
        address: PciAddress,
        by: &str,
    ) -> Result<TaskRecord, JobError> {
        let me = Arc::clone(self);
        let who = by.to_string();
        let t = self
            .read(move |core| {
                let t = core.store().reset_task(address, &who)?;
                me.task_changed(&t, task::Change::State);
                Ok::<_, StoreError>(t)
            })
            .await
            .map_err(|e| JobError::Internal(crate::error_chain(&e)))?
            .map_err(JobError::from)?;
        if is_mode_kind(t.kind) {
            if let Err(e) = self.refresh().await {
                tracing::error!(
                    device = %t.address,
                    "inventory pass after a task reset failed: {}",
                    crate::error_chain(&e)
                );
            }
            self.reconcile_device(t.address, &format!("vfiod (task {} reset by {by})", t.id))
                .await;
        }
        Ok(t)
    }

    /// Brings one device to its policy target, as [`Engine::reconcile`] does for all: a task
    /// when it is not there, none when it is or when the policy leaves it alone.
    async fn reconcile_device(self: &Arc<Self>, address: PciAddress, requested_by: &str) {
        let plan = self
            .read(move |core| {
                crate::mode::planner::plan_device(
                    core.sysfs(),
                    core.store(),
                    &core.settings(),
                    address,
                )
            })
            .await;
        let wanted = match plan {
            Ok(Ok(p)) => {
                matches!(p.decision, Decision::Target { .. }) && p.program != Program::Nothing
            }
            Ok(Err(e)) => {
                tracing::warn!(device = %address, "cannot plan its mode: {}", crate::error_chain(&e));
                false
            }
            Err(e) => {
                tracing::warn!(device = %address, "cannot plan its mode: {}", crate::error_chain(&e));
                false
            }
        };
        if !wanted {
            return;
        }
        let job = job::ModeJob::new(address, None);
        match self.start_task(Box::new(job), requested_by).await {
            Ok(_) => {}
            // A task of vfiod's own holds it (its driver bound during a bind or a restore):
            // that task brings it to the policy's target.
            Err(e) if e.is_busy() => {
                tracing::debug!(device = %address, "not reconciled: {}", crate::error_chain(&e))
            }
            Err(e) => {
                tracing::warn!(device = %address, "not reconciled: {}", crate::error_chain(&e))
            }
        }
    }

    /// Brings every selected device to its policy target, one task each; devices already there
    /// get none (a restart changes nothing). Busy or refused devices are reported and skipped.
    /// Returns the tasks started.
    pub async fn reconcile(self: &Arc<Self>, requested_by: &str) -> Vec<TaskRecord> {
        let plans = self
            .read(|core| {
                let plans =
                    crate::mode::planner::plan_all(core.sysfs(), core.store(), &core.settings())?;
                // A group program (bind, unbind) moves every member: one task per IOMMU group.
                let mut groups_taken = BTreeSet::new();
                let mut wanted = Vec::new();
                for p in plans {
                    match (&p.decision, &p.program) {
                        (Decision::Target { .. }, Program::Nothing) => continue,
                        (Decision::Target { .. }, Program::Bind { .. } | Program::Unbind) => {
                            let group = core
                                .store()
                                .device(p.address)
                                .ok()
                                .flatten()
                                .and_then(|d| d.iommu_group);
                            if group.is_some_and(|g| !groups_taken.insert(g)) {
                                continue;
                            }
                            wanted.push(p.address);
                        }
                        (Decision::Target { .. }, _) => wanted.push(p.address),
                        (Decision::Refuse { reason }, _) => {
                            tracing::warn!(device = %p.address, "{reason}")
                        }
                        (Decision::Leave { .. }, _) => {}
                        // Planned again when its driver binds (`Engine::run`).
                        (Decision::Wait { reason, .. }, _) => {
                            tracing::info!(device = %p.address, "{reason}")
                        }
                    }
                }
                Ok::<_, crate::mode::planner::ModeError>(wanted)
            })
            .await;
        let wanted = match plans {
            Ok(Ok(w)) => w,
            Ok(Err(e)) => {
                tracing::error!("cannot plan modes: {}", crate::error_chain(&e));
                return Vec::new();
            }
            Err(e) => {
                tracing::error!("cannot plan modes: {}", crate::error_chain(&e));
                return Vec::new();
            }
        };
        let mut started = Vec::new();
        for address in wanted {
            // The policy's target, decided again inside the task from the state it holds.
            let job = job::ModeJob::new(address, None);
            match self.start_task(Box::new(job), requested_by).await {
                Ok(t) => started.push(t),
                // The inventory pass said it once for the host, not once per device.
                Err(e @ JobError::NoIommu { .. }) => tracing::debug!(
                    device = %address,
                    "not reconciled: {}",
                    crate::error_chain(&e)
                ),
                Err(e) => tracing::warn!(
                    device = %address,
                    "not reconciled: {}",
                    crate::error_chain(&e)
                ),
            }
        }
        started
    }

    /// Waits until none of `tasks` is still in prepare or running.
    pub async fn wait_tasks(&self, tasks: &[TaskRecord]) {
        for t in tasks {
            let rx = self
                .watches
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&t.id)
                .map(|w| w.subscribe());
            if let Some(mut rx) = rx {
                // A closed channel means the task finished (its watch was dropped).
                let _ = rx.wait_for(|r| r.state.is_final()).await;
            }
        }
    }
}

/// The textfile writer's view of the engine.
impl crate::metrics::textfile::Source for Engine {
    fn textfile(&self) -> Option<std::path::PathBuf> {
        self.settings().metrics.textfile.clone()
    }

    fn render(&self) -> futures_util::future::BoxFuture<'_, Result<String, String>> {
        Box::pin(async move {
            self.metrics_text()
                .await
                .map_err(|e| crate::error_chain(&e))
        })
    }

    fn write_failed(&self) {
        self.metrics.textfile_failed();
    }
}

/// Whether a task of `kind` is a mode job's (its device's mode and drivers are the policy's).
fn is_mode_kind(kind: crate::model::task::TaskKind) -> bool {
    use crate::model::task::TaskKind as K;
    matches!(
        kind,
        K::Check | K::Split | K::Restore | K::Resplit | K::Rebind | K::Bind | K::Unbind
    )
}

/// Counts one more committed change.
/// One inventory pass, committed, then published (the new devices with their tasks), the
/// events in commit order. The caller holds the pass lock.
fn pass_and_publish(
    core: &Core,
    publishing: &Mutex<()>,
    events: &EventSender,
    changes: &watch::Sender<u64>,
) -> Result<Pass, EngineError> {
    let pass = core.refresh()?;
    if pass.changes.is_empty() {
        return Ok(pass);
    }
    bump(changes);
    let _publishing = publishing.lock().unwrap_or_else(|p| p.into_inner());
    let mut tasks = Vec::new();
    for c in &pass.changes {
        if let DeviceChange::Added(d) = c {
            tasks.push(core.device_tasks(d.address)?);
        }
    }
    let _ = events.send(EngineEvent::Inventory {
        changes: pass.changes.clone(),
        tasks,
    });
    Ok(pass)
}

fn bump(changes: &watch::Sender<u64>) {
    changes.send_modify(|n| *n = n.wrapping_add(1));
}
