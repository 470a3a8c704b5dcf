//! A new kind of job needs no change to the engine: a test-only job (`tests/common/test_job.rs`,
//! kind `test`, phases that sleep, switches to fail, panic or refuse) run through
//! `Engine::start_task` gets the life every task has: weighted progress on the task object and in
//! the store, Busy for a second request on its device and on its scope, rollback after a failure
//! or a panic with its message in the result, error until an operator resets it, a refusal that
//! leaves the device idle, and "interrupted" after a SIGKILL.

use crate::common;

use crate::common::proxies::device;
use crate::common::test_job::{Record, TestJob};
use crate::common::{addr, eventually, eventually_async, Harness, STEADY_CONFIG};
use std::sync::Arc;
use std::time::Duration;
use vfiod::engine::JobError;
use vfiod::store::{TaskRecord, TaskState, REFUSED_BY};

const FPGA: &str = "0000:af:00.0";
const GPU: &str = "0000:17:00.0";
const AUDIO: &str = "0000:17:00.1";

/// How long a short test job may take on a loaded machine.
const WITHIN: Duration = Duration::from_secs(30);

async fn task_object(h: &Harness, id: i64) -> vfiod::client::TaskProxy<'static> {
    vfiod::client::task(&h.client, vfiod::dbus::task::task_path(id))
        .await
        .unwrap()
}

async fn start(h: &Harness, job: TestJob) -> Result<TaskRecord, JobError> {
    let engine = &h.server.as_ref().expect("server running").engine;
    let task = engine.start_task(Box::new(job), "the jobs test").await;
    // As a D-Bus method does before it replies: the task's object exists once this returns.
    engine.flush().await;
    task
}

/// The task's record once it has ended.
async fn finished(h: &Harness, id: i64) -> TaskRecord {
    let store = h.store();
    eventually(WITHIN, &format!("task {id} ends"), || {
        store.task(id).unwrap().filter(|t| t.state.is_final())
    })
    .await
}

/// Waits until the device's object shows `state` as its TaskState.
async fn device_shows(h: &Harness, a: &str, state: &str) {
    let d = device(h, a).await;
    eventually_async(WITHIN, &format!("{a} shows TaskState {state}"), || {
        let d = &d;
        async move { (d.task_state().await.unwrap() == state).then_some(()) }
    })
    .await;
}

