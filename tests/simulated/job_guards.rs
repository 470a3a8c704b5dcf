//! Issue 19: one guard (`engine::job::guard::users_of`) for every job that takes functions
//! away, so that each kind of holder refuses each job: a claim in the store, a running libvirt
//! domain (libvirt's test driver, `test://`), and a process holding the VFIO group open (a
//! "QEMU" in the simulated host's /proc). The mode job's three holders are in
//! tests/simulated/tasks.rs (a_claimed_device_is_not_converted,
//! a_vf_a_running_domain_uses_is_not_taken_away, a_device_a_vm_holds_open_is_never_taken_down);
//! the program job's claim in tests/simulated/fpga.rs.
//! Here: the program job (which once lacked the VFIO check), the attach job and the migrate
//! job. Every refusal is `InUse` (or `Protected`, once a pass has recorded the use), names the
//! holder, and writes nothing.

use crate::common;

use crate::common::{addr, dict, eventually_async, refusal, Harness};
use sha2::{Digest, Sha256};
use std::path::Path;
use std::time::Duration;
use vfiod::client::claim::{self, ClaimProxy};
use vfiod::client::{self, image::images, DeviceProxy};
use vfiod::fpga::image::build;
use vfiod::sim::kernel::{ProcessSpec, SimKernel, REFERENCE_FPGA_INTERFACE};
use zbus::Variant;

const AF: &str = "0000:af:00.0";
/// The data NVMe drive: nothing mounted on it.
const DATA_NVME: &str = "0000:d8:00.0";
const NLB: &str = "d8424dc4a4a3c413f89e433683f9040b";

/// A libvirt test-driver host with these running domains (name, assigned function).
fn libvirt_host(dir: &Path, file: &str, domains: &[(&str, &str)]) -> String {
    let path = dir.join(file);
    let xml: String = domains
        .iter()
        .map(|(n, a)| common::libvirtd::test_domain_xml(n, a))
        .collect();
    std::fs::write(&path, format!("<node>{xml}</node>")).unwrap();
    format!("test://{}", path.display())
}

/// A "QEMU" (pid 4242) holding `function`'s VFIO group open, as /proc shows it.
fn qemu_holds(h: &Harness, function: &str) {
    let group = h
        .kernel
        .sysfs()
        .read_function(addr(function))
        .unwrap()
        .iommu_group
        .unwrap();
    let proc_dir = h.kernel.root().join("proc/4242");
    std::fs::create_dir_all(proc_dir.join("fd")).unwrap();
    std::fs::write(proc_dir.join("comm"), "qemu-system-x86\n").unwrap();
    std::os::unix::fs::symlink(format!("/dev/vfio/{group}"), proc_dir.join("fd/17")).unwrap();
}

fn no_qemu(h: &Harness) {
    std::fs::remove_dir_all(h.kernel.root().join("proc/4242")).unwrap();
}

/// A refusal for a use the host or a VM makes of the function, naming `cause`: `InUse` when the
/// job's own look at the kernel found it, `Protected` when a pass (the holder index's refresh, a
/// job's re-check) recorded it first; which one depends on the moment (a loaded machine sees the
/// second), the cause named is the same.
fn refused_for_use(r: zbus::Result<impl std::fmt::Debug>, what: &str, cause: &str) {
    let (name, message) = refusal(r, what);
    assert!(
        [
            "org.vfiod.Vfiod1.Error.InUse",
            "org.vfiod.Vfiod1.Error.Protected"
        ]
        .contains(&name.as_str()),
        "{what}: {name}: {message}"
    );
    assert!(message.contains(cause), "{what}: {message}");
}

