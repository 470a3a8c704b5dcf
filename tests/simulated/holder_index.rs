//! Issue 32, item 5: the hook's host guard bounded in time. Who holds a function's nodes is
//! read from the daemon's holder index (every process's descriptors, read again in the
//! background every `[host] holder_refresh_ms`), plus the processes started since it was built:
//! a process that starts holding a node is refused by the guard at once and shown by the
//! inventory after the next refresh; one that was running already and opens it later, after
//! the refresh; a holder that exits no longer counts. A QEMU started by hand holding a VF
//! through its VFIO device node makes the VF unclaimable in the inventory, not the VM vfiod
//! claimed a function for.

use crate::common::{self, addr, dict};
use crate::hooks::{domain_xml, harness_with, hook};
use std::sync::Arc;
use std::time::Duration;
use vfiod::engine::Engine;
use vfiod::model::device::{Device, State};
use vfiod::sim::kernel::{HostModel, ProcessSpec};
use zbus::Variant;

/// The NIC split into VFs on vfio-pci; the holder index refreshed every half second.
const CONFIG: &str = "scenario = \"private\"\npoll_interval = 3600\nlibvirt_uri = \"\"\n\
     [[select]]\nid = \"8086:1572\"\nmode = \"vf\"\nnum_vfs = 4\n\
     [host]\nholder_refresh_ms = 500\n";
const VF0: &str = "0000:3b:02.0";
const VF1: &str = "0000:3b:02.1";
/// Unselected, unused: the data NVMe drive.
const DATA: &str = "0000:d8:00.0";
/// Ends a hung test only.
const DEADLINE: Duration = Duration::from_secs(30);

fn process(pid: u32, comm: &str, cmdline: &[&str], nodes: &[&str]) -> ProcessSpec {
    ProcessSpec {
        pid,
        comm: comm.into(),
        cmdline: cmdline.iter().map(|a| a.to_string()).collect(),
        nodes: nodes.iter().map(|n| n.to_string()).collect(),
    }
}

fn managed(name: &str, functions: &[&str]) -> String {
    domain_xml(name, functions).replace("managed='no'", "managed='yes'")
}

async fn device(engine: &Arc<Engine>, a: &str) -> Device {
    let a = addr(a);
    engine
        .read(move |core| core.store().devices())
        .await
        .unwrap()
        .unwrap()
        .into_iter()
        .find(|d| d.address == a)
        .expect("a device of the reference host")
}

/// The record of `a` once `ok` holds for it, looked at after each refresh of the holder index.
async fn wait_for_device(
    engine: &Arc<Engine>,
    a: &str,
    what: &str,
    ok: impl Fn(&Device) -> bool,
) -> Device {
    let mut refreshed = engine.subscribe_holders();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let d = device(engine, a).await;
        if ok(&d) {
            return d;
        }
        tokio::time::timeout_at(deadline, refreshed.changed())
            .await
            .unwrap_or_else(|_| panic!("{what}: not within {DEADLINE:?}: {d:?}"))
            .unwrap();
    }
}

