//! The D-Bus API against a real private dbus-daemon, with vfiod running on the simulated
//! kernel: objects, signals on hot-plug and breakage, named errors, reload safety, vfioctl.

use crate::common;

use crate::common::{
    addr, eventually, eventually_async, prop_str, wait_for, Harness, Props, STEADY_CONFIG,
};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;
use vfiod::client::DeviceView;
use vfiod::model::device::{Device, State};
use vfiod::sim::kernel::{FaultAction, FaultTarget};
use zbus::{OwnedObjectPath, OwnedVariant};

const OM_RULE: &str = "type='signal',interface='org.freedesktop.DBus.ObjectManager'";

fn device_path(a: &str) -> String {
    format!("/org/vfiod/Vfiod1/device/{}", addr(a).nodedev_name())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_object_per_function_with_sysfs_values() {
    let h = Harness::start(STEADY_CONFIG).await;
    let devices = vfiod::client::list_devices(&h.client).await.unwrap();
    let kernel_addrs: Vec<String> = h.kernel.addresses().iter().map(|a| a.to_string()).collect();
    let listed: Vec<String> = devices.iter().map(|d| d.address.clone()).collect();
    assert_eq!(listed, kernel_addrs);

    let nic = devices
        .iter()
        .find(|d| d.address == "0000:3b:00.0")
        .unwrap();
    assert_eq!(
        (nic.vendor_id.as_str(), nic.device_id.as_str()),
        ("8086", "1572")
    );
    assert_eq!(nic.class, "0x020000");
    assert_eq!(nic.kind, "nic");
    assert_eq!(nic.driver.as_deref(), Some("i40e"));
    assert_eq!(
        (nic.role.as_str(), nic.separable, nic.total_vfs, nic.num_vfs),
        ("pf", true, 64, 0)
    );
    assert!(nic.managed);
    let qat_vf = devices
        .iter()
        .find(|d| d.address == "0000:5e:00.1")
        .unwrap();
    assert_eq!(qat_vf.parent_pf.as_deref(), Some("0000:5e:00.0"));
    assert_eq!((qat_vf.role.as_str(), qat_vf.mode.as_str()), ("vf", "none"));

    let m = h.manager().await;
    assert_eq!(m.device_count().await.unwrap() as usize, kernel_addrs.len());
    assert_eq!(m.protected_count().await.unwrap(), 2);
    assert_eq!(m.scenario().await.unwrap(), "private");
    assert!(m.simulated().await.unwrap());
    assert_eq!(
        m.get_device("3b:00.0").await.unwrap().as_str(),
        device_path("0000:3b:00.0")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_errors_for_bad_arguments() {
    let h = Harness::start(STEADY_CONFIG).await;
    let m = h.manager().await;
    let name = |e: zbus::Error| match e {
        zbus::Error::MethodError(n, msg, _) => (n.to_string(), msg.unwrap_or_default()),
        other => panic!("not a method error: {other}"),
    };
    let (n, msg) = name(m.get_device("0000:99:00.0").await.unwrap_err());
    assert_eq!(n, "org.vfiod.Vfiod1.Error.NoSuchDevice");
    assert!(msg.contains("0000:99:00.0"), "{msg}");
    let (n, msg) = name(m.get_device("not-an-address").await.unwrap_err());
    assert_eq!(n, "org.vfiod.Vfiod1.Error.InvalidArgument");
    assert!(msg.contains("not-an-address"), "{msg}");
    let (n, _) = name(
        m.get_events(vfiod::client::query(vec![("limit", Some(0u32.into()))]))
            .await
            .unwrap_err(),
    );
    assert_eq!(n, "org.vfiod.Vfiod1.Error.InvalidArgument");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_and_rescan_update_store_and_signal() {
    let h = Harness::start(STEADY_CONFIG).await;
    let mut om = h.signals(OM_RULE).await;
    let nvme = addr("0000:d8:00.0");
    let sysfs = h.kernel.sysfs();

    // The uevent alone must drive the update: polling is at 10 s and we wait at most 5.
    sysfs.write_device_attr(nvme, "remove", "1").unwrap();
    let path = device_path("0000:d8:00.0");
    wait_for(&mut om, 5, |msg| {
        let hdr = msg.header();
        if hdr.member()?.as_str() != "InterfacesRemoved" {
            return None;
        }
        let (p, ifaces): (OwnedObjectPath, Vec<String>) = msg.body().deserialize().ok()?;
        (p.as_str() == path && ifaces.iter().any(|i| i == "org.vfiod.Vfiod1.Device")).then_some(())
    })
    .await;
    let store = h.store();
    assert!(
        store.device(nvme).unwrap().is_none(),
        "store still has the removed device"
    );
    let events = store.events(Some(nvme), 0, 100).unwrap();
    assert!(events.iter().any(|e| e.kind == "removed"), "{events:?}");

    sysfs
        .write(&sysfs.pci_bus_dir().join("rescan"), "1")
        .unwrap();
    let props = wait_for(&mut om, 5, |msg| {
        if msg.header().member()?.as_str() != "InterfacesAdded" {
            return None;
        }
        let (p, ifaces): (OwnedObjectPath, HashMap<String, Props>) =
            msg.body().deserialize().ok()?;
        if p.as_str() != path {
            return None;
        }
        ifaces.get("org.vfiod.Vfiod1.Device").cloned()
    })
    .await;
    assert_eq!(prop_str(&props, "Driver").as_deref(), Some("nvme"));
    assert_eq!(prop_str(&props, "State").as_deref(), Some("usable"));
    let back = store
        .device(nvme)
        .unwrap()
        .expect("device back in the store");
    assert_eq!(back.driver.as_deref(), Some("nvme"));
    assert!(store
        .events(Some(nvme), 0, 100)
        .unwrap()
        .iter()
        .any(|e| e.kind == "added"));
}

async fn expect_state_change(h: &Harness, path: &str, want: &str) -> Props {
    let rule = format!(
        "type='signal',interface='org.freedesktop.DBus.Properties',member='PropertiesChanged',path='{path}'"
    );
    let mut s = h.signals(&rule).await;
    // An explicit rescan, as an operator would ask for.
    h.manager().await.rescan().await.unwrap();
    wait_for(&mut s, 5, |msg| {
        let (iface, changed, _inv): (String, Props, Vec<String>) = msg.body().deserialize().ok()?;
        (iface == "org.vfiod.Vfiod1.Device" && prop_str(&changed, "State").as_deref() == Some(want))
            .then_some(changed)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_attributes_make_a_device_broken_and_back() {
    let h = Harness::start(STEADY_CONFIG).await;
    let fpga = addr("0000:af:00.0");
    let path = device_path("0000:af:00.0");
    h.kernel.make_unreadable(fpga, "uevent", libc::EIO);
    let changed = expect_state_change(&h, &path, "broken").await;
    let reason = prop_str(&changed, "StateReason").unwrap_or_default();
    assert!(
        reason.contains("uevent") && reason.contains("Input/output error"),
        "{reason}"
    );
    let store = h.store();
    let d = store.device(fpga).unwrap().unwrap();
    assert_eq!(d.state, State::Broken);
    // What was known before is kept, so the operator sees which card broke.
    assert_eq!((d.vendor_id, d.device_id), (0x8086, 0x0b2b));
    let m = h.manager().await;
    assert_eq!(m.broken_count().await.unwrap(), 1);
    assert!(store
        .events(Some(fpga), 0, 100)
        .unwrap()
        .iter()
        .any(|e| e.kind == "broken"));

    h.kernel.make_readable(fpga, "uevent");
    expect_state_change(&h, &path, "usable").await;
    assert!(store
        .events(Some(fpga), 0, 100)
        .unwrap()
        .iter()
        .any(|e| e.kind == "recovered"));
    assert_eq!(m.broken_count().await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_space_all_ones_is_broken() {
    let h = Harness::start(STEADY_CONFIG).await;
    let gpu = addr("0000:17:00.0");
    h.kernel.set_config_all_ones(gpu, true).unwrap();
    let changed = expect_state_change(&h, &device_path("0000:17:00.0"), "broken").await;
    assert!(prop_str(&changed, "StateReason")
        .unwrap()
        .contains("all-ones"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aer_recovery_events_are_recorded() {
    let h = Harness::start(STEADY_CONFIG).await;
    let nic = addr("0000:3b:00.0");
    h.kernel.aer_error(nic, false, true).unwrap();
    let store = h.store();
    let ev = eventually(Duration::from_secs(5), "AER recovery recorded", || {
        let ev = store.events(Some(nic), 0, 100).unwrap();
        ev.iter()
            .any(|e| e.kind == "aer" && e.message.contains("SUCCESSFUL_RECOVERY"))
            .then_some(ev)
    })
    .await;
    assert!(
        ev.iter()
            .any(|e| e.kind == "aer" && e.message.contains("BEGIN_RECOVERY")),
        "{ev:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_reload_keeps_the_running_settings() {
    let h = Harness::start("scenario = \"private\"\npoll_interval = 3600\n").await;
    let m = h.manager().await;
    assert_eq!(m.scenario().await.unwrap(), "private");
    let before = vfiod::client::list_devices(&h.client).await.unwrap();

    std::fs::write(
        &h.config_path,
        "scenario = \"public\"\n[[select]]\nid = \"zzzz:0010\"\n",
    )
    .unwrap();
    let err = m.reload().await.unwrap_err();
    let zbus::Error::MethodError(name, Some(msg), _) = err else {
        panic!("{err}")
    };
    assert_eq!(name.as_str(), "org.vfiod.Vfiod1.Error.InvalidConfig");
    assert!(
        msg.contains("vfiod.toml:3:"),
        "error must name file and line: {msg}"
    );
    assert_eq!(
        m.scenario().await.unwrap(),
        "private",
        "bad reload changed the scenario"
    );
    assert_eq!(
        vfiod::client::list_devices(&h.client).await.unwrap(),
        before
    );
    let events = h.store().events(None, 0, 100).unwrap();
    assert!(events
        .iter()
        .any(|e| e.kind == "config" && e.message.contains("rejected")));

    // A good file takes effect: selection changes and the scenario property follows.
    std::fs::write(
        &h.config_path,
        "scenario = \"public\"\n[[select]]\nid = \"144d:a824\"\n",
    )
    .unwrap();
    m.reload().await.unwrap();
    assert_eq!(m.scenario().await.unwrap(), "public");
    let nvme = h.store().device(addr("0000:d8:00.0")).unwrap().unwrap();
    assert!(nvme.managed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_finds_the_same_state_and_writes_nothing() {
    let mut h = Harness::start(STEADY_CONFIG).await;
    let before = h.store().devices().unwrap();
    let events_before = h.store().events(None, 0, 10_000).unwrap().len();
    h.stop_server().await;
    h.start_server().await;
    assert_eq!(h.store().devices().unwrap(), before);
    assert_eq!(
        h.store().events(None, 0, 10_000).unwrap().len(),
        events_before,
        "a restart on an unchanged host must not invent changes"
    );
    assert!(
        h.kernel.take_write_log().is_empty(),
        "the inventory must never write to sysfs"
    );
    // And the name is served again.
    assert_eq!(
        vfiod::client::list_devices(&h.client).await.unwrap().len(),
        before.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_daemon_cannot_take_the_name() {
    let h = Harness::start(STEADY_CONFIG).await;
    let state = tempfile::tempdir().unwrap();
    let mut settings = h.source().load().unwrap();
    settings.state_dir = state.path().to_path_buf();
    let r = vfiod::server::Server::start(vfiod::server::Options {
        settings,
        source: None,
        sysfs: h.kernel.sysfs(),
        events: None,
        bus: h.bus_target(),
        authorizer: vfiod::dbus::auth::Authorizer::SameUser,
        simulated: true,
    })
    .await;
    let err = r.err().expect("second daemon must fail");
    assert!(
        vfiod::error_chain(&err).contains("cannot own the bus name"),
        "{}",
        vfiod::error_chain(&err)
    );
}

/// What the store says of a device that its D-Bus object says too, in one comparable shape.
type Shown = (
    String,
    Option<String>,
    Option<String>,
    String,
    u32,
    Option<String>,
    String,
);

fn shown_by_store(d: &Device) -> Shown {
    (
        d.address.to_string(),
        d.driver.clone(),
        d.driver_override.clone(),
        d.mode.as_str().to_string(),
        d.num_vfs,
        d.parent_pf.map(|p| p.to_string()),
        d.state.as_str().to_string(),
    )
}

fn shown_by_object(v: &DeviceView) -> Shown {
    (
        v.address.clone(),
        v.driver.clone(),
        v.driver_override.clone(),
        v.mode.clone(),
        v.num_vfs,
        v.parent_pf.clone(),
        v.state.clone(),
    )
}

/// A write fault fires only where a task writes: `drivers_probe` failing with EIO fails the
/// FPGA's split at the probe of its first VF (whose VFs the inventory has seen appear), the
/// rollback returns the FPGA to PF mode, the store and the D-Bus objects agree with sysfs again
/// (the VFs are gone from both), and a rescan with the fault still armed changes nothing (an
/// inventory pass only reads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_drivers_probe_fails_the_split_and_the_inventory_follows_the_rollback() {
    let h = Harness::start(STEADY_CONFIG).await;
    let fpga = addr("0000:af:00.0");
    let store = h.store();
    let before = store.devices().unwrap();
    h.kernel.inject(
        FaultTarget::BusAttr("drivers_probe".into()),
        FaultAction::Errno(libc::EIO),
        None,
    );
    // A slow first VF (the write before the failing probe) holds the split while its VFs exist,
    // so that the inventory records them and must drop them again after the rollback. Long
    // enough for a pass on a loaded machine (5 s was not, once, with three test binaries
    // running); far below vfiod's 30 s write timeout.
    let vf_bind_delay = Duration::from_secs(12);
    h.kernel.inject(
        FaultTarget::DeviceAttr(addr("0000:af:00.1"), "driver_override".into()),
        FaultAction::Delay(vf_bind_delay),
        Some(1),
    );
    h.kernel.take_write_log();

    let device = vfiod::client::device(&h.client, "0000:af:00.0")
        .await
        .unwrap();
    let task = vfiod::client::task(
        &h.client,
        device
            .set_mode("vf", vfiod::client::mode_options(Some(4)))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    let task = &task;
    let client = &h.client;
    eventually_async(
        vf_bind_delay,
        "the new VFs' objects appear while the split runs",
        || async move {
            let listed = vfiod::client::list_devices(client).await.unwrap();
            let vfs = listed
                .iter()
                .filter(|v| v.parent_pf.as_deref() == Some("0000:af:00.0"))
                .count();
            (vfs == 4).then_some(())
        },
    )
    .await;
    let state = eventually_async(Duration::from_secs(120), "the split ends", || async move {
        let s = task.state().await.unwrap();
        (s == "success" || s == "error").then_some(s)
    })
    .await;
    let result = task.result().await.unwrap();
    assert_eq!(state, "error", "{result}");
    assert!(
        result.contains("echo '0000:af:00.1' > /sys/bus/pci/drivers_probe")
            && result.contains("Input/output error"),
        "the task must fail at the probe of the first VF with the errno: {result}"
    );
    assert!(
        result.contains("rollback restored the previous state"),
        "{result}"
    );
    let writes = h.kernel.take_write_log();
    assert!(
        writes
            .iter()
            .any(|(p, v)| p.ends_with("0000:af:00.1/driver_override") && v == "vfio-pci"),
        "the split reached the first VF's bind: {writes:?}"
    );
    assert!(
        !writes.iter().any(|(p, _)| p.ends_with("drivers_probe")),
        "a failed write is not accepted: {writes:?}"
    );
    // sysfs is back where it was: PF mode, host driver, autoprobe on.
    assert_eq!(h.kernel.num_vfs(fpga), Some(0), "not rolled back");
    assert_eq!(h.kernel.driver_of(fpga).as_deref(), Some("dfl-pci"));
    let raw = h.kernel.sysfs().read_function(fpga).unwrap();
    assert!(
        raw.sriov.unwrap().drivers_autoprobe,
        "autoprobe not restored"
    );

    // The inventory follows the rollback: the store is what a scan of sysfs finds, and each
    // D-Bus object says what the store says.
    let settings = h.server.as_ref().unwrap().engine.settings();
    let sysfs = h.kernel.sysfs();
    let (store, settings, sysfs) = (&store, &settings, &sysfs);
    let stored = eventually_async(
        Duration::from_secs(60),
        "the store and the D-Bus objects agree with sysfs after the rollback",
        || async move {
            let stored = store.devices().unwrap();
            let previous: BTreeMap<_, _> = stored.iter().map(|d| (d.address, d.clone())).collect();
            let scanned = vfiod::inventory::scan(sysfs, settings, &previous).unwrap();
            let listed = vfiod::client::list_devices(client).await.unwrap();
            (scanned == stored
                && listed.iter().map(shown_by_object).collect::<Vec<_>>()
                    == stored.iter().map(shown_by_store).collect::<Vec<_>>())
            .then_some(stored)
        },
    )
    .await;
    assert_eq!(stored, before, "the rollback left the inventory as it was");
    let shown = vfiod::client::show_device(&h.client, "0000:af:00.0")
        .await
        .unwrap();
    assert_eq!(
        shown.task_state, "error",
        "held until an operator resets it"
    );
    assert!(
        shown.last_result.contains("Input/output error"),
        "{}",
        shown.last_result
    );

    // A rescan with the fault still armed: no write, no change, no event, nothing broken.
    let events = store.events(None, 0, 10_000).unwrap().len();
    let listed = vfiod::client::list_devices(&h.client).await.unwrap();
    h.manager().await.rescan().await.unwrap();
    assert!(
        h.kernel.take_write_log().is_empty(),
        "the inventory must never write to sysfs"
    );
    assert_eq!(store.devices().unwrap(), before);
    assert_eq!(store.events(None, 0, 10_000).unwrap().len(), events);
    assert_eq!(
        vfiod::client::list_devices(&h.client).await.unwrap(),
        listed
    );
    assert_eq!(h.manager().await.broken_count().await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vfioctl_list_and_show() {
    let h = Harness::start(STEADY_CONFIG).await;
    let exe = env!("CARGO_BIN_EXE_vfioctl");
    let bus = h.bus.address().to_string();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(exe)
            .args(args)
            .env("VFIOD_BUS", &bus)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, json, err) = tokio::task::block_in_place(|| run(&["list", "--json"]));
    assert!(ok, "{err}");
    let listed: Vec<vfiod::client::DeviceView> = serde_json::from_str(&json).unwrap();
    let stored = h.store().devices().unwrap();
    assert_eq!(listed.len(), stored.len());
    for (v, d) in listed.iter().zip(&stored) {
        assert_eq!(v.address, d.address.to_string());
        assert_eq!(v.vendor_id, format!("{:04x}", d.vendor_id));
        assert_eq!(v.class, d.class.to_string());
        assert_eq!(v.state, d.state.as_str());
        assert_eq!(v.iommu_group, d.iommu_group);
        assert_eq!(v.num_vfs, d.num_vfs);
    }

    let (ok, table, _) = tokio::task::block_in_place(|| run(&["list"]));
    assert!(ok);
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("ADDRESS") && lines[0].contains("STATE"));
    assert_eq!(lines.len(), stored.len() + 1);
    let boot = lines
        .iter()
        .find(|l| l.starts_with("0000:3d:00.0"))
        .unwrap();
    assert!(
        boot.contains("nvme") && boot.ends_with("protected"),
        "{boot}"
    );
    let qat = lines
        .iter()
        .find(|l| l.starts_with("0000:5e:00.0"))
        .unwrap();
    assert!(
        qat.contains("crypto") && qat.contains(" vf ") && qat.contains("16/16"),
        "{qat}"
    );

    let (ok, gpus, _) = tokio::task::block_in_place(|| run(&["list", "--kind", "gpu"]));
    assert!(ok);
    assert_eq!(gpus.lines().count(), 2, "{gpus}");

    let (ok, show, _) = tokio::task::block_in_place(|| run(&["show", "0000:3d:00.0"]));
    assert!(ok);
    assert!(
        show.contains("state:") && show.contains("mounted at /"),
        "{show}"
    );

    let (ok, _, err) = tokio::task::block_in_place(|| run(&["show", "0000:99:00.0"]));
    assert!(!ok);
    assert!(err.contains("org.vfiod.Vfiod1.Error.NoSuchDevice"), "{err}");

    let (ok, _, err) = tokio::task::block_in_place(|| run(&["--bus", "nonsense", "list"]));
    assert!(!ok);
    assert!(err.contains("bus must be"), "{err}");
}

/// Every VF of a selected PF is managed on the bus and in `vfioctl list`/`show`, also when
/// its own ids match no rule (the NIC's VFs are 8086:154c, the rule names the PF's 8086:1572);
/// a protected VF and the VFs of an unselected PF (the QAT here) are not. Managed VFs still get
/// no mode of their own: no plan in GetPlans, a "leave" in GetPlan, no task from a reconcile,
/// Apply refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_vf_of_a_selected_pf_is_managed_on_the_bus() {
    let nic = "0000:3b:00.0";
    let protected_vf = "0000:3b:02.1";
    // The NIC split at start-up, one of its VFs protected; the QAT (booted split) unselected.
    let qat_rule = "[[select]]\nid = \"8086:37c8\"\nkind = \"crypto\"\nmode = \"vf\"\nnum_vfs = 16\nvf_driver = \"c6xxvf\"\n";
    let config = STEADY_CONFIG.replace(qat_rule, "").replace(
        "id = \"8086:1572\"\n",
        "id = \"8086:1572\"\nmode = \"vf\"\nnum_vfs = 4\n",
    );
    assert_eq!(config.matches("mode = \"vf\"").count(), 1, "{config}");
    let config = format!("{config}[[protect]]\naddress = \"{protected_vf}\"\n");
    let h = Harness::start(&config).await;
    let tasks_before = h.store().tasks(None, 100).unwrap();
    assert_eq!(
        tasks_before.len(),
        1,
        "the start-up split: {tasks_before:?}"
    );
    assert_eq!(tasks_before[0].address.to_string(), nic);

    let client = &h.client;
    let listed = eventually_async(
        Duration::from_secs(60),
        "the NIC's 4 VFs are listed, one of them protected",
        || async move {
            let listed = vfiod::client::list_devices(client).await.unwrap();
            let vfs: Vec<DeviceView> = listed
                .iter()
                .filter(|v| v.parent_pf.as_deref() == Some(nic))
                .cloned()
                .collect();
            let settled = vfs.len() == 4
                && vfs
                    .iter()
                    .any(|v| v.address == protected_vf && v.state == "protected");
            settled.then_some(listed)
        },
    )
    .await;
    let managed: BTreeMap<&str, bool> = listed
        .iter()
        .filter(|v| v.role == "vf")
        .map(|v| (v.address.as_str(), v.managed))
        .collect();
    for vf in ["0000:3b:02.0", "0000:3b:02.2", "0000:3b:02.3"] {
        assert_eq!(
            managed.get(vf),
            Some(&true),
            "{vf}: a VF of the selected NIC"
        );
    }
    assert_eq!(managed.get(protected_vf), Some(&false), "a protected VF");
    let qat_vfs: Vec<&DeviceView> = listed
        .iter()
        .filter(|v| v.parent_pf.as_deref() == Some("0000:5e:00.0"))
        .collect();
    assert_eq!(qat_vfs.len(), 16);
    assert!(
        qat_vfs.iter().all(|v| !v.managed),
        "VFs of an unselected PF: {qat_vfs:?}"
    );
    // The property itself, as busctl would read it.
    let props = h
        .client
        .call_method(
            Some("org.vfiod.Vfiod1"),
            device_path("0000:3b:02.0").as_str(),
            Some("org.freedesktop.DBus.Properties"),
            "Get",
            &("org.vfiod.Vfiod1.Device", "Managed"),
        )
        .await
        .unwrap();
    let managed: OwnedVariant = props.body().deserialize().unwrap();
    assert!(bool::try_from(managed).unwrap(), "Managed of 0000:3b:02.0");

    // vfioctl says the same.
    let bus = h.bus.address().to_string();
    let (ok, table) = tokio::task::block_in_place(|| common::vfioctl(&bus, &["list"]));
    assert!(ok, "{table}");
    let line = |a: &str| {
        table
            .lines()
            .find(|l| l.starts_with(a))
            .unwrap_or_else(|| panic!("{a} not listed: {table}"))
            .to_string()
    };
    assert!(
        line("0000:3b:02.0").ends_with("usable (managed)"),
        "{table}"
    );
    assert!(line(protected_vf).ends_with("protected"), "{table}");
    assert!(line("0000:5e:00.1").ends_with("usable"), "{table}");
    let (ok, show) =
        tokio::task::block_in_place(|| common::vfioctl(&bus, &["show", "0000:3b:02.3"]));
    assert!(ok, "{show}");
    assert!(
        show.lines()
            .any(|l| l.starts_with("managed:") && l.ends_with("yes")),
        "{show}"
    );

    // No mode of their own: GetPlans has no VF, GetPlan leaves one alone and says why.
    let m = h.manager().await;
    let plans: Vec<_> = m
        .get_plans()
        .await
        .unwrap()
        .iter()
        .map(vfiod::client::PlanEntry::from_dict)
        .collect();
    assert!(plans.iter().any(|p| p.address == nic), "{plans:?}");
    assert!(
        plans.iter().all(|p| !p.address.starts_with("0000:3b:02.")),
        "{plans:?}"
    );
    let plan = vfiod::client::PlanEntry::from_dict(&m.get_plan("0000:3b:02.0").await.unwrap());
    assert_eq!(
        (plan.decision.as_str(), plan.program.as_str()),
        ("leave", "nothing"),
        "{plan:?}"
    );
    assert!(plan.reason.contains("follows its PF"), "{plan:?}");
    assert!(plan.steps.is_empty(), "{plan:?}");
    // A reconcile starts no task for them, and neither does Apply.
    m.reload().await.unwrap();
    let vf = vfiod::client::device(&h.client, "0000:3b:02.0")
        .await
        .unwrap();
    match vf.apply().await.unwrap_err() {
        zbus::Error::MethodError(name, _, _) => {
            assert_eq!(name.as_str(), "org.vfiod.Vfiod1.Error.InvalidArgument")
        }
        other => panic!("not a D-Bus error reply: {other}"),
    }
    assert_eq!(
        h.store().tasks(None, 100).unwrap().len(),
        tasks_before.len(),
        "no task after the reload and the refused Apply"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vfioctl_says_when_vfiod_is_not_running() {
    let dir = tempfile::tempdir().unwrap();
    let bus = vfiod::sim::bus::PrivateBus::start(dir.path(), "").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vfioctl"))
        .args(["list"])
        .env("VFIOD_BUS", bus.address())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("vfiod is not running"), "{err}");
}

#[allow(dead_code)]
fn _types(_: OwnedVariant) {}

fn error_of(e: zbus::Error) -> (String, String) {
    match e {
        zbus::Error::MethodError(name, message, _) => {
            (name.to_string(), message.unwrap_or_default())
        }
        other => panic!("not a D-Bus error reply: {other}"),
    }
}

/// `Manager.PreviewPlans` (what `vfioctl plan --config` shows): the plans of a configuration
/// that is not installed, with its own selection, scenario and `[[protect]]`; every error of a
/// wrong one; bounds; and nothing written, whatever it is asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preview_plans_show_a_configuration_before_it_is_installed() {
    let h = Harness::start(STEADY_CONFIG).await;
    let m = h.manager().await;
    let nic = "0000:3b:00.0";
    let plans =
        |dicts: Vec<vfiod::dbus::wire::Dict>| -> BTreeMap<String, vfiod::client::PlanEntry> {
            dicts
                .iter()
                .map(vfiod::client::PlanEntry::from_dict)
                .map(|p| (p.address.clone(), p))
                .collect()
        };
    let running = plans(m.get_plans().await.unwrap());
    let tasks_before = h.store().tasks(None, 100).unwrap().len();
    let files = |texts: &[&str]| -> Vec<(String, String)> {
        texts
            .iter()
            .enumerate()
            .map(|(i, t)| (format!("candidate-{i}.toml"), t.to_string()))
            .collect()
    };

    // The public scenario with the NIC split in 4: a split the running (private) one does not do.
    let split = plans(
        m.preview_plans(
            &files(&["scenario = \"public\"\n[[select]]\nid = \"8086:1572\"\nnum_vfs = 4\n"]),
            HashMap::new(),
        )
        .await
        .unwrap(),
    );
    assert_eq!(
        split.keys().collect::<Vec<_>>(),
        [nic],
        "only what it selects: {split:?}"
    );
    assert_eq!(split[nic].decision, "target", "{split:?}");
    assert_eq!(split[nic].program, "split", "{split:?}");
    assert!(
        split[nic]
            .steps
            .iter()
            .any(|s| s.contains("sriov_numvfs") && s.contains('4')),
        "{split:?}"
    );
    assert_ne!(
        running.get(nic).map(|p| p.program.as_str()),
        Some("split"),
        "{running:?}"
    );

    // A drop-in that protects it: its own [[protect]] applies, not the running one's.
    let protected = plans(
        m.preview_plans(
            &files(&[
                "scenario = \"public\"\n[[select]]\nid = \"8086:1572\"\n",
                "[[protect]]\naddress = \"0000:3b:00.0\"\n",
            ]),
            HashMap::new(),
        )
        .await
        .unwrap(),
    );
    assert_eq!(protected[nic].decision, "leave", "{protected:?}");
    assert!(
        protected[nic].reason.contains("protected by config"),
        "{protected:?}"
    );

    // Wrong: every error, one per line, each naming its file.
    let (name, message) = error_of(
        m.preview_plans(
            &files(&[
                "scenario = \"cloudy\"\n[[select]]\nid = \"8086:zz\"\n",
                "poll_interval = 0\n",
            ]),
            HashMap::new(),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InvalidConfig", "{message}");
    let lines: Vec<&str> = message.lines().collect();
    assert_eq!(lines.len(), 3, "{message}");
    assert!(
        lines[0].starts_with("candidate-0.toml:1:12: `scenario`"),
        "{message}"
    );
    assert!(
        lines[1].starts_with("candidate-1.toml:1:17: `poll_interval`"),
        "{message}"
    );
    assert!(
        lines[2].starts_with("candidate-0.toml:3:6: `id` in [[select]] #1"),
        "{message}"
    );

    // Bounds and options.
    let many = vec![("x.toml".to_string(), String::new()); 130];
    let (name, message) = error_of(m.preview_plans(&many, HashMap::new()).await.unwrap_err());
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InvalidArgument", "{message}");
    let big = vec![("x.toml".to_string(), "#".repeat((1 << 20) + 1))];
    let (name, message) = error_of(m.preview_plans(&big, HashMap::new()).await.unwrap_err());
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InvalidArgument", "{message}");
    let option = HashMap::from([(
        "bogus".to_string(),
        OwnedVariant::try_from(zbus::Variant::from(true)).unwrap(),
    )]);
    let (name, message) = error_of(m.preview_plans(&files(&[""]), option).await.unwrap_err());
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InvalidArgument", "{message}");
    assert!(message.contains("bogus"), "{message}");

    // Nothing changed: the running plans, no task, the NIC not split.
    assert_eq!(
        plans(m.get_plans().await.unwrap())
            .keys()
            .collect::<Vec<_>>(),
        running.keys().collect::<Vec<_>>()
    );
    assert_eq!(h.store().tasks(None, 100).unwrap().len(), tasks_before);
    assert_eq!(
        h.store().device(addr(nic)).unwrap().unwrap().num_vfs,
        0,
        "the preview split nothing"
    );
}
