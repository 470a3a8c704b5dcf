//! The registry: every metric vfiod exports, what updates each, and the render.
//!
//! | metric | type | labels | from |
//! |---|---|---|---|
//! | `vfiod_devices` | gauge | kind, state | the store, at render |
//! | `vfiod_claims` | gauge | state | the store, at render |
//! | `vfiod_tasks_total` | counter | kind, result | a task reached success or error |
//! | `vfiod_task_duration_seconds` | histogram | kind | the same, created to finished |
//! | `vfiod_hook_duration_seconds` | histogram | operation, result | a hook call answered |
//! | `vfiod_pool_call_errors_total` | counter | pool, error | a pool call failed |
//! | `vfiod_fleet_report_age_seconds` | gauge | - | the last fleet report, at render |
//! | `vfiod_metrics_textfile_errors_total` | counter | - | a write of the textfile failed |
//! | `vfiod_build_info` | gauge | version | constant 1 |
//!
//! Counters and histograms live as long as the process (a restart starts them at zero, which
//! Prometheus' `rate()` expects); label values come from closed sets (task kinds, hook
//! operations, configured pool names, error kinds), so the series stay bounded.

use super::state::State;
use super::MetricsError;
use crate::hook::Operation;
use crate::model::task::TaskKind;
use crate::pool::client::PoolError;
use crate::store::{TaskRecord, TaskState};
use prometheus::{
    Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts,
    Registry, TextEncoder,
};
use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::watch;

/// Task durations: sysfs steps take milliseconds, a split of many VFs seconds, an FPGA
/// program or a detach that waits for its guest minutes.
const TASK_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

/// Hook answers: libvirt waits for each one on a VM start, so the interesting part is
/// milliseconds; the top is `[hooks]`' largest deadline (60 s).
const HOOK_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The `error` label of `vfiod_pool_call_errors_total`, one per way a pool call fails.
pub const POOL_ERRORS: &[&str] = &[
    "stale_epoch",
    "not_found",
    "not_quiesced",
    "refused",
    "unreachable",
    "protocol",
    "config",
    "too_large",
];

/// The `error` label of a pool call's failure.
pub fn pool_error_label(e: &PoolError) -> &'static str {
    match e {
        PoolError::StaleEpoch { .. } => "stale_epoch",
        PoolError::NotFound => "not_found",
        PoolError::NotQuiesced => "not_quiesced",
        PoolError::Refused { .. } => "refused",
        PoolError::Unreachable(_) => "unreachable",
        PoolError::Protocol(_) => "protocol",
        PoolError::Config(_) => "config",
        PoolError::TooLarge { .. } => "too_large",
    }
}

/// The `operation` label of a hook call: libvirt's word when vfiod knows it, else `other` (an
/// operation newer than this code must not make a series per spelling).
pub fn hook_operation_label(operation: &str) -> &str {
    if Operation::parse(operation) == Operation::Other {
        "other"
    } else {
        operation
    }
}

/// Every metric, registered once.
pub struct Metrics {
    registry: Registry,
    devices: IntGaugeVec,
    claims: IntGaugeVec,
    tasks: IntCounterVec,
    task_duration: HistogramVec,
    hook_duration: HistogramVec,
    pool_errors: IntCounterVec,
    fleet_age: GaugeVec,
    textfile_errors: IntCounter,
    /// When the fleet last took a report; `None` until the first.
    fleet_reported: Mutex<Option<SystemTime>>,
    /// Each pool's last call since start: when it ended and, if it failed, why.
    pool_calls: Mutex<BTreeMap<String, PoolCall>>,
    /// The age of a report that never came counts from here: an alert on the age then fires
    /// for a reporter that never succeeds.
    started: Instant,
    /// Renders set the gauges, then encode: one at a time, so that no render encodes another's
    /// half-set gauges.
    rendering: Mutex<()>,
    /// Moves at every update, for the textfile writer (newest value only).
    touched: watch::Sender<u64>,
}

impl Default for Metrics {
    /// The metrics, all registered. Their names and label sets are constants, so a failure
    /// here is a bug that the unit tests meet first, never a runtime condition.
    fn default() -> Metrics {
        Metrics::new().expect("vfiod's metrics register (constant names, unit-tested)")
    }
}

/// A pool's last call: when it ended, and why the pool could not be reached or understood
/// (`None`: it answered, a refusal included).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolCall {
    pub at: SystemTime,
    pub error: Option<String>,
}

