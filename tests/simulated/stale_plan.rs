//! A task created right after another on the same IOMMU group computes its own plan from the
//! state the first one left, never from a state read before its task existed.
//!
//! The defect this guards against: task A binds the GPU's group to vfio-pci (a reload that
//! selects `pf_driver = "vfio-pci"`); B, an Apply on the GPU requested at once after (retried
//! while Busy), had read the group still on nouveau/snd_hda_intel, so it "bound" a group already
//! bound, failed half-way, and its rollback put the group back on nouveau.

use crate::common;

use crate::common::{addr, eventually, Harness, STEADY_CONFIG};
use std::time::{Duration, Instant};
use vfiod::engine::job::ModeJob;
use vfiod::engine::{Job, Phase, Progress};
use vfiod::mode::policy::{Target, VFIO_PCI};
use vfiod::model::task::TaskKind;
use vfiod::sim::kernel::{FaultAction, FaultTarget};
use vfiod::store::{TaskRecord, TaskState};

const GPU: &str = "0000:17:00.0";
const AUDIO: &str = "0000:17:00.1";
const NATIVE: [(&str, &str); 2] = [(GPU, "nouveau"), (AUDIO, "snd_hda_intel")];

/// Rounds of the D-Bus test (each a reload that moves the group, then an Apply): enough to hit
/// the moment between A's end and B's creation many times, a few seconds in all. Raise it for
/// a soak with `VFIOD_STALE_PLAN_ROUNDS`.
const ROUNDS: usize = 48;

