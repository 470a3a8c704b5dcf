//! Conversion programs against the simulated kernel: the resulting sysfs state after split,
//! restore, rebind and group binding, and rollback after every injected fault.

use crate::common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use vfiod::host::sysfs::Sysfs;
use vfiod::mode::convert::{self, ConvertError};
use vfiod::mode::plan::{self, Snapshot};
use vfiod::mode::policy::Program;
use vfiod::model::pci::PciAddress;
use vfiod::sim::kernel::{FaultAction, FaultTarget, HostModel, SimKernel};

fn a(s: &str) -> PciAddress {
    s.parse().unwrap()
}

struct Host {
    _dir: tempfile::TempDir,
    kernel: Arc<SimKernel>,
    sysfs: Sysfs,
}

/// `write_timeout` bounds each sysfs write; enabling 64 simulated VFs on a loaded 2-core
/// machine takes seconds, so only the fault tests use a short bound.
fn host_with(write_timeout: Duration) -> Host {
    let dir = common::fast_tempdir();
    let kernel = SimKernel::build(dir.path(), &HostModel::reference()).unwrap();
    let sysfs = kernel.sysfs().with_write_timeout(write_timeout);
    Host {
        _dir: dir,
        kernel,
        sysfs,
    }
}

fn host() -> Host {
    host_with(Duration::from_secs(30))
}

fn snap(h: &Host, pf: &str) -> Snapshot {
    convert::snapshot(&h.sysfs, a(pf), BTreeMap::new()).unwrap()
}

fn run(h: &Host, pf: &str, program: Program) -> Result<(), Box<convert::Failed>> {
    let before = snap(h, pf);
    let p = plan::build(&before, &program, "vfio-pci").unwrap();
    convert::apply(&h.sysfs, &p, &before, &mut |_, _, _| {})
}

fn vfio_node(h: &Host, addr: PciAddress) -> bool {
    let g = h.sysfs.read_function(addr).unwrap().iommu_group.unwrap();
    h.kernel.root().join(format!("dev/vfio/{g}")).exists()
}

fn assert_split(h: &Host, pf: &str, n: u32) {
    let raw = h.sysfs.read_function(a(pf)).unwrap();
    let s = raw.sriov.unwrap();
    assert_eq!(
        (s.num_vfs, s.vfs.len() as u32, s.drivers_autoprobe),
        (n, n, false),
        "{pf}"
    );
    for vf in &s.vfs {
        let r = h.sysfs.read_function(*vf).unwrap();
        assert_eq!(r.driver.as_deref(), Some("vfio-pci"), "{vf}");
        assert_eq!(r.driver_override.as_deref(), Some("vfio-pci"), "{vf}");
        assert_eq!(r.physfn, Some(a(pf)));
        assert!(vfio_node(h, *vf), "/dev/vfio node for {vf}");
    }
}

fn assert_whole(h: &Host, pf: &str, driver: &str) {
    let raw = h.sysfs.read_function(a(pf)).unwrap();
    let s = raw.sriov.unwrap();
    assert_eq!(
        (s.num_vfs, s.vfs.len(), s.drivers_autoprobe),
        (0, 0, true),
        "{pf}"
    );
    assert_eq!(raw.driver.as_deref(), Some(driver));
    assert_eq!(raw.driver_override, None);
    assert_eq!(
        h.sysfs
            .list_functions()
            .unwrap()
            .iter()
            .filter(|x| x.bus == a(pf).bus && **x != a(pf))
            .count(),
        0
    );
}

#[test]
fn split_and_restore_the_nic_the_fpga_and_the_qat() {
    let h = host();
    run(&h, "0000:3b:00.0", Program::Split { num_vfs: 64 }).unwrap();
    assert_split(&h, "0000:3b:00.0", 64);
    run(&h, "0000:3b:00.0", Program::Restore).unwrap();
    assert_whole(&h, "0000:3b:00.0", "i40e");

    run(&h, "0000:af:00.0", Program::Split { num_vfs: 4 }).unwrap();
    assert_split(&h, "0000:af:00.0", 4);
    run(&h, "0000:af:00.0", Program::Restore).unwrap();
    assert_whole(&h, "0000:af:00.0", "dfl-pci");

    // The QAT boots split with its VFs on the host driver: rebind them, then restore, then split.
    run(&h, "0000:5e:00.0", Program::RebindVfs).unwrap();
    let s = snap(&h, "0000:5e:00.0");
    assert!(s
        .vfs
        .iter()
        .all(|v| v.driver.as_deref() == Some("vfio-pci")));
    run(&h, "0000:5e:00.0", Program::Restore).unwrap();
    assert_whole(&h, "0000:5e:00.0", "c6xx");
    run(&h, "0000:5e:00.0", Program::Split { num_vfs: 16 }).unwrap();
    assert_split(&h, "0000:5e:00.0", 16);
    run(&h, "0000:5e:00.0", Program::Resplit { from: 16, to: 8 }).unwrap();
    assert_split(&h, "0000:5e:00.0", 8);
}