fn register<T: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    name: &'static str,
    made: prometheus::Result<T>,
) -> Result<T, MetricsError> {
    let m = made.map_err(|source| MetricsError::Register { name, source })?;
    registry
        .register(Box::new(m.clone()))
        .map_err(|source| MetricsError::Register { name, source })?;
    Ok(m)
}

impl Metrics {
    pub fn new() -> Result<Metrics, MetricsError> {
        let r = Registry::new();
        let devices = register(
            &r,
            "vfiod_devices",
            IntGaugeVec::new(
                Opts::new(
                    "vfiod_devices",
                    "PCI functions vfiod knows, by kind and state.",
                ),
                &["kind", "state"],
            ),
        )?;
        let claims = register(
            &r,
            "vfiod_claims",
            IntGaugeVec::new(
                Opts::new(
                    "vfiod_claims",
                    "Claims that hold their functions, by state.",
                ),
                &["state"],
            ),
        )?;
        let tasks = register(
            &r,
            "vfiod_tasks_total",
            IntCounterVec::new(
                Opts::new(
                    "vfiod_tasks_total",
                    "Tasks finished since vfiod started, by kind and result.",
                ),
                &["kind", "result"],
            ),
        )?;
        let task_duration = register(
            &r,
            "vfiod_task_duration_seconds",
            HistogramVec::new(
                HistogramOpts::new(
                    "vfiod_task_duration_seconds",
                    "Time from a task's creation to its end, by kind.",
                )
                .buckets(TASK_BUCKETS.to_vec()),
                &["kind"],
            ),
        )?;
        let hook_duration = register(
            &r,
            "vfiod_hook_duration_seconds",
            HistogramVec::new(
                HistogramOpts::new(
                    "vfiod_hook_duration_seconds",
                    "Time vfiod took to answer a libvirt qemu hook call, by operation and result.",
                )
                .buckets(HOOK_BUCKETS.to_vec()),
                &["operation", "result"],
            ),
        )?;
        let pool_errors = register(
            &r,
            "vfiod_pool_call_errors_total",
            IntCounterVec::new(
                Opts::new(
                    "vfiod_pool_call_errors_total",
                    "Calls to a device pool that failed, by pool and kind of error.",
                ),
                &["pool", "error"],
            ),
        )?;
        let fleet_age = register(
            &r,
            "vfiod_fleet_report_age_seconds",
            GaugeVec::new(
                Opts::new(
                    "vfiod_fleet_report_age_seconds",
                    "Seconds since the fleet database last took this host's report (since vfiod \
                     started when it has not yet); absent without [fleet].",
                ),
                &[],
            ),
        )?;
        let textfile_errors = register(
            &r,
            "vfiod_metrics_textfile_errors_total",
            IntCounter::new(
                "vfiod_metrics_textfile_errors_total",
                "Writes of the metrics textfile that failed.",
            ),
        )?;
        let build = register(
            &r,
            "vfiod_build_info",
            IntGaugeVec::new(
                Opts::new(
                    "vfiod_build_info",
                    "The running vfiod's version (always 1).",
                ),
                &["version"],
            ),
        )?;
        build.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        // Every task kind the daemon runs starts at zero, so that the first task of a kind is
        // an increase `rate()` sees (the test suite's own kind is left out).
        for kind in TaskKind::ALL.iter().filter(|k| **k != TaskKind::Test) {
            for result in [TaskState::Success, TaskState::Error] {
                tasks.with_label_values(&[kind.as_str(), result.as_str()]);
            }
        }
        Ok(Metrics {
            registry: r,
            devices,
            claims,
            tasks,
            task_duration,
            hook_duration,
            pool_errors,
            fleet_age,
            textfile_errors,
            fleet_reported: Mutex::new(None),
            pool_calls: Mutex::new(BTreeMap::new()),
            started: Instant::now(),
            rendering: Mutex::new(()),
            touched: watch::channel(0).0,
        })
    }

