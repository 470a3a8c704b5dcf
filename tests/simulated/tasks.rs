//! Mode changes as tasks over D-Bus, on the simulated kernel: SetMode, progress and results,
//! Busy, ResetTask, guards, boot reconciliation, reload, restarts that write nothing.

use crate::common;

use crate::common::proxies::{device, DeviceProxy, TaskProxy};
use crate::common::{addr, eventually, eventually_async, Harness, DEMO_CONFIG, STEADY_CONFIG};
use std::time::Duration;
use vfiod::sim::kernel::{FaultAction, FaultTarget};
use zbus::OwnedObjectPath;

/// Waits for a task to end, then for the inventory pass that follows it to be published (its
/// device's object agrees with sysfs); returns (state, result, kind).
async fn finish(h: &Harness, path: &OwnedObjectPath) -> (String, String, String) {
    let t = TaskProxy::builder(&h.client)
        .path(path.clone())
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await
        .unwrap();
    let t = &t;
    let state = eventually_async(
        Duration::from_secs(120),
        &format!("task {path} ends"),
        || async move {
            let s = t.state().await.unwrap();
            (s == "success" || s == "error").then_some(s)
        },
    )
    .await;
    let a = t.address().await.unwrap();
    assert_eq!(
        vfiod::client::address_of_path(t.device().await.unwrap().as_str()).as_deref(),
        Some(a.as_str()),
        "Task.Device is the object of Task.Address"
    );
    let address = addr(&a);
    let object = device(h, &a).await;
    let object = &object;
    eventually_async(
        Duration::from_secs(60),
        &format!("{a}'s object shows the end of task {path} and the state sysfs has"),
        || async move {
            let shown = (
                object.task_state().await.unwrap(),
                object.num_vfs().await.unwrap(),
                object.driver().await.unwrap(),
            );
            let kernel = (
                h.kernel.num_vfs(address).unwrap_or(0),
                h.kernel.driver_of(address).unwrap_or_default(),
            );
            (shown.0 != "prepare" && shown.0 != "running" && (shown.1, shown.2) == kernel)
                .then_some(())
        },
    )
    .await;
    (state, t.result().await.unwrap(), t.kind().await.unwrap())
}

/// Splits the FPGA (0000:af:00.0) into `vfs` VFs and waits for the task's success.
async fn split_fpga<'a>(h: &'a Harness, vfs: u32) -> DeviceProxy<'a> {
    let fpga = device(h, "0000:af:00.0").await;
    let task = fpga
        .set_mode("vf", vfiod::client::mode_options(Some(vfs)))
        .await
        .unwrap();
    assert_eq!(finish(h, &task).await.0, "success");
    fpga
}