fn in_use(r: zbus::Result<impl std::fmt::Debug>, what: &str, says: &str) {
    let (name, message) = refusal(r, what);
    assert_eq!(name, "org.vfiod.Vfiod1.Error.InUse", "{what}: {message}");
    assert!(message.contains(says), "{what}: {message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_program_job_is_refused_by_a_running_domain_and_an_open_vfio_group() {
    let dir = tempfile::tempdir().unwrap();
    let config = |uri: &str| {
        format!(
            "scenario = \"private\"\npoll_interval = 3600\nlibvirt_uri = \"{uri}\"\n\
             [[select]]\nclass = \"0x12\"\nkind = \"fpga\"\n"
        )
    };
    let with_domain = libvirt_host(dir.path(), "web1.xml", &[("web1", "0000:af:00.2")]);
    let empty = libvirt_host(dir.path(), "empty.xml", &[]);
    let h = Harness::start(&config(&empty)).await;
    let bytes = build::gbs(REFERENCE_FPGA_INTERFACE, &[NLB], &vec![0x5a; 4096]);
    let path = h.dir.path().join("nlb.img");
    std::fs::write(&path, &bytes).unwrap();
    let sha: String = Sha256::digest(&bytes)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect();
    images(&h.client)
        .await
        .unwrap()
        .add(
            "nlb",
            zbus::Fd::from(&std::fs::File::open(&path).unwrap()),
            &sha,
            dict(&[]),
        )
        .await
        .unwrap();
    let d: DeviceProxy = client::device(&h.client, AF).await.unwrap();
    let task = d
        .set_mode("vf", vfiod::client::mode_options(Some(2)))
        .await
        .unwrap();
    let t = client::task(&h.client, task).await.unwrap();
    let t = &t;
    eventually_async(Duration::from_secs(60), "split", || async move {
        (t.state().await.unwrap() == "success").then_some(())
    })
    .await;
    let h_ = &h;
    eventually_async(Duration::from_secs(30), "VFs recorded", || async move {
        h_.store().device(addr("0000:af:00.2")).unwrap().map(|_| ())
    })
    .await;
    assert_eq!(
        h.kernel.driver_of(addr("0000:af:00.1")).as_deref(),
        Some("vfio-pci")
    );
    h.kernel.take_write_log();

    // A QEMU outside libvirt holds the first VF's group: reprogramming would remove the VF.
    qemu_holds(&h, "0000:af:00.1");
    in_use(
        d.program("nlb", Default::default()).await,
        "program with a VF's group open",
        "is open by pid 4242 (qemu-system-x86)",
    );
    no_qemu(&h);

    // A running domain has the second VF.
    h.replace_config(&config(&with_domain));
    h.manager().await.reload().await.unwrap();
    in_use(
        d.program("nlb", Default::default()).await,
        "program with a VF assigned to a running domain",
        "0000:af:00.2 is assigned to running domain web1",
    );
    assert!(h.kernel.take_write_log().is_empty(), "nothing written");
    assert_eq!(h.kernel.num_vfs(addr(AF)), Some(2));
}

fn nic_config(uri: &str) -> String {
    format!(
        "scenario = \"private\"\npoll_interval = 3600\nlibvirt_uri = \"{uri}\"\n\
         [[select]]\nid = \"8086:1572\"\nmode = \"vf\"\nnum_vfs = 4\n"
    )
}

async fn claim(h: &Harness, address: &'static str, vm: &'static str) -> zbus::OwnedObjectPath {
    claim::claims_proxy(&h.client)
        .await
        .unwrap()
        .claim(
            dict(&[("address", Variant::from(address))]),
            dict(&[("vm_name", Variant::from(vm))]),
        )
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_attach_job_is_refused_by_an_open_vfio_group_and_another_running_domain() {
    let dir = tempfile::tempdir().unwrap();
    let uri = libvirt_host(
        dir.path(),
        "node.xml",
        &[("web2", "0000:3b:02.3"), ("other", "0000:3b:02.2")],
    );
    let h = Harness::start(&nic_config(&uri)).await;
    let path = claim(&h, "0000:3b:02.1", "web2").await;
    let p = ClaimProxy::builder(&h.client)
        .path(path.clone())
        .build()
        .await
        .unwrap();
    h.kernel.take_write_log();
    qemu_holds(&h, "0000:3b:02.1");
    in_use(
        p.attach("web2", claim::attach_options(&["config"])).await,
        "attach of a VF whose group is open",
        "is open by pid 4242 (qemu-system-x86)",
    );
    no_qemu(&h);
    let c = claim::claim_view(&h.client, path.as_str()).await.unwrap();
    assert_eq!(c.state, "claimed", "the refusal changed nothing");

    // A function another running domain has by hand, claimed for web2 in the records.
    let path = claim(&h, "0000:3b:02.2", "web2").await;
    let p = ClaimProxy::builder(&h.client)
        .path(path)
        .build()
        .await
        .unwrap();
    in_use(
        p.attach("web2", claim::attach_options(&["config"])).await,
        "attach of a VF another domain has",
        "0000:3b:02.2 is assigned to running domain other",
    );
    assert!(h.kernel.take_write_log().is_empty(), "nothing written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_migrate_job_is_refused_by_another_running_domain_and_an_open_vfio_group() {
    let dir = tempfile::tempdir().unwrap();
    // web1 runs with 3b:02.0; "other" has 3b:02.1, which web1's claim also names.
    let uri = libvirt_host(
        dir.path(),
        "node.xml",
        &[("web1", "0000:3b:02.0"), ("other", "0000:3b:02.1")],
    );
    let h = Harness::start(&nic_config(&uri)).await;
    let m = h.manager().await;
    // web1's claims, attached as the `started` hook records them (only attached devices are
    // carried by a migration).
    let started = |functions: &[&str]| {
        let hostdevs: String = functions
            .iter()
            .map(|a| {
                let a = addr(a);
                format!(
                    "<hostdev mode='subsystem' type='pci' managed='no'><source><address \
                     domain='0x{:04x}' bus='0x{:02x}' slot='0x{:02x}' function='0x{:x}'/>\
                     </source></hostdev>",
                    a.domain, a.bus, a.slot, a.function
                )
            })
            .collect();
        format!("<domain type='test'><name>web1</name><devices>{hostdevs}</devices></domain>")
    };
    claim(&h, "0000:3b:02.0", "web1").await;
    claim(&h, "0000:3b:02.1", "web1").await;
    let (code, _, message) = m
        .hook(
            "web1",
            "started",
            "begin",
            "-",
            &started(&["0000:3b:02.0", "0000:3b:02.1"]),
        )
        .await
        .unwrap();
    assert_eq!(code, 0, "{message}");
    h.kernel.take_write_log();
    in_use(
        m.migrate("web1", "qemu+ssh://elsewhere/system", dict(&[]))
            .await,
        "migrate with a function another domain has",
        "0000:3b:02.1 is assigned to running domain other",
    );
    // A process holds the group of a function of web1's claims that libvirt does not show
    // web1 has: that is not web1's QEMU (the refusal names every holder).
    claim(&h, "0000:3b:02.3", "web1").await;
    let (code, _, message) = m
        .hook(
            "web1",
            "started",
            "begin",
            "-",
            &started(&["0000:3b:02.0", "0000:3b:02.1", "0000:3b:02.3"]),
        )
        .await
        .unwrap();
    assert_eq!(code, 0, "{message}");
    qemu_holds(&h, "0000:3b:02.3");
    in_use(
        m.migrate("web1", "qemu+ssh://elsewhere/system", dict(&[]))
            .await,
        "migrate with a group open by another process",
        "is open by pid 4242 (qemu-system-x86)",
    );
    assert!(h.kernel.take_write_log().is_empty(), "nothing written");
    no_qemu(&h);
}

/// Issue 33: an attach that fails after it bound the claim's functions to vfio-pci (here
/// libvirt knows no domain of that name, as with no libvirtd) puts each back on the driver it
/// had, forgets the original drivers it recorded, and releases the claim: nothing on the host
/// is left changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_attach_puts_the_drivers_back() {
    const GPU: &str = "0000:17:00.0";
    const AUDIO: &str = "0000:17:00.1";
    let dir = tempfile::tempdir().unwrap();
    let uri = libvirt_host(dir.path(), "none.xml", &[]);
    let h = Harness::start(&format!(
        "libvirt_uri = \"{uri}\"\n{}",
        common::STEADY_CONFIG
    ))
    .await;
    assert_eq!(h.kernel.driver_of(addr(GPU)).as_deref(), Some("nouveau"));
    let path = claim(&h, GPU, "ghost").await;
    let p = ClaimProxy::builder(&h.client)
        .path(path.clone())
        .build()
        .await
        .unwrap();
    let (name, message) = refusal(
        p.attach("ghost", claim::attach_options(&["config"])).await,
        "attach to a domain libvirt does not have",
    );
    assert_eq!(name, "org.vfiod.Vfiod1.Error.AttachFailed", "{message}");
    assert_eq!(
        (
            h.kernel.driver_of(addr(GPU)),
            h.kernel.driver_of(addr(AUDIO))
        ),
        (
            Some("nouveau".to_string()),
            Some("snd_hda_intel".to_string())
        ),
        "the drivers they had before the attach: {message}"
    );
    assert_eq!(h.kernel.driver_override_of(addr(GPU)), None);
    assert_eq!(h.kernel.driver_override_of(addr(AUDIO)), None);
    let store = h.store();
    assert_eq!(store.original_driver(addr(GPU)).unwrap(), None);
    assert_eq!(store.original_driver(addr(AUDIO)).unwrap(), None);
    assert!(
        store.active_claim_records().unwrap().is_empty(),
        "the claim is released"
    );
}

/// A process of the simulated host holding `nodes` open (`args`: its command line).
fn process(pid: u32, comm: &str, args: &[&str], nodes: &[&str]) -> ProcessSpec {
    ProcessSpec {
        pid,
        comm: comm.into(),
        cmdline: args.iter().map(|a| a.to_string()).collect(),
        nodes: nodes.iter().map(|n| n.to_string()).collect(),
    }
}

/// Issue 32: a drive the host holds without a mount (an LVM volume group on it, a process with
/// it open) is not claimable: the claim is refused as the host's, naming the holder; once the
/// holder is gone it is claimable again. And a clean does not reset it from under a holder
/// that came since.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drive_the_host_holds_is_neither_claimed_nor_cleaned() {
    let h = Harness::start(
        "scenario = \"private\"\npoll_interval = 3600\nlibvirt_uri = \"\"\n\
         [[select]]\nid = \"144d:a824\"\n",
    )
    .await;
    h.kernel.add_disk(addr(DATA_NVME), 1, false).unwrap();
    let claims = claim::claims_proxy(&h.client).await.unwrap();
    let try_claim = || {
        claims.claim(
            dict(&[("address", Variant::from(DATA_NVME))]),
            dict(&[("vm_name", Variant::from("vm1"))]),
        )
    };
    for (hold, release, says) in [
        (
            &(|k: &SimKernel| k.add_holder("nvme1n1", "dm-0", Some("vg0-data")).unwrap())
                as &dyn Fn(&SimKernel),
            &(|k: &SimKernel| k.remove_holder("nvme1n1", "dm-0").unwrap()) as &dyn Fn(&SimKernel),
            "block device nvme1n1 is held by dm-0 (vg0-data)",
        ),
        (
            &|k: &SimKernel| {
                k.spawn(process(812, "fio", &["fio"], &["/dev/nvme1n1"]))
                    .unwrap()
            },
            &|k: &SimKernel| k.end(812).unwrap(),
            "block device nvme1n1 is open by pid 812 (fio)",
        ),
    ] {
        hold(&h.kernel);
        let (name, message) = refusal(try_claim().await, says);
        assert!(
            name.ends_with("Protected") && message.contains(says),
            "{name}: {message}"
        );
        release(&h.kernel);
    }
    let path = try_claim()
        .await
        .expect("claimable once the holders are gone");
    let p = ClaimProxy::builder(&h.client)
        .path(path)
        .build()
        .await
        .unwrap();
    p.release().await.unwrap();
    let d: DeviceProxy = client::device(&h.client, DATA_NVME).await.unwrap();
    let watch = common::proxies::device(&h, DATA_NVME).await;
    let (watch, h_) = (&watch, &h);
    eventually_async(
        Duration::from_secs(30),
        "the clean after the claim",
        || async move {
            let usable = h_.store().device(addr(DATA_NVME)).unwrap()?.state
                == vfiod::model::device::State::Usable;
            (usable && watch.task_state().await.unwrap() == "idle").then_some(())
        },
    )
    .await;
    h.kernel
        .spawn(process(813, "nvme", &["nvme"], &["/dev/nvme1"]))
        .unwrap();
    h.kernel.take_write_log();
    refused_for_use(
        d.clean(dict(&[])).await,
        "a clean of a drive a process holds",
        "used by the host: /dev/nvme1 is open by pid 813 (nvme)",
    );
    assert!(h.kernel.take_write_log().is_empty(), "nothing written");
    h.kernel.end(813).unwrap();
    cleaned_once_free(&d, "a clean once nobody holds it").await;
}

/// A clean of `d`, asked until it is taken: the refused one's task may still be on its way out.
async fn cleaned_once_free(d: &DeviceProxy<'_>, what: &str) {
    eventually_async(Duration::from_secs(30), what, || async move {
        match d.clean(dict(&[])).await {
            Ok(task) => Some(task),
            Err(zbus::Error::MethodError(name, _, _)) if name.as_str().ends_with(".Busy") => None,
            Err(e) => panic!("{what}: {e}"),
        }
    })
    .await;
}

/// Issue 32: a QEMU outside libvirt holding a VF through its VFIO device node (iommufd,
/// `/dev/vfio/devices/vfioN`, not `/dev/vfio/<group>`) refuses a restore of its PF and a
/// clean of the VF, naming the process; both go ahead once it is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_holding_a_vf_through_iommufd_refuses_a_restore_and_a_clean() {
    let h = Harness::start(&nic_config("")).await;
    let vf = "0000:3b:02.0";
    let h_ = &h;
    let node = eventually_async(
        Duration::from_secs(30),
        "the VF on vfio-pci",
        || async move {
            h_.store().device(addr(vf)).unwrap()?;
            h_.kernel.vfio_device_node(addr(vf))
        },
    )
    .await;
    h.kernel
        .spawn(process(
            4343,
            "qemu-system-x86",
            &[
                "qemu-system-x86_64",
                "-name",
                "guest=byhand",
                "-object",
                "iommufd,id=fd0",
            ],
            &["/dev/iommu", &node],
        ))
        .unwrap();
    h.kernel.take_write_log();
    let says = format!("{vf} is used by VM byhand: {node} is open by pid 4343 (qemu-system-x86)");
    let pf: DeviceProxy = client::device(&h.client, "0000:3b:00.0").await.unwrap();
    in_use(
        pf.set_mode("pf", vfiod::client::mode_options(None)).await,
        "a restore of the PF",
        &says,
    );
    let d: DeviceProxy = client::device(&h.client, vf).await.unwrap();
    refused_for_use(
        d.clean(dict(&[])).await,
        "a clean of the VF",
        &format!("used by VM byhand: {node} is open by pid 4343 (qemu-system-x86)"),
    );
    assert!(h.kernel.take_write_log().is_empty(), "nothing written");
    assert_eq!(h.kernel.num_vfs(addr("0000:3b:00.0")), Some(4));
    h.kernel.end(4343).unwrap();
    cleaned_once_free(&d, "a clean once the VM is gone").await;
}