    /// A receiver that sees every update of a counter or histogram (newest value only).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.touched.subscribe()
    }

    fn touch(&self) {
        self.touched.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A task reached its final state (success or error); a reset of a task in error is not
    /// a second end and must not be passed here.
    pub fn task_finished(&self, task: &TaskRecord) {
        if !task.state.is_final() {
            return;
        }
        let kind = task.kind.as_str();
        self.tasks
            .with_label_values(&[kind, task.state.as_str()])
            .inc();
        let end = task.finished_ms.unwrap_or(task.created_ms);
        let seconds = (end - task.created_ms).max(0) as f64 / 1000.0;
        self.task_duration
            .with_label_values(&[kind])
            .observe(seconds);
        self.touch();
    }

    /// A hook call was answered after `took`: `passed` when its exit code was 0.
    pub fn hook_answered(&self, operation: &str, passed: bool, took: Duration) {
        let result = if passed { "pass" } else { "fail" };
        self.hook_duration
            .with_label_values(&[hook_operation_label(operation), result])
            .observe(took.as_secs_f64());
        self.touch();
    }

    /// A call to pool `pool` (a configured name) failed.
    pub fn pool_call_failed(&self, pool: &str, error: &PoolError) {
        self.pool_errors
            .with_label_values(&[pool, pool_error_label(error)])
            .inc();
        // A refusal is an answer: the pool is reachable, it said no to this call.
        let reached = matches!(
            error,
            PoolError::StaleEpoch { .. }
                | PoolError::NotFound
                | PoolError::NotQuiesced
                | PoolError::Refused { .. }
        );
        self.pool_called(pool, (!reached).then(|| crate::error_chain(error)));
        self.touch();
    }

    /// A call to pool `pool` got its answer (`vfioctl status` shows the pool reachable).
    pub fn pool_call_answered(&self, pool: &str) {
        self.pool_called(pool, None);
    }

    fn pool_called(&self, pool: &str, error: Option<String>) {
        let mut calls = self
            .pool_calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Bounded by the configured pools' names (a removed pool's entry stays until restart).
        calls.insert(
            pool.to_string(),
            PoolCall {
                at: SystemTime::now(),
                error,
            },
        );
    }

    /// Each pool's last call since start, by name.
    pub fn pool_calls(&self) -> BTreeMap<String, PoolCall> {
        self.pool_calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The fleet database took a report now.
    pub fn fleet_reported(&self) {
        *self
            .fleet_reported
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(SystemTime::now());
        self.touch();
    }

    /// When the fleet last took a report; `None` until the first since start.
    pub fn fleet_last_report(&self) -> Option<SystemTime> {
        *self
            .fleet_reported
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A write of the textfile failed (the caller logs why).
    pub fn textfile_failed(&self) {
        self.textfile_errors.inc();
    }

    /// Every metric as Prometheus text, the gauges from `state`.
    pub fn render(&self, state: &State) -> Result<String, MetricsError> {
        let _one = self
            .rendering
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.devices.reset();
        for (kind, s, n) in &state.devices {
            self.devices
                .with_label_values(&[kind.as_str(), s.as_str()])
                .set(*n as i64);
        }
        self.claims.reset();
        for (s, n) in &state.claims {
            self.claims.with_label_values(&[s.as_str()]).set(*n as i64);
        }
        self.fleet_age.reset();
        if state.fleet {
            let age = match self.fleet_last_report() {
                // A clock set back makes it 0, not negative.
                Some(at) => at.elapsed().unwrap_or_default(),
                None => self.started.elapsed(),
            };
            let gauge: Gauge = self.fleet_age.with_label_values::<&str>(&[]);
            gauge.set(age.as_secs_f64());
        }
        for pool in &state.pools {
            for error in POOL_ERRORS {
                self.pool_errors.with_label_values(&[pool.as_str(), error]);
            }
        }
        TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .map_err(MetricsError::Encode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::claim::ClaimState;
    use crate::model::device::{Kind, State as DeviceState};

    fn task(kind: TaskKind, state: TaskState, ms: i64) -> TaskRecord {
        TaskRecord {
            id: 1,
            address: "0000:3b:00.0".parse().unwrap(),
            kind,
            state,
            step: String::new(),
            percent: 100,
            message: String::new(),
            params: "{}".into(),
            requested_by: "test".into(),
            created_ms: 1_000,
            started_ms: Some(1_000),
            finished_ms: Some(1_000 + ms),
            reset_ms: None,
            reset_by: None,
        }
    }

    fn line<'a>(text: &'a str, start: &str) -> Option<&'a str> {
        text.lines().find(|l| l.starts_with(start))
    }

    #[test]
    fn labels_come_from_closed_sets() {
        for (op, wanted) in [
            ("prepare", "prepare"),
            ("release", "release"),
            ("reconnect", "reconnect"),
            ("frobnicate", "other"),
            ("", "other"),
        ] {
            assert_eq!(hook_operation_label(op), wanted);
        }
        for (e, wanted) in [
            (PoolError::StaleEpoch { current: 3 }, "stale_epoch"),
            (PoolError::NotFound, "not_found"),
            (PoolError::Unreachable("x".into()), "unreachable"),
            (
                PoolError::Refused {
                    code: "device_taken".into(),
                    message: String::new(),
                },
                "refused",
            ),
        ] {
            assert_eq!(pool_error_label(&e), wanted);
            assert!(POOL_ERRORS.contains(&wanted));
        }
    }

    #[test]
    fn updates_show_in_the_render() {
        let m = Metrics::new().unwrap();
        m.task_finished(&task(TaskKind::Split, TaskState::Success, 300));
        m.task_finished(&task(TaskKind::Split, TaskState::Success, 2_000));
        m.task_finished(&task(TaskKind::Restore, TaskState::Error, 10));
        // Not final: not counted.
        m.task_finished(&task(TaskKind::Restore, TaskState::Running, 10));
        m.hook_answered("prepare", true, Duration::from_millis(3));
        m.hook_answered("weird", false, Duration::from_millis(70));
        m.pool_call_failed("rack1", &PoolError::NotFound);
        let state = State::count(&[], &[], true, vec!["rack1".into()]);
        let text = m.render(&state).unwrap();
        for want in [
            "vfiod_tasks_total{kind=\"split\",result=\"success\"} 2",
            "vfiod_tasks_total{kind=\"restore\",result=\"error\"} 1",
            "vfiod_tasks_total{kind=\"attach\",result=\"success\"} 0",
            "vfiod_task_duration_seconds_bucket{kind=\"split\",le=\"0.5\"} 1",
            "vfiod_task_duration_seconds_bucket{kind=\"split\",le=\"2.5\"} 2",
            "vfiod_task_duration_seconds_sum{kind=\"split\"} 2.3",
            "vfiod_task_duration_seconds_count{kind=\"split\"} 2",
            "vfiod_hook_duration_seconds_count{operation=\"prepare\",result=\"pass\"} 1",
            "vfiod_hook_duration_seconds_bucket{operation=\"prepare\",result=\"pass\",le=\"0.005\"} 1",
            "vfiod_hook_duration_seconds_count{operation=\"other\",result=\"fail\"} 1",
            "vfiod_pool_call_errors_total{error=\"not_found\",pool=\"rack1\"} 1",
            "vfiod_pool_call_errors_total{error=\"unreachable\",pool=\"rack1\"} 0",
            "vfiod_devices{kind=\"gpu\",state=\"usable\"} 0",
            "vfiod_claims{state=\"attached\"} 0",
            "# TYPE vfiod_tasks_total counter",
            "# TYPE vfiod_task_duration_seconds histogram",
            "# TYPE vfiod_devices gauge",
            "vfiod_metrics_textfile_errors_total 0",
        ] {
            assert!(text.lines().any(|l| l == want), "{want:?} not in\n{text}");
        }
        assert!(!text.contains("kind=\"test\""), "{text}");
        let age: f64 = line(&text, "vfiod_fleet_report_age_seconds ")
            .unwrap()
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!((0.0..60.0).contains(&age), "{age}");
        // Without [fleet] the age is absent; the gauges follow the state of each render.
        let devices = State {
            devices: vec![(Kind::Nic, DeviceState::Broken, 3)],
            claims: vec![(ClaimState::Claimed, 2)],
            fleet: false,
            pools: vec![],
        };
        let text = m.render(&devices).unwrap();
        assert!(!text.contains("vfiod_fleet_report_age_seconds"), "{text}");
        assert!(text.contains("\nvfiod_devices{kind=\"nic\",state=\"broken\"} 3\n"));
        assert!(!text.contains("vfiod_devices{kind=\"gpu\""), "{text}");
        assert!(text.contains("\nvfiod_claims{state=\"claimed\"} 2\n"));
    }

    #[test]
    fn every_update_wakes_a_subscriber() {
        let m = Metrics::new().unwrap();
        let mut rx = m.subscribe();
        assert!(!rx.has_changed().unwrap());
        m.hook_answered("started", true, Duration::ZERO);
        assert!(rx.has_changed().unwrap());
        rx.borrow_and_update();
        m.fleet_reported();
        assert!(rx.has_changed().unwrap());
    }
}
