//! A job that is not a sysfs plan, for the tests that show a new kind of job needs no change to
//! the engine: `TaskKind::Test`, phases of different weights that sleep a little, and switches
//! to fail or panic in a phase, to refuse in guard, and to pause at each progress report until
//! the test lets it go (so a test can read the percentage at a known point, not race it).

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use vfiod::engine::{Admission, Job, JobContext, JobError, JobFailure, Phase, Progress};
use vfiod::model::pci::PciAddress;
use vfiod::model::task::TaskKind;

/// The phases of every test job: weights that differ, so that a percentage shows whether the
/// weights were followed (equal weights would not).
pub const PHASES: [Phase; 3] = [
    Phase::new("load", 10),
    Phase::new("write", 60),
    Phase::new("verify", 30),
];

/// Steps of each phase; all but the last are reported (the last would equal the next phase's
/// start): "load 1/2", "write 1/2", "verify 1/2".
pub const STEPS: usize = 2;

fn step_name(phase: &str, done: usize) -> String {
    format!("{phase} {done}/{STEPS}")
}

/// What a job did, for the test to read: calls in order, and the progress points it reached.
/// With `pausing`, the job waits at each progress point until [`Record::release`].
#[derive(Default)]
pub struct Record {
    state: Mutex<RecordState>,
    wake: Condvar,
}

#[derive(Default)]
struct RecordState {
    calls: Vec<String>,
    reached: Vec<String>,
    pausing: bool,
    /// Progress points the test has let go of.
    released: usize,
}

impl Record {
    pub fn new(pausing: bool) -> Arc<Record> {
        let r = Arc::new(Record::default());
        r.state.lock().unwrap().pausing = pausing;
        r
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RecordState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn call(&self, what: &str) {
        self.lock().calls.push(what.to_string());
    }

    /// admit, prepare, guard, run, rollback: the calls the runner made, in order.
    pub fn calls(&self) -> Vec<String> {
        self.lock().calls.clone()
    }

    /// The progress points reached so far (step names).
    pub fn reached(&self) -> Vec<String> {
        self.lock().reached.clone()
    }

    /// Lets a paused job go on from its current progress point.
    pub fn release(&self) {
        self.lock().released += 1;
        self.wake.notify_all();
    }

    /// Stops pausing: a paused job goes on to its end.
    pub fn release_all(&self) {
        self.lock().pausing = false;
        self.wake.notify_all();
    }

    /// A guard that stops pausing when dropped: a test that fails while its job is paused must
    /// not leave a worker blocked (the runtime waits for it before the next test can report).
    pub fn releaser(self: &Arc<Self>) -> Releaser {
        Releaser(Arc::clone(self))
    }

    /// Called by the job at a progress point: recorded, then (when pausing) held until the test
    /// releases it. Bounded all the same: after a minute the job stops pausing.
    fn reach(&self, step: &str) {
        let mut st = self.lock();
        st.reached.push(step.to_string());
        let n = st.reached.len();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while st.pausing && st.released < n {
            if std::time::Instant::now() >= deadline {
                st.pausing = false;
                break;
            }
            st = self
                .wake
                .wait_timeout(st, Duration::from_millis(100))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// See [`Record::releaser`].
pub struct Releaser(Arc<Record>);

impl Drop for Releaser {
    fn drop(&mut self) {
        self.0.release_all();
    }
}

/// A test job on `address`, holding `scope` too.
pub struct TestJob {
    pub address: PciAddress,
    pub scope: Vec<PciAddress>,
    /// How long each step sleeps: short, so that a whole job takes a fraction of a second.
    pub step_sleep: Duration,
    pub fail_in: Option<&'static str>,
    pub panic_in: Option<&'static str>,
    /// The rollback fails too (after a failed run).
    pub rollback_fails: bool,
    pub refuse_in_guard: bool,
    /// Sleeps (practically) for ever once this phase starts: the process is to be killed there.
    pub hang_in: Option<&'static str>,
    /// Touched when the job reaches `hang_in`, for a parent process to see.
    pub hang_marker: Option<PathBuf>,
    pub record: Arc<Record>,
}

impl TestJob {
    pub fn new(address: PciAddress) -> TestJob {
        TestJob {
            address,
            scope: Vec::new(),
            step_sleep: Duration::from_millis(10),
            fail_in: None,
            panic_in: None,
            rollback_fails: false,
            refuse_in_guard: false,
            hang_in: None,
            hang_marker: None,
            record: Record::new(false),
        }
    }
}

impl Job for TestJob {
    fn device(&self) -> PciAddress {
        self.address
    }

    fn admit(&mut self, cx: &JobContext) -> Result<Admission, JobError> {
        self.record.call("admit");
        // Like any job: refuse a device the records do not have.
        if cx.store.device(self.address)?.is_none() {
            return Err(JobError::NoSuchDevice(self.address));
        }
        Ok(Admission {
            kind: TaskKind::Test,
            scope: self.scope.clone(),
            params: serde_json::json!({ "test": true, "fail_in": self.fail_in }),
        })
    }

    fn prepare(&mut self, _cx: &JobContext) -> Result<TaskKind, JobError> {
        self.record.call("prepare");
        Ok(TaskKind::Test)
    }

    fn guard(&self, _cx: &JobContext) -> Result<(), JobError> {
        self.record.call("guard");
        if self.refuse_in_guard {
            return Err(JobError::InUse {
                address: self.address,
                users: vec!["the test's VM holds it".into()],
            });
        }
        Ok(())
    }

    fn phases(&self) -> Vec<Phase> {
        PHASES.to_vec()
    }

    fn run(&mut self, _cx: &JobContext, progress: &mut Progress<'_>) -> Result<String, JobFailure> {
        self.record.call("run");
        for phase in PHASES {
            progress.phase(phase.name);
            self.record.reach(phase.name);
            if self.hang_in == Some(phase.name) {
                if let Some(m) = &self.hang_marker {
                    std::fs::write(m, phase.name).expect("write the hang marker");
                }
                std::thread::sleep(Duration::from_secs(3600));
            }
            if self.fail_in == Some(phase.name) {
                return Err(JobFailure::new(format!("told to fail in {}", phase.name)));
            }
            if self.panic_in == Some(phase.name) {
                panic!("told to panic in {}", phase.name);
            }
            for done in 1..=STEPS {
                std::thread::sleep(self.step_sleep);
                if done < STEPS {
                    let step = step_name(phase.name, done);
                    progress.step(done, STEPS, &step);
                    self.record.reach(&step);
                }
            }
        }
        Ok(format!("test job on {} done", self.address))
    }

    fn rollback(&mut self, _cx: &JobContext) -> Result<String, JobFailure> {
        self.record.call("rollback");
        if self.rollback_fails {
            return Err(JobFailure::new("the test device would not go back"));
        }
        Ok("put the test device back".into())
    }
}