fn error_name(e: zbus::Error) -> (String, String) {
    match e {
        zbus::Error::MethodError(n, m, _) => (n.to_string(), m.unwrap_or_default()),
        other => panic!("not a D-Bus error reply: {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_mode_splits_and_restores_with_a_visible_task() {
    let h = Harness::start(STEADY_CONFIG).await;
    let nic = device(&h, "0000:3b:00.0").await;
    let task = nic
        .set_mode("vf", vfiod::client::mode_options(Some(8)))
        .await
        .unwrap();
    let (state, result, kind) = finish(&h, &task).await;
    assert_eq!(
        (state.as_str(), kind.as_str()),
        ("success", "split"),
        "{result}"
    );
    let raw = h
        .kernel
        .sysfs()
        .read_function(addr("0000:3b:00.0"))
        .unwrap();
    let s = raw.sriov.unwrap();
    assert_eq!((s.num_vfs, s.drivers_autoprobe), (8, false));
    for vf in &s.vfs {
        assert_eq!(h.kernel.driver_of(*vf).as_deref(), Some("vfio-pci"));
    }
    assert_eq!(nic.task_state().await.unwrap(), "idle");
    assert!(nic
        .last_result()
        .await
        .unwrap()
        .contains("split into 8 VFs"));
    assert_eq!(
        nic.num_vfs().await.unwrap(),
        8,
        "the inventory follows the task"
    );
    let stored = h.store().tasks(Some(addr("0000:3b:00.0")), 10).unwrap();
    assert_eq!(
        stored[0].requested_by.split_whitespace().next(),
        Some("uid"),
        "{:?}",
        stored[0]
    );

    let task = nic
        .set_mode("pf", vfiod::client::mode_options(None))
        .await
        .unwrap();
    let (state, result, kind) = finish(&h, &task).await;
    assert_eq!(
        (state.as_str(), kind.as_str()),
        ("success", "restore"),
        "{result}"
    );
    assert_eq!(h.kernel.num_vfs(addr("0000:3b:00.0")), Some(0));
    assert_eq!(
        h.kernel.driver_of(addr("0000:3b:00.0")).as_deref(),
        Some("i40e")
    );

    // Same mode again: a task that says "unchanged", and no write at all.
    h.kernel.take_write_log();
    let task = nic
        .set_mode("pf", vfiod::client::mode_options(None))
        .await
        .unwrap();
    let (state, result, _) = finish(&h, &task).await;
    assert_eq!(state, "success");
    assert!(result.contains("unchanged"), "{result}");
    assert!(h.kernel.take_write_log().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_one_accepted_the_rest_busy() {
    let h = Harness::start(STEADY_CONFIG).await;
    // A slow sriov_numvfs keeps the first task running while every request arrives.
    h.kernel.inject(
        FaultTarget::DeviceAttr(addr("0000:af:00.0"), "sriov_numvfs".into()),
        FaultAction::Delay(Duration::from_secs(2)),
        Some(1),
    );
    let fpga = device(&h, "0000:af:00.0").await;
    let calls = (0..6).map(|_| fpga.set_mode("vf", vfiod::client::mode_options(Some(4))));
    let results = futures_util::future::join_all(calls).await;
    let (ok, busy): (Vec<_>, Vec<_>) = results.into_iter().partition(|r| r.is_ok());
    assert_eq!(ok.len(), 1, "{ok:?} {busy:?}");
    for r in busy {
        let (name, msg) = error_name(r.unwrap_err());
        assert_eq!(name, "org.vfiod.Vfiod1.Error.Busy");
        assert!(
            msg.contains("split"),
            "Busy must name the running task: {msg}"
        );
    }
    let (state, _, _) = finish(&h, ok[0].as_ref().unwrap()).await;
    assert_eq!(state, "success");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_task_rolls_back_and_stays_in_error_until_reset() {
    let h = Harness::start(STEADY_CONFIG).await;
    let pf = addr("0000:af:00.0");
    h.kernel.inject(
        FaultTarget::AnyFor(addr("0000:af:00.3")),
        FaultAction::Errno(libc::EIO),
        Some(1),
    );
    let fpga = device(&h, "0000:af:00.0").await;
    let task = fpga
        .set_mode("vf", vfiod::client::mode_options(Some(4)))
        .await
        .unwrap();
    let (state, result, _) = finish(&h, &task).await;
    assert_eq!(state, "error");
    assert!(
        result.contains("0000:af:00.3") && result.contains("Input/output error"),
        "{result}"
    );
    assert!(
        result.contains("rollback restored the previous state"),
        "{result}"
    );
    assert_eq!(h.kernel.num_vfs(pf), Some(0), "not rolled back");
    assert_eq!(fpga.task_state().await.unwrap(), "error");

    let (name, msg) = error_name(
        fpga.set_mode("vf", vfiod::client::mode_options(Some(4)))
            .await
            .unwrap_err(),
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.Busy");
    assert!(msg.contains("error"), "{msg}");

    fpga.reset_task().await.unwrap();
    assert_eq!(fpga.task_state().await.unwrap(), "idle");
    let events = h.store().events(Some(pf), 0, 1000).unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.kind == "task" && e.message.contains("reset")),
        "{events:?}"
    );
    let (name, _) = error_name(fpga.reset_task().await.unwrap_err());
    assert_eq!(
        name, "org.vfiod.Vfiod1.Error.InvalidArgument",
        "reset of an idle device"
    );

    let task = fpga
        .set_mode("vf", vfiod::client::mode_options(Some(4)))
        .await
        .unwrap();
    assert_eq!(finish(&h, &task).await.0, "success");
    assert_eq!(h.kernel.num_vfs(pf), Some(4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guards_refuse_with_named_errors_and_change_nothing() {
    let h = Harness::start(STEADY_CONFIG).await;
    h.kernel.take_write_log();
    let boot = device(&h, "0000:3d:00.0").await;
    let (name, msg) = error_name(
        boot.set_mode("pf", vfiod::client::mode_options(None))
            .await
            .unwrap_err(),
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.Protected");
    assert!(msg.contains("mounted at /"), "{msg}");
    let host_nic = device(&h, "0000:02:00.0").await;
    assert_eq!(
        error_name(
            host_nic
                .set_mode("pf", vfiod::client::mode_options(None))
                .await
                .unwrap_err()
        )
        .0,
        "org.vfiod.Vfiod1.Error.Protected"
    );
    let bridge = device(&h, "0000:00:01.0").await;
    let (name, msg) = error_name(
        bridge
            .set_mode("pf", vfiod::client::mode_options(None))
            .await
            .unwrap_err(),
    );
    // Not selected is not the same as used by the host: its own error, which says how to select.
    assert_eq!(name, "org.vfiod.Vfiod1.Error.NotManaged");
    assert!(
        msg.contains("not selected") && msg.contains("[[select]]"),
        "{msg}"
    );
    let nvme = device(&h, "0000:d8:00.0").await;
    let (name, msg) = error_name(
        nvme.set_mode("vf", vfiod::client::mode_options(Some(2)))
            .await
            .unwrap_err(),
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InvalidArgument");
    assert!(msg.contains("non-separable"), "{msg}");
    let nic = device(&h, "0000:3b:00.0").await;
    assert_eq!(
        error_name(
            nic.set_mode("vf", vfiod::client::mode_options(Some(65)))
                .await
                .unwrap_err()
        )
        .0,
        "org.vfiod.Vfiod1.Error.InvalidArgument"
    );
    assert_eq!(
        error_name(
            nic.set_mode("split", vfiod::client::mode_options(None))
                .await
                .unwrap_err()
        )
        .0,
        "org.vfiod.Vfiod1.Error.InvalidArgument"
    );
    let vf = device(&h, "0000:5e:00.1").await;
    assert_eq!(
        error_name(
            vf.set_mode("pf", vfiod::client::mode_options(None))
                .await
                .unwrap_err()
        )
        .0,
        "org.vfiod.Vfiod1.Error.InvalidArgument"
    );
    assert!(
        h.kernel.take_write_log().is_empty(),
        "a refused request wrote to sysfs"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_a_vm_holds_open_is_never_taken_down() {
    let h = Harness::start(STEADY_CONFIG).await;
    let fpga = split_fpga(&h, 2).await;
    // A "QEMU" process holding the first VF's group open, as /proc shows it.
    let vf = addr("0000:af:00.1");
    let group = h
        .kernel
        .sysfs()
        .read_function(vf)
        .unwrap()
        .iommu_group
        .unwrap();
    let proc_dir = h.kernel.root().join("proc/4242");
    std::fs::create_dir_all(proc_dir.join("fd")).unwrap();
    std::fs::write(proc_dir.join("comm"), "qemu-system-x86\n").unwrap();
    std::os::unix::fs::symlink(format!("/dev/vfio/{group}"), proc_dir.join("fd/17")).unwrap();
    h.kernel.take_write_log();

    let (name, msg) = error_name(
        fpga.set_mode("pf", vfiod::client::mode_options(None))
            .await
            .unwrap_err(),
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InUse");
    assert!(msg.contains("pid 4242 (qemu-system-x86)"), "{msg}");
    assert_eq!(
        fpga.task_state().await.unwrap(),
        "idle",
        "a refusal is not a failed task"
    );
    assert_eq!(h.kernel.num_vfs(addr("0000:af:00.0")), Some(2));
    assert!(
        h.kernel.take_write_log().is_empty(),
        "the guard must act before any write"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_device_is_not_converted() {
    let h = Harness::start(STEADY_CONFIG).await;
    let fpga = split_fpga(&h, 2).await;
    // Claimed as a client would (the claims feature replaced a hand-written row here).
    let one = |k: &str, v: &str| {
        std::collections::HashMap::from([(
            k.to_string(),
            zbus::OwnedVariant::try_from(zbus::Variant::from(v.to_string())).unwrap(),
        )])
    };
    vfiod::client::claim::claims_proxy(&h.client)
        .await
        .unwrap()
        .claim(one("address", "0000:af:00.2"), one("vm_name", "web-7"))
        .await
        .unwrap();
    h.kernel.take_write_log();
    let (name, msg) = error_name(
        fpga.set_mode("pf", vfiod::client::mode_options(None))
            .await
            .unwrap_err(),
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InUse");
    assert!(msg.contains("0000:af:00.2 is claimed by VM web-7"), "{msg}");
    assert!(h.kernel.take_write_log().is_empty());
    assert_eq!(h.kernel.num_vfs(addr("0000:af:00.0")), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boot_reconciles_and_a_restart_writes_nothing() {
    let mut h = Harness::start(DEMO_CONFIG).await;
    // Public scenario: the NIC (64 VFs), the FPGA (4) and the QAT (16, rebound) are split
    // onto vfio-pci before the name is taken.
    for (pf, n) in [
        ("0000:3b:00.0", 64u32),
        ("0000:af:00.0", 4),
        ("0000:5e:00.0", 16),
    ] {
        let raw = h.kernel.sysfs().read_function(addr(pf)).unwrap();
        let s = raw.sriov.unwrap();
        assert_eq!(s.num_vfs, n, "{pf}");
        assert!(
            s.vfs
                .iter()
                .all(|v| h.kernel.driver_of(*v).as_deref() == Some("vfio-pci")),
            "{pf}"
        );
    }
    let tasks = h.store().tasks(None, 100).unwrap();
    assert_eq!(tasks.len(), 3, "{tasks:?}");
    assert!(tasks
        .iter()
        .all(|t| t.state.as_str() == "success" && t.requested_by == "vfiod start-up"));
    let nic = vfiod::client::show_device(&h.client, "0000:3b:00.0")
        .await
        .unwrap();
    assert_eq!((nic.mode.as_str(), nic.num_vfs), ("vf", 64));

    // A claim on a VF (the claims feature comes later; its row already counts).
    {
        let db = rusqlite::Connection::open(h.store().path()).unwrap();
        db.execute(
            "INSERT INTO claims (address, vm_name, state, created_ms, updated_ms) VALUES ('0000:3b:02.0', 'vm1', 'attached', 0, 0)",
            [],
        )
        .unwrap();
    }
    h.kernel.take_write_log();
    h.stop_server().await;
    h.start_server().await;
    assert!(
        h.kernel.take_write_log().is_empty(),
        "a restart must not touch correct devices"
    );
    assert_eq!(
        h.store().tasks(None, 100).unwrap().len(),
        3,
        "no new task at restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_to_private_restores_pf_mode() {
    let h = Harness::start(&DEMO_CONFIG.replace(
        "poll_interval = 10",
        "poll_interval = 10\n[[protect]]\nid = \"8086:37c8\"",
    ))
    .await;
    assert_eq!(h.kernel.num_vfs(addr("0000:af:00.0")), Some(4));
    std::fs::write(
        &h.config_path,
        DEMO_CONFIG.replace("scenario = \"public\"", "scenario = \"private\""),
    )
    .unwrap();
    h.manager().await.reload().await.unwrap();
    eventually(Duration::from_secs(120), "reload restores PF mode", || {
        (h.kernel.num_vfs(addr("0000:3b:00.0")) == Some(0)
            && h.kernel.num_vfs(addr("0000:af:00.0")) == Some(0))
        .then_some(())
    })
    .await;
    assert_eq!(
        h.kernel.driver_of(addr("0000:3b:00.0")).as_deref(),
        Some("i40e")
    );
    assert_eq!(
        h.kernel.driver_of(addr("0000:af:00.0")).as_deref(),
        Some("dfl-pci")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_task_is_reported_and_needs_a_reset() {
    let mut h = Harness::start(STEADY_CONFIG).await;
    let pf = addr("0000:af:00.0");
    // As if vfiod died mid-split: a running task in the store.
    let t = h
        .store()
        .create_task(pf, vfiod::model::task::TaskKind::Split, "{}", "test")
        .unwrap();
    h.store()
        .task_progress(t.id, "echo '4' > sriov_numvfs", 20)
        .unwrap();
    h.stop_server().await;
    h.start_server().await;
    let t = h.store().task(t.id).unwrap().unwrap();
    assert_eq!(t.state.as_str(), "error");
    assert!(t.message.contains("interrupted"), "{}", t.message);
    let fpga = device(&h, "0000:af:00.0").await;
    assert_eq!(fpga.task_state().await.unwrap(), "error");
    assert_eq!(
        error_name(fpga.apply().await.unwrap_err()).0,
        "org.vfiod.Vfiod1.Error.Busy"
    );
    fpga.reset_task().await.unwrap();
    assert_eq!(
        finish(
            &h,
            &fpga
                .set_mode("vf", vfiod::client::mode_options(Some(4)))
                .await
                .unwrap()
        )
        .await
        .0,
        "success"
    );
}

fn assert_gpu_group_on_vfio(h: &Harness) {
    for a in ["0000:17:00.0", "0000:17:00.1"] {
        assert_eq!(
            h.kernel.driver_of(addr(a)).as_deref(),
            Some("vfio-pci"),
            "{a}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_device_passthrough_binds_the_group_and_gives_it_back() {
    let with_vfio = "scenario = \"private\"\npoll_interval = 3600\n[[select]]\nclass = \"0x03\"\npf_driver = \"vfio-pci\"\n[[select]]\nid = \"10de:1aef\"\npf_driver = \"vfio-pci\"\n";
    let h = Harness::start(with_vfio).await;
    // Boot: the GPU and its audio function move to vfio-pci together, in one task.
    assert_gpu_group_on_vfio(&h);
    let tasks = h.store().tasks(None, 10).unwrap();
    assert_eq!(tasks.len(), 1, "one task for the group: {tasks:?}");
    assert_eq!(tasks[0].kind, "bind");
    // The configuration no longer asks for vfio-pci: reload returns both to their own drivers.
    std::fs::write(
        &h.config_path,
        with_vfio.replace("pf_driver = \"vfio-pci\"\n", ""),
    )
    .unwrap();
    h.manager().await.reload().await.unwrap();
    // The drivers come back before the task records its end: wait for both.
    eventually(Duration::from_secs(60), "group given back", || {
        (h.kernel.driver_of(addr("0000:17:00.0")).as_deref() == Some("nouveau")
            && h.kernel.driver_of(addr("0000:17:00.1")).as_deref() == Some("snd_hda_intel")
            && h.store()
                .active_task(addr("0000:17:00.0"))
                .unwrap()
                .is_none())
        .then_some(())
    })
    .await;
    let t = h.store().tasks(None, 10).unwrap();
    assert_eq!(
        (t[0].kind.as_str(), t[0].state.as_str()),
        ("unbind", "success"),
        "{t:?}"
    );
    let raw = h
        .kernel
        .sysfs()
        .read_function(addr("0000:17:00.1"))
        .unwrap();
    assert_eq!(
        raw.driver_override, None,
        "the override vfiod set is cleared"
    );
}

/// One task at a time per IOMMU group: while the GPU's group moves to vfio-pci (started by a
/// reload), a request on its audio function is refused with Busy naming the GPU's task, and a
/// request on the GPU too; both end on vfio-pci through the one task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_on_one_function_makes_its_group_mates_busy() {
    let h = Harness::start(STEADY_CONFIG).await;
    assert_eq!(h.store().tasks(None, 10).unwrap().len(), 0);
    // A slow unbind of the GPU keeps the group's task running while the requests arrive.
    h.kernel.inject(
        FaultTarget::DriverAttr(Some("nouveau".into()), "unbind".into()),
        FaultAction::Delay(Duration::from_secs(2)),
        Some(1),
    );
    let with_vfio = STEADY_CONFIG
        .replace(
            "class = \"0x03\"\n",
            "class = \"0x03\"\npf_driver = \"vfio-pci\"\n",
        )
        .replace(
            "id = \"10de:1aef\"\n",
            "id = \"10de:1aef\"\npf_driver = \"vfio-pci\"\n",
        );
    assert_ne!(with_vfio, STEADY_CONFIG);
    std::fs::write(&h.config_path, &with_vfio).unwrap();
    h.manager().await.reload().await.unwrap();
    let bind = h
        .store()
        .active_task(addr("0000:17:00.0"))
        .unwrap()
        .expect("the reload started the group's task");
    assert_eq!(bind.kind, "bind");

    let audio = device(&h, "0000:17:00.1").await;
    let gpu = device(&h, "0000:17:00.0").await;
    // The audio function shows the group's task as its current one (published right after the
    // task is recorded).
    let audio_ref = &audio;
    eventually_async(
        Duration::from_secs(2),
        "audio shows a task",
        || async move { (audio_ref.task_state().await.unwrap() != "idle").then_some(()) },
    )
    .await;
    assert_eq!(
        audio.current_task().await.unwrap().as_str(),
        format!("/org/vfiod/Vfiod1/task/{}", bind.id)
    );
    let (a, g, apply) = tokio::join!(
        audio.set_mode("pf", vfiod::client::mode_options(None)),
        gpu.set_mode("pf", vfiod::client::mode_options(None)),
        audio.apply()
    );
    for r in [a, apply] {
        let (name, msg) = error_name(r.unwrap_err());
        assert_eq!(name, "org.vfiod.Vfiod1.Error.Busy");
        assert!(
            msg.contains(&format!("task {} bind on 0000:17:00.0", bind.id)),
            "Busy must name the group's task: {msg}"
        );
    }
    assert_eq!(error_name(g.unwrap_err()).0, "org.vfiod.Vfiod1.Error.Busy");

    eventually(Duration::from_secs(60), "the bind ends", || {
        h.store()
            .active_task(addr("0000:17:00.0"))
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    assert_gpu_group_on_vfio(&h);
    let tasks = h.store().tasks(None, 10).unwrap();
    assert_eq!(tasks.len(), 1, "refused requests create no task: {tasks:?}");
    assert_eq!(tasks[0].state.as_str(), "success", "{tasks:?}");
    // Published when the task ended: the audio function is idle again.
    eventually_async(Duration::from_secs(10), "audio idle again", || async move {
        (audio_ref.task_state().await.unwrap() == "idle").then_some(())
    })
    .await;
    assert_eq!(audio.current_task().await.unwrap().as_str(), "/");
}

/// A libvirt test-driver host: one running domain, `web1`, with the NIC's first VF assigned.
fn libvirt_host(dir: &std::path::Path) -> String {
    let path = dir.join("libvirt-node.xml");
    let web1 = common::libvirtd::test_domain_xml("web1", "0000:3b:02.0");
    std::fs::write(&path, format!("<node>{web1}</node>")).unwrap();
    format!("test://{}", path.display())
}

/// A VF assigned to a running libvirt domain is never taken away: the restore is refused with
/// InUse naming the domain (as libvirt itself reports it) and writes nothing; when libvirt cannot
/// be asked, the restore is refused too; with the check switched off it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vf_a_running_domain_uses_is_not_taken_away() {
    let dir = tempfile::tempdir().unwrap();
    let uri = libvirt_host(dir.path());
    let config = |uri: &str| {
        format!(
            "scenario = \"private\"\nlibvirt_uri = \"{uri}\"\n[[select]]\nid = \"8086:1572\"\nmode = \"vf\"\nnum_vfs = 4\n"
        )
    };
    let h = Harness::start(&config(&uri)).await;
    // Boot split the NIC (no VF existed, so no domain could use one).
    assert_eq!(h.kernel.num_vfs(addr("0000:3b:00.0")), Some(4));
    h.kernel.take_write_log();

    let nic = device(&h, "0000:3b:00.0").await;
    let (name, msg) = error_name(
        nic.set_mode("pf", vfiod::client::mode_options(None))
            .await
            .unwrap_err(),
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InUse", "{msg}");
    assert!(
        msg.contains("0000:3b:02.0 is assigned to running domain web1"),
        "{msg}"
    );
    let (name, _) = error_name(
        nic.set_mode("vf", vfiod::client::mode_options(Some(2)))
            .await
            .unwrap_err(),
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InUse");
    assert!(
        h.kernel.take_write_log().is_empty(),
        "nothing may be written"
    );
    assert_eq!(h.kernel.num_vfs(addr("0000:3b:00.0")), Some(4));

    // libvirt cannot be asked: refused, named, nothing written.
    let missing = format!("test://{}", dir.path().join("missing.xml").display());
    std::fs::write(&h.config_path, config(&missing)).unwrap();
    h.manager().await.reload().await.unwrap();
    let (name, msg) = error_name(
        nic.set_mode("pf", vfiod::client::mode_options(None))
            .await
            .unwrap_err(),
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.Failed", "{msg}");
    assert!(
        msg.contains("cannot check which running domains use it") && msg.contains("missing.xml"),
        "{msg}"
    );
    assert!(
        h.kernel.take_write_log().is_empty(),
        "nothing may be written"
    );

    // The check is off: the restore runs.
    std::fs::write(
        &h.config_path,
        config("").replace("mode = \"vf\"\nnum_vfs = 4\n", ""),
    )
    .unwrap();
    h.manager().await.reload().await.unwrap();
    eventually(Duration::from_secs(60), "restored", || {
        (h.kernel.num_vfs(addr("0000:3b:00.0")) == Some(0)).then_some(())
    })
    .await;
}

/// A PF's task covers its VFs: while the FPGA is restored, each VF's object shows that task as
/// its current one, and idle again once it has ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vf_shows_its_pf_task() {
    let h = Harness::start(STEADY_CONFIG).await;
    let fpga = split_fpga(&h, 4).await;
    // A slow unbind of a VF keeps the restore running while we look.
    h.kernel.inject(
        FaultTarget::DriverAttr(Some("vfio-pci".into()), "unbind".into()),
        FaultAction::Delay(Duration::from_millis(1500)),
        Some(1),
    );
    let vf = device(&h, "0000:af:00.1").await;
    assert_eq!(vf.task_state().await.unwrap(), "idle");
    let restore = fpga
        .set_mode("pf", vfiod::client::mode_options(None))
        .await
        .unwrap();
    let (vf_ref, restore_ref) = (&vf, &restore);
    eventually_async(
        Duration::from_secs(2),
        "the VF shows its PF's task",
        || async move { (vf_ref.current_task().await.unwrap() == *restore_ref).then_some(()) },
    )
    .await;
    assert_ne!(vf.task_state().await.unwrap(), "idle");
    let (name, msg) = error_name(
        vf.set_mode("pf", vfiod::client::mode_options(None))
            .await
            .unwrap_err(),
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InvalidArgument", "{msg}");
    assert_eq!(finish(&h, &restore).await.0, "success");
}

/// A driver typo in the configuration (`vf_driver = "vfio-pcii"`): the reload's task is refused
/// before any write, the device is not held (its TaskState stays idle, the task is `error` reset
/// by vfiod), and once the configuration is fixed the next reload converts it without any
/// operator reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_typo_leaves_no_device_blocked() {
    let config = |driver: &str| {
        format!(
            "scenario = \"private\"\n[[select]]\nclass = \"0x12\"\nkind = \"fpga\"\nmode = \"vf\"\nnum_vfs = 2\nvf_driver = \"{driver}\"\n"
        )
    };
    let h = Harness::start(&config("vfio-pcii")).await;
    let pf = addr("0000:af:00.0");
    let store = h.store();
    let refused = eventually(
        Duration::from_secs(30),
        "the start-up task is refused",
        || {
            store
                .tasks(Some(pf), 10)
                .unwrap()
                .into_iter()
                .find(|t| t.state.is_final())
        },
    )
    .await;
    assert_eq!(refused.state.as_str(), "error", "{refused:?}");
    assert!(
        refused.message.contains("vfio-pcii") && refused.message.contains("nothing was changed"),
        "{}",
        refused.message
    );
    assert_eq!(refused.reset_by.as_deref(), Some(vfiod::store::REFUSED_BY));
    assert_eq!(h.kernel.num_vfs(pf), Some(0), "nothing was written");
    let fpga = device(&h, "0000:af:00.0").await;
    assert_eq!(fpga.task_state().await.unwrap(), "idle", "not held");

    h.kernel.take_write_log();
    std::fs::write(&h.config_path, config("vfio-pci")).unwrap();
    h.manager().await.reload().await.unwrap();
    eventually(Duration::from_secs(60), "split after the fix", || {
        (h.kernel.num_vfs(pf) == Some(2)).then_some(())
    })
    .await;
    let last = eventually(Duration::from_secs(30), "the split task ends", || {
        store
            .tasks(Some(pf), 1)
            .unwrap()
            .into_iter()
            .find(|t| t.state.is_final())
    })
    .await;
    assert_eq!(
        (last.kind.as_str(), last.state.as_str()),
        ("split", "success"),
        "{last:?}"
    );
}
