//! One vfiod per state directory: a second `Server::start` on the directory of a running one
//! refuses, naming the holder's pid, before it touches the store (the first one's running task
//! is not marked interrupted); once the first stops, a new one starts. The binary's side
//! (`vfiod --simulate --sim-root DIR` twice) is in `tests/simulated/simulate.rs`.

use crate::common;

use crate::common::{Harness, STEADY_CONFIG};
use vfiod::dbus::auth::Authorizer;
use vfiod::server::{Options, Server, ServerError};
use vfiod::store::lock::{LockError, LOCK_FILE_NAME};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_daemon_on_the_same_state_directory_refuses_to_start() {
    let mut h = Harness::start(STEADY_CONFIG).await;
    let fpga = common::addr("0000:af:00.0");
    // The first daemon is in the middle of a task.
    let t = h
        .store()
        .create_task(fpga, vfiod::model::task::TaskKind::Split, "{}", "test")
        .unwrap();
    h.store()
        .task_progress(t.id, "echo '4' > sriov_numvfs", 20)
        .unwrap();
    let state_dir = h.dir.path().join("state");

    let second = Server::start(Options {
        settings: h.source().load().unwrap(),
        source: Some(h.source()),
        sysfs: h.kernel.sysfs(),
        events: None,
        bus: h.bus_target(),
        authorizer: Authorizer::SameUser,
        simulated: true,
    })
    .await;
    let err = second.err().expect("the second daemon must not start");
    let chain = vfiod::error_chain(&err);
    match &err {
        ServerError::StateLock(LockError::InUse { pid, path, .. }) => {
            assert_eq!(*pid, Some(std::process::id()), "{chain}");
            assert_eq!(*path, state_dir.join(LOCK_FILE_NAME), "{chain}");
        }
        other => panic!("expected the state directory to be in use, got {other:?}: {chain}"),
    }
    assert!(
        chain.contains(&format!(
            "state directory {} is in use by vfiod pid {} (lock {})",
            state_dir.display(),
            std::process::id(),
            state_dir.join(LOCK_FILE_NAME).display()
        )),
        "{chain}"
    );

    // Nothing was touched: the first daemon's task still runs, and it still serves.
    let task = h.store().task(t.id).unwrap().unwrap();
    assert_eq!(task.state.as_str(), "running", "{}", task.message);
    assert!(!vfiod::client::list_devices(&h.client)
        .await
        .unwrap()
        .is_empty());

    // Once the first stops, a new daemon starts (and only then is the task interrupted).
    h.stop_server().await;
    h.start_server().await;
    let task = h.store().task(t.id).unwrap().unwrap();
    assert_eq!(task.state.as_str(), "error");
    assert!(task.message.contains("interrupted"), "{}", task.message);
}