fn error_name(e: zbus::Error) -> (String, String) {
    match e {
        zbus::Error::MethodError(n, m, _) => (n.to_string(), m.unwrap_or_default()),
        other => panic!("not a D-Bus error reply: {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_follows_the_weights_on_the_task_object_and_in_the_store() {
    let h = Harness::start(STEADY_CONFIG).await;
    let mut job = TestJob::new(addr(FPGA));
    job.record = Record::new(true);
    let record = Arc::clone(&job.record);
    let _release = record.releaser();
    let task = start(&h, job).await.expect("the test job starts");
    assert_eq!(task.kind.as_str(), "test");
    let object = task_object(&h, task.id).await;
    assert_eq!(object.kind().await.unwrap(), "test");

    // Weights 10, 60, 30; each phase reported at its start and half-way.
    let expected: [(&str, u8); 6] = [
        ("load", 0),
        ("load 1/2", 5),
        ("write", 10),
        ("write 1/2", 40),
        ("verify", 70),
        ("verify 1/2", 85),
    ];
    for (i, (step, percent)) in expected.into_iter().enumerate() {
        // The job waits at each progress point until released: the point is stable to look at.
        eventually(WITHIN, &format!("the job reaches {step}"), || {
            (record.reached().len() == i + 1).then_some(())
        })
        .await;
        assert_eq!(record.reached()[i], step);
        let stored = h.store().task(task.id).unwrap().unwrap();
        assert_eq!(
            (stored.state, stored.step.as_str(), stored.percent),
            (TaskState::Running, step, percent),
            "store at {step}"
        );
        eventually_async(WITHIN, &format!("the task object shows {step}"), || {
            let object = &object;
            async move {
                let shown = (
                    object.step().await.unwrap(),
                    object.percent().await.unwrap(),
                );
                (shown == (step.to_string(), percent)).then_some(())
            }
        })
        .await;
        assert_eq!(object.state().await.unwrap(), "running");
        if i == 0 {
            device_shows(&h, FPGA, "running").await;
        }
        record.release();
    }
    let done = finished(&h, task.id).await;
    assert_eq!(
        (done.state, done.percent, done.message.as_str()),
        (TaskState::Success, 100, "test job on 0000:af:00.0 done")
    );
    assert_eq!(record.calls(), ["admit", "prepare", "guard", "run"]);
    device_shows(&h, FPGA, "idle").await;
    let fpga = device(&h, FPGA).await;
    let last = fpga.last_result().await.unwrap();
    assert_eq!(
        last,
        format!(
            "task {} test: success: test job on 0000:af:00.0 done",
            task.id
        )
    );
    assert_eq!(object.percent().await.unwrap(), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_request_on_the_device_or_its_scope_is_busy() {
    let h = Harness::start(STEADY_CONFIG).await;
    // A test job on the GPU that also holds its audio function, paused at its first step.
    let mut job = TestJob::new(addr(GPU));
    job.scope = vec![addr(AUDIO)];
    job.record = Record::new(true);
    let record = Arc::clone(&job.record);
    let _release = record.releaser();
    let task = start(&h, job).await.unwrap();
    eventually(WITHIN, "the job runs", || {
        (!record.reached().is_empty()).then_some(())
    })
    .await;

    // Another test job, on the device or on the function in its scope.
    for a in [GPU, AUDIO] {
        let again = TestJob::new(addr(a));
        let calls = Arc::clone(&again.record);
        let e = start(&h, again)
            .await
            .expect_err("a second job must be refused");
        assert!(e.is_busy(), "{a}: {e}");
        let message = vfiod::error_chain(&e);
        assert!(
            message.contains(&format!("{a} is busy: task {} test", task.id)),
            "{a}: Busy must name the test task: {message}"
        );
        assert_eq!(calls.calls(), ["admit"], "{a}: refused before prepare");
    }
    // A mode job over D-Bus (another kind) meets the same rule.
    device_shows(&h, AUDIO, "running").await;
    let audio = device(&h, AUDIO).await;
    assert_eq!(
        audio.current_task().await.unwrap(),
        vfiod::dbus::task::task_path(task.id)
    );
    let (name, message) = error_name(
        audio
            .set_mode("pf", vfiod::client::mode_options(None))
            .await
            .unwrap_err(),
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.Busy", "{message}");
    assert!(
        message.contains(&format!("task {} test", task.id)),
        "{message}"
    );
    let gpu = device(&h, GPU).await;
    let (name, _) = error_name(gpu.apply().await.unwrap_err());
    assert_eq!(name, "org.vfiod.Vfiod1.Error.Busy");
    assert_eq!(
        h.store().tasks(None, 10).unwrap().len(),
        1,
        "refused requests create no task"
    );

    record.release_all();
    assert_eq!(finished(&h, task.id).await.state, TaskState::Success);
    device_shows(&h, AUDIO, "idle").await;
    // Free again: the audio function takes a job of its own.
    let next = start(&h, TestJob::new(addr(AUDIO))).await.unwrap();
    assert_eq!(finished(&h, next.id).await.state, TaskState::Success);
}

/// A run that fails (or panics) is rolled back, its result says both, and the device stays in
/// error, Busy to every request, until an operator resets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_or_a_panic_is_rolled_back_and_holds_the_device_until_reset() {
    let h = Harness::start(STEADY_CONFIG).await;
    let fpga = device(&h, FPGA).await;
    // Each case: the switches, then the result and the percent it stopped at.
    let fail = |phase| {
        let mut j = TestJob::new(addr(FPGA));
        j.fail_in = Some(phase);
        j
    };
    let panic = |phase| {
        let mut j = TestJob::new(addr(FPGA));
        j.panic_in = Some(phase);
        j
    };
    let mut fail_twice = fail("load");
    fail_twice.rollback_fails = true;
    let cases = [
        (
            fail("write"),
            "told to fail in write; rollback put the test device back",
            10,
        ),
        (
            panic("verify"),
            "internal error: the job panicked: told to panic in verify; rollback put the test \
             device back",
            70,
        ),
        (
            fail_twice,
            "told to fail in load; rollback failed too: the test device would not go back",
            0,
        ),
    ];
    for (job, result, percent) in cases {
        let record = Arc::clone(&job.record);
        let task = start(&h, job).await.unwrap();
        let done = finished(&h, task.id).await;
        assert_eq!(
            (done.state, done.message.as_str(), done.percent),
            (TaskState::Error, result, percent),
        );
        assert_eq!(
            record.calls(),
            ["admit", "prepare", "guard", "run", "rollback"]
        );
        assert_eq!(done.reset_by, None);

        // Error until reset: on the bus, in the store, and to every request.
        device_shows(&h, FPGA, "error").await;
        let object = task_object(&h, task.id).await;
        assert_eq!(object.result().await.unwrap(), result);
        let again = TestJob::new(addr(FPGA));
        let e = start(&h, again).await.expect_err("Busy while in error");
        assert!(e.is_busy(), "{e}");
        assert!(
            vfiod::error_chain(&e).contains("until an operator resets it"),
            "{e}"
        );
        let (name, _) = error_name(
            fpga.set_mode("vf", vfiod::client::mode_options(Some(2)))
                .await
                .unwrap_err(),
        );
        assert_eq!(name, "org.vfiod.Vfiod1.Error.Busy");

        fpga.reset_task().await.unwrap();
        device_shows(&h, FPGA, "idle").await;
        let reset = h.store().task(task.id).unwrap().unwrap();
        assert_eq!(reset.state, TaskState::Error, "the row stays as history");
        assert!(reset.reset_by.is_some_and(|by| by != REFUSED_BY));
    }
    // Free again.
    let task = start(&h, TestJob::new(addr(FPGA))).await.unwrap();
    assert_eq!(finished(&h, task.id).await.state, TaskState::Success);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_in_guard_leaves_the_device_idle() {
    let h = Harness::start(STEADY_CONFIG).await;
    let mut job = TestJob::new(addr(FPGA));
    job.refuse_in_guard = true;
    let record = Arc::clone(&job.record);
    let e = start(&h, job).await.expect_err("refused in guard");
    assert!(
        matches!(&e, JobError::InUse { users, .. } if users == &["the test's VM holds it"]),
        "{e:?}"
    );
    assert_eq!(record.calls(), ["admit", "prepare", "guard"], "never run");
    let tasks = h.store().tasks(Some(addr(FPGA)), 10).unwrap();
    assert_eq!(tasks.len(), 1, "{tasks:?}");
    let t = &tasks[0];
    assert_eq!(t.state, TaskState::Error);
    assert_eq!(t.reset_by.as_deref(), Some(REFUSED_BY));
    assert!(
        t.message.contains("the test's VM holds it") && t.message.contains("nothing was changed"),
        "{}",
        t.message
    );
    assert_eq!(h.store().blocking_task(addr(FPGA)).unwrap(), None);
    h.server.as_ref().unwrap().engine.flush().await;
    assert_eq!(device(&h, FPGA).await.task_state().await.unwrap(), "idle");

    // Refused before the task exists: no row at all.
    let e = start(&h, TestJob::new(addr("0000:ee:00.0")))
        .await
        .expect_err("no such device");
    assert!(matches!(e, JobError::NoSuchDevice(_)), "{e:?}");
    assert_eq!(h.store().tasks(None, 10).unwrap().len(), 1);

    // Nothing holds the device: the next job runs.
    let task = start(&h, TestJob::new(addr(FPGA))).await.unwrap();
    assert_eq!(finished(&h, task.id).await.state, TaskState::Success);
}

// ----- interrupted by SIGKILL ----------------------------------------------------------------

/// Set (to the parent's temporary directory) only in the child of
/// [`a_job_killed_mid_phase_is_interrupted_at_restart`].
const CHILD_DIR_ENV: &str = "VFIOD_TEST_JOBS_CHILD_DIR";

/// Where the child says its job hangs in phase "write".
const MARKER: &str = "child-in-write";

/// The child process of [`a_job_killed_mid_phase_is_interrupted_at_restart`] (the test itself,
/// run again as its helper): a test job on a bare engine over the parent's state directory,
/// hanging in "write" until the parent kills it.
async fn job_child() -> ! {
    let dir = std::env::var_os(CHILD_DIR_ENV).expect("the helper is given the parent's directory");
    let dir = std::path::PathBuf::from(dir);
    let kernel = vfiod::sim::kernel::SimKernel::build(
        &dir.join("child-root"),
        &vfiod::sim::kernel::HostModel::reference(),
    )
    .unwrap();
    let mut settings =
        vfiod::config::Settings::from_toml_str(STEADY_CONFIG, std::path::Path::new("test"))
            .unwrap();
    settings.sysfs_root = kernel.root().to_path_buf();
    settings.state_dir = dir.join("state");
    let store = vfiod::store::Store::open(&settings.state_dir).unwrap();
    let core = vfiod::engine::Core::new(
        settings,
        None,
        kernel.sysfs(),
        Arc::new(store),
        Arc::new(vfiod::engine::Modprobe),
    )
    .unwrap();
    let (engine, _events) = vfiod::engine::Engine::new(core);
    engine.refresh().await.unwrap();
    let mut job = TestJob::new(addr(FPGA));
    job.hang_in = Some("write");
    job.hang_marker = Some(dir.join(MARKER));
    engine
        .start_task(Box::new(job), "the jobs test's child")
        .await
        .unwrap();
    // Killed here.
    tokio::time::sleep(Duration::from_secs(3600)).await;
    panic!("the child was not killed within an hour");
}

/// The child that is killed mid-phase is this test again, as its own helper process
/// (`common::helper_process`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_killed_mid_phase_is_interrupted_at_restart() {
    let name = common::test_name(
        module_path!(),
        "a_job_killed_mid_phase_is_interrupted_at_restart",
    );
    if common::is_helper(&name) {
        job_child().await;
    }
    let dir = common::fast_tempdir();
    let mut child = common::helper_process(&name)
        .env(CHILD_DIR_ENV, dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the child");
    let marker = dir.path().join(MARKER);
    let reached = eventually(
        Duration::from_secs(60),
        "the child's job hangs in write",
        || {
            if marker.exists() {
                return Some(true);
            }
            child.try_wait().unwrap().map(|status| {
                panic!("the child ended before its job reached write: {status}");
            })
        },
    )
    .await;
    assert!(reached);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();

    // vfiod starts on the same state directory.
    let kernel = vfiod::sim::kernel::SimKernel::build(
        &dir.path().join("root"),
        &vfiod::sim::kernel::HostModel::reference(),
    )
    .unwrap();
    let bus = vfiod::sim::bus::PrivateBus::start(&dir.path().join("bus"), "").unwrap();
    let mut h = Harness::assemble(dir, kernel, bus, STEADY_CONFIG).await;
    h.start_server().await;
    let tasks = h.store().tasks(None, 10).unwrap();
    assert_eq!(tasks.len(), 1, "{tasks:?}");
    let t = &tasks[0];
    assert_eq!(
        (t.kind.as_str(), t.state, t.message.as_str()),
        (
            "test",
            TaskState::Error,
            "interrupted (vfiod stopped during step write)"
        )
    );
    assert_eq!(t.reset_by, None);
    device_shows(&h, FPGA, "error").await;
    let fpga = device(&h, FPGA).await;
    assert_eq!(
        fpga.current_task().await.unwrap(),
        vfiod::dbus::task::task_path(t.id)
    );
    let e = start(&h, TestJob::new(addr(FPGA)))
        .await
        .expect_err("Busy until reset");
    assert!(e.is_busy(), "{e}");
    fpga.reset_task().await.unwrap();
    device_shows(&h, FPGA, "idle").await;
    let task = start(&h, TestJob::new(addr(FPGA))).await.unwrap();
    assert_eq!(finished(&h, task.id).await.state, TaskState::Success);
}