#[test]
fn the_gpu_and_its_audio_move_together_and_come_back() {
    let h = host();
    let gpu = "0000:17:00.0";
    let before = snap(&h, gpu);
    assert_eq!(before.group.len(), 2);
    let originals: BTreeMap<_, _> = before
        .group
        .iter()
        .map(|b| (b.address, b.driver.clone()))
        .collect();
    run(
        &h,
        gpu,
        Program::Bind {
            driver: "vfio-pci".into(),
        },
    )
    .unwrap();
    for m in ["0000:17:00.0", "0000:17:00.1"] {
        assert_eq!(h.kernel.driver_of(a(m)).as_deref(), Some("vfio-pci"), "{m}");
    }
    assert!(vfio_node(&h, a(gpu)));

    // Back: the restore program returns each member to the driver recorded before.
    let now = convert::snapshot(&h.sysfs, a(gpu), originals.clone()).unwrap();
    let back = plan::rollback(&before, &now);
    convert::execute(&h.sysfs, &back, &mut |_, _, _| {}).unwrap();
    assert_eq!(
        h.kernel.driver_of(a("0000:17:00.0")).as_deref(),
        Some("nouveau")
    );
    assert_eq!(
        h.kernel.driver_of(a("0000:17:00.1")).as_deref(),
        Some("snd_hda_intel")
    );
    assert!(!vfio_node(&h, a(gpu)));
    assert_eq!(snap(&h, gpu), before);
}

/// Injects `fault`, runs a 4-VF split of the FPGA, and checks it failed with a clear message
/// and left the device exactly as before.
fn split_fails_and_rolls_back(
    target: FaultTarget,
    action: FaultAction,
    times: Option<u32>,
    expect: &str,
) {
    let h = host_with(Duration::from_secs(2));
    let pf = "0000:af:00.0";
    let before = snap(&h, pf);
    let hangs = matches!(action, FaultAction::Hang(_));
    h.kernel.inject(target, action, times);
    let err = run(&h, pf, Program::Split { num_vfs: 4 }).unwrap_err();
    // A fault must not freeze the program: a hung write is given up at the write timeout,
    // while the hang still holds (a state, where this used to be "under 8 s").
    let still_hanging = h.kernel.hanging();
    h.kernel.release_hangs();
    let msg = vfiod::error_chain(&err);
    assert!(msg.contains(expect), "message {msg:?} lacks {expect:?}");
    assert!(err.rollback.is_ok(), "rollback failed: {msg}");
    if hangs {
        assert_eq!(
            still_hanging, 1,
            "the program waited for the hang to end: {msg}"
        );
    }
    h.kernel.clear_faults();
    assert_eq!(snap(&h, pf), before, "not rolled back: {msg}");
    assert_whole(&h, pf, "dfl-pci");
}

#[test]
fn ebusy_on_numvfs_rolls_back() {
    split_fails_and_rolls_back(
        FaultTarget::DeviceAttr(a("0000:af:00.0"), "sriov_numvfs".into()),
        FaultAction::Errno(libc::EBUSY),
        Some(1),
        "Device or resource busy",
    );
}

#[test]
fn a_failing_vf_bind_rolls_back() {
    // The third VF's probe fails: the first two are bound by then.
    split_fails_and_rolls_back(
        FaultTarget::AnyFor(a("0000:af:00.3")),
        FaultAction::Errno(libc::EIO),
        Some(1),
        "0000:af:00.3",
    );
}

#[test]
fn a_hanging_write_times_out_and_rolls_back() {
    split_fails_and_rolls_back(
        FaultTarget::AnyFor(a("0000:af:00.2")),
        FaultAction::Hang(Duration::from_secs(30)),
        Some(1),
        "did not finish within",
    );
}

#[test]
fn a_vf_that_vanishes_mid_split_rolls_back() {
    split_fails_and_rolls_back(
        FaultTarget::DeviceAttr(a("0000:af:00.2"), "driver_override".into()),
        FaultAction::VanishAfter(a("0000:af:00.2")),
        Some(1),
        "0000:af:00.2",
    );
}

#[test]
fn kernel_refusals_name_errno_and_path() {
    let h = host();
    // Planned while the PF had its driver, which goes before the writes (the planner refuses a
    // split of a PF without one): the kernel refuses sriov_numvfs with ENOENT.
    let planned = snap(&h, "0000:af:00.0");
    let p = plan::build(&planned, &Program::Split { num_vfs: 2 }, "vfio-pci").unwrap();
    h.sysfs
        .write(
            &h.sysfs.driver_dir("dfl-pci").join("unbind"),
            "0000:af:00.0",
        )
        .unwrap();
    let before = snap(&h, "0000:af:00.0");
    let err = convert::apply(&h.sysfs, &p, &before, &mut |_, _, _| {}).unwrap_err();
    assert_eq!(err.error.errno(), Some(libc::ENOENT));
    let msg = vfiod::error_chain(&err);
    assert!(
        msg.contains("/sys/bus/pci/devices/0000:af:00.0/sriov_numvfs"),
        "{msg}"
    );
    assert!(
        matches!(err.error, ConvertError::Sysfs { index: 1, .. }),
        "{:?}",
        err.error
    );
    assert_eq!(snap(&h, "0000:af:00.0"), before);
}