fn rounds() -> usize {
    std::env::var("VFIOD_STALE_PLAN_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(ROUNDS)
}

/// The drivers of the GPU's group as the simulated kernel has them.
fn group_drivers(h: &Harness) -> Vec<Option<String>> {
    [GPU, AUDIO]
        .iter()
        .map(|a| h.kernel.driver_of(addr(a)))
        .collect()
}

fn group_on(vfio: bool) -> Vec<Option<String>> {
    NATIVE
        .iter()
        .map(|(_, native)| Some(if vfio { VFIO_PCI } else { native }.to_string()))
        .collect()
}

/// Clients asking for B at once.
const CLIENTS: usize = 3;

/// Apply on the GPU until it is accepted (retried at once while Busy); the task's id, and how
/// many times it was Busy.
async fn apply_until_accepted(gpu: &vfiod::client::DeviceProxy<'_>, round: usize) -> (i64, usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut busy = 0;
    loop {
        match gpu.apply().await {
            Ok(path) => {
                let id = path
                    .as_str()
                    .rsplit('/')
                    .next()
                    .and_then(|id| id.parse().ok())
                    .unwrap();
                return (id, busy);
            }
            Err(zbus::Error::MethodError(name, message, _))
                if name.as_str() == "org.vfiod.Vfiod1.Error.Busy" =>
            {
                let message = message.unwrap_or_default();
                // Busy with a failed task: no retry will be accepted; say why now.
                assert!(
                    !message.contains("until an operator resets it"),
                    "round {round}: a task on the group failed: {message}"
                );
                busy += 1;
                assert!(Instant::now() < deadline, "round {round}: Busy for 60 s");
            }
            Err(e) => panic!("round {round}: Apply failed: {e}"),
        }
    }
}

async fn finished(h: &Harness, id: i64) -> TaskRecord {
    let store = h.store();
    eventually(Duration::from_secs(60), &format!("task {id} ends"), || {
        store.task(id).unwrap().filter(|t| t.state.is_final())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apply_right_after_a_group_move_plans_from_the_state_it_left() {
    let h = Harness::start(STEADY_CONFIG).await;
    let manager = h.manager().await;
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let conn = zbus::connection::Builder::address(h.bus.address())
            .build()
            .await
            .unwrap();
        clients.push(vfiod::client::device(&conn, GPU).await.unwrap());
    }
    assert_eq!(group_drivers(&h), group_on(false));
    // Requests B that met A still running: their admission then raced A's end.
    let mut raced = 0;
    for round in 0..rounds() {
        let vfio = round % 2 == 0;
        h.replace_config(&common::gpu_group_config(vfio));
        // A slow probe keeps A running a little while B is asked for: B meets A, and A's end
        // falls while B's requests are being admitted.
        h.kernel.inject(
            FaultTarget::BusAttr("drivers_probe".into()),
            FaultAction::Delay(Duration::from_millis(30)),
            Some(1),
        );
        let last = h
            .store()
            .tasks(None, 1)
            .unwrap()
            .first()
            .map_or(0, |t| t.id);
        // A: the reload starts the group's move and replies once its task exists.
        manager.reload().await.unwrap();
        let a = h
            .store()
            .tasks(Some(addr(GPU)), 1)
            .unwrap()
            .into_iter()
            .find(|t| t.id > last && t.requested_by.starts_with("reload"))
            .unwrap_or_else(|| panic!("round {round}: the reload started no task for the group"));
        let a_kind = if vfio { "bind" } else { "unbind" };
        assert_eq!(a.kind.as_str(), a_kind, "round {round}: {a:?}");

        // B: at once, again and again while A holds the group, from several clients (the
        // more requests are being admitted when A ends, the likelier one read the group
        // before A's last write and is created after A's end).
        let requests = clients.iter().map(|gpu| apply_until_accepted(gpu, round));
        let bs = futures_util::future::join_all(requests).await;
        let a = finished(&h, a.id).await;
        assert_eq!(
            (a.state, a.kind.as_str()),
            (TaskState::Success, a_kind),
            "round {round}: A: {a:?}"
        );
        for (b_id, busy) in bs {
            if busy > 0 {
                raced += 1;
            }
            assert!(b_id > a.id, "round {round}");
            let b = finished(&h, b_id).await;
            // B found the group where A left it: nothing to do.
            assert_eq!(
                (b.state, b.kind.as_str()),
                (TaskState::Success, "check"),
                "round {round} (B was Busy {busy} times): B planned from a stale state: {b:?}"
            );
            assert!(b.message.contains("unchanged"), "round {round}: {b:?}");
        }
        assert_eq!(
            group_drivers(&h),
            group_on(vfio),
            "round {round}: the group is not where the configuration puts it"
        );
    }
    let errors: Vec<TaskRecord> = h
        .store()
        .tasks(None, 10_000)
        .unwrap()
        .into_iter()
        .filter(|t| t.state != TaskState::Success)
        .collect();
    assert!(errors.is_empty(), "{errors:?}");
    eprintln!(
        "stale_plan: {} rounds, {raced} requests B met A still running",
        rounds()
    );
}

/// The same without any timing: a mode job made (and admitted) while the group is still on its
/// own drivers, then prepared and run after another task has bound it, plans from what it finds
/// then: a check that writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_admitted_before_another_task_plans_from_the_state_after_it() {
    let h = Harness::start(STEADY_CONFIG).await;
    let engine = std::sync::Arc::clone(&h.server.as_ref().unwrap().engine);
    let to_vfio = || Target::Pf {
        driver: Some(VFIO_PCI.into()),
    };
    // Made before A runs: one to start through the engine later, one to drive by hand.
    let started_later = ModeJob::new(addr(GPU), Some(to_vfio()));
    let mut by_hand = ModeJob::new(addr(GPU), Some(to_vfio()));
    let cx = engine.core().job_context();
    let admission = tokio::task::block_in_place(|| by_hand.admit(&cx)).unwrap();
    assert_eq!(
        admission.kind,
        TaskKind::Bind,
        "admitted while the group is on its own drivers"
    );
    assert_eq!(admission.scope, vec![addr(GPU), addr(AUDIO)]);

    // A binds the group.
    let a = engine
        .start_task(Box::new(ModeJob::new(addr(GPU), Some(to_vfio()))), "task A")
        .await
        .unwrap();
    let a = finished(&h, a.id).await;
    assert_eq!(
        (a.state, a.kind),
        (TaskState::Success, TaskKind::Bind),
        "{a:?}"
    );
    assert_eq!(group_drivers(&h), group_on(true));
    h.kernel.take_write_log();

    // The job made before A, started now through the engine.
    let b = engine
        .start_task(Box::new(started_later), "task B")
        .await
        .unwrap();
    assert_eq!(b.kind, TaskKind::Check, "{b:?}");
    let b = finished(&h, b.id).await;
    assert_eq!(
        (b.state, b.kind),
        (TaskState::Success, TaskKind::Check),
        "{b:?}"
    );
    assert!(b.message.contains("unchanged"), "{b:?}");

    // The job admitted before A, prepared and run by hand after it.
    let (kind, outcome) = tokio::task::block_in_place(|| {
        let kind = by_hand.prepare(&cx).unwrap();
        by_hand.guard(&cx).unwrap();
        let phases: Vec<Phase> = by_hand.phases();
        let mut report = |_: &str, _: u8| {};
        let mut progress = Progress::new(&phases, &mut report);
        (kind, by_hand.run(&cx, &mut progress))
    });
    assert_eq!(kind, TaskKind::Check, "prepare must re-read the group");
    let message = outcome.unwrap();
    assert!(message.contains("unchanged"), "{message}");

    let writes = h.kernel.take_write_log();
    assert!(writes.is_empty(), "a check wrote to sysfs: {writes:?}");
    assert_eq!(group_drivers(&h), group_on(true));
}