/// Returns once `n` refreshes of the holder index have ended since the call: the last one began
/// after it.
async fn refreshes(engine: &Arc<Engine>, n: u64) {
    let mut refreshed = engine.subscribe_holders();
    let start = *refreshed.borrow_and_update();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while *refreshed.borrow_and_update() < start + n {
        tokio::time::timeout_at(deadline, refreshed.changed())
            .await
            .expect("the holder index is refreshed")
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guard_sees_new_holders_at_once_and_the_inventory_at_the_refresh() {
    let (h, hook_config, bus) = harness_with(CONFIG, HostModel::reference()).await;
    let engine = Arc::clone(&h.server.as_ref().unwrap().engine);
    h.kernel.add_disk(addr(DATA), 1, false).unwrap();
    let xml = managed("vm1", &[DATA]);
    let start = || hook(&bus, &hook_config, &["vm1", "prepare", "begin", "-"], &xml);
    assert_eq!(start().code, 0, "an idle drive is libvirt's");

    // A process started since the last refresh: the guard reads it at once.
    h.kernel
        .spawn(process(812, "fio", &["fio"], &["/dev/nvme1n1"]))
        .unwrap();
    let r = start();
    assert_eq!(r.code, 1, "{}", r.stderr);
    let says = "block device nvme1n1 is open by pid 812 (fio)";
    assert!(
        r.stderr
            .contains(&format!("{DATA} is used by the host: {says}")),
        "{}",
        r.stderr
    );
    // The inventory at the next refresh.
    let d = wait_for_device(&engine, DATA, "fio recorded", |d| {
        d.state == State::Protected
    })
    .await;
    assert_eq!(d.state_reason, format!("used by the host: {says}"));

    // It exits: the guard no longer counts it at once, the inventory after the refresh.
    h.kernel.end(812).unwrap();
    let r = start();
    assert_eq!(r.code, 0, "a holder gone: {}", r.stderr);
    wait_for_device(&engine, DATA, "fio gone", |d| d.state == State::Usable).await;

    // A process that ran at the last refresh and opens the drive since (the same pid, as a
    // shell that runs `exec 3</dev/nvme1n1`): seen once the index is read again.
    h.kernel
        .spawn(process(813, "bash", &["bash"], &["/dev/null"]))
        .unwrap();
    refreshes(&engine, 2).await;
    h.kernel
        .spawn(process(
            813,
            "bash",
            &["bash"],
            &["/dev/null", "/dev/nvme1n1"],
        ))
        .unwrap();
    refreshes(&engine, 2).await;
    let r = start();
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("block device nvme1n1 is open by pid 813 (bash)"),
        "{}",
        r.stderr
    );
    wait_for_device(&engine, DATA, "bash recorded", |d| {
        d.state_reason == "used by the host: block device nvme1n1 is open by pid 813 (bash)"
    })
    .await;
    h.kernel.end(813).unwrap();
    assert_eq!(start().code, 0);
    wait_for_device(&engine, DATA, "bash gone", |d| d.state == State::Usable).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qemu_started_by_hand_makes_its_vf_unclaimable_until_it_exits() {
    let (h, hook_config, bus) = harness_with(CONFIG, HostModel::reference()).await;
    let engine = Arc::clone(&h.server.as_ref().unwrap().engine);
    let node = h
        .kernel
        .vfio_device_node(addr(VF1))
        .expect("VF1 on vfio-pci");
    assert_eq!(device(&engine, VF1).await.state, State::Usable);
    h.kernel
        .spawn(process(
            900,
            "qemu-system-x86",
            &[
                "qemu-system-x86_64",
                "-name",
                "guest=scratch",
                "-object",
                "iommufd,id=fd0",
            ],
            &[&node],
        ))
        .unwrap();
    let d = wait_for_device(&engine, VF1, "the QEMU recorded", |d| {
        d.state == State::Protected
    })
    .await;
    assert_eq!(
        d.state_reason,
        format!("used by VM scratch: {node} is open by pid 900 (qemu-system-x86)")
    );
    assert!(!d.managed, "vfiod does not touch it: {d:?}");
    // Not claimable, the holder named.
    let m = vfiod::client::claim::claims_proxy(&h.client).await.unwrap();
    let (name, message) = common::refusal(
        m.claim(
            dict(&[("address", Variant::from(VF1))]),
            dict(&[("vm_name", Variant::from("vm2"))]),
        )
        .await,
        "a claim on a VF a QEMU holds",
    );
    assert!(
        name.contains("Protected") && message.contains("pid 900 (qemu-system-x86)"),
        "{name}: {message}"
    );

    // vfiod's own claim at work is no outside use: a VM started through the hook holds its VF.
    let xml = managed("vm1", &[VF0]);
    let r = hook(&bus, &hook_config, &["vm1", "prepare", "begin", "-"], &xml);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let vf0_node = h
        .kernel
        .vfio_device_node(addr(VF0))
        .expect("VF0 on vfio-pci");
    h.kernel
        .spawn(process(
            901,
            "qemu-system-x86",
            &["qemu-system-x86_64", "-name", "guest=vm1,debug-threads=on"],
            &[&vf0_node],
        ))
        .unwrap();
    refreshes(&engine, 2).await;
    let d = device(&engine, VF0).await;
    assert_eq!((d.state, d.managed), (State::Usable, true), "{d:?}");

    // The QEMU by hand exits: claimable again.
    h.kernel.end(900).unwrap();
    let d = wait_for_device(&engine, VF1, "the QEMU gone", |d| d.state == State::Usable).await;
    assert!(d.managed, "{d:?}");
    m.claim(
        dict(&[("address", Variant::from(VF1))]),
        dict(&[("vm_name", Variant::from("vm2"))]),
    )
    .await
    .expect("a claim once the QEMU is gone");
}
