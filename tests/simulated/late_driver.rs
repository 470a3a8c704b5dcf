//! A PF is split by its own driver. One whose driver binds after vfiod has started (at boot: a
//! slow module load, or a driver loaded by hand later) is split when its driver binds; one vfiod
//! moved to vfio-pci is given back to its driver first.
//!
//! The defect this guards against: the start-up reconcile tried the split of a PF with no driver,
//! `sriov_numvfs` answered ENOENT ("no driver bound to device; cannot configure SR-IOV" in the
//! kernel log), and the PF was left with a failed task until an operator reset it; nothing planned
//! it again when its driver came. Seen on a real kernel: tests/vm's reboots on a loaded machine,
//! where nvme bound after vfiod's start.

use crate::common::{addr, eventually, vfioctl, Harness, HUNG};
use vfiod::model::task::TaskKind;
use vfiod::sim::kernel::{DriverSpec, HostModel};
use vfiod::store::TaskState;

const NIC: &str = "0000:3b:00.0";

/// The NIC alone, split by the scenario into 4 VFs.
const CONFIG: &str = r#"
scenario = "public"
poll_interval = 3600
[[select]]
id = "8086:1572"
num_vfs = 4
"#;

/// The reference host with the NIC's driver (i40e) not loaded yet, and that driver.
fn host_without_i40e() -> (HostModel, DriverSpec) {
    let mut model = HostModel::reference();
    let at = model
        .drivers
        .iter()
        .position(|d| d.name == "i40e")
        .expect("the reference host has i40e");
    let i40e = model.drivers.remove(at);
    (model, i40e)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pf_whose_driver_binds_after_the_start_is_split_then() {
    let (model, i40e) = host_without_i40e();
    let h = Harness::start_with(CONFIG, model).await;
    assert_eq!(h.kernel.driver_of(addr(NIC)), None);
    let bus = h.bus.address().to_string();

    // Start-up: the NIC waits for its driver; no task was tried, none failed.
    let tasks = h.store().tasks(Some(addr(NIC)), 10).unwrap();
    assert!(tasks.is_empty(), "tasks at start-up: {tasks:?}");
    assert_eq!(h.kernel.num_vfs(addr(NIC)), Some(0));
    let (ok, plan) = vfioctl(&bus, &["plan"]);
    assert!(ok, "{plan}");
    let line = plan
        .lines()
        .find(|l| l.starts_with(NIC))
        .unwrap_or_else(|| panic!("no plan line for {NIC}:\n{plan}"));
    assert!(
        line.contains("waiting") && line.contains("the split runs when one binds"),
        "{line}"
    );

    // Its driver's module loads (late, as at a slow boot) and binds it: vfiod splits the NIC.
    h.kernel.load_driver(i40e).expect("load i40e");
    assert_eq!(h.kernel.driver_of(addr(NIC)).as_deref(), Some("i40e"));
    // The task's end is recorded after its inventory pass: wait for the end, then look.
    eventually(HUNG, "the split task's end", || {
        h.store()
            .tasks(Some(addr(NIC)), 1)
            .unwrap()
            .first()
            .filter(|t| t.state.is_final())
            .map(|_| ())
    })
    .await;
    let vfs = eventually(HUNG, "the NIC split once its driver bound", || {
        let vfs = h
            .store()
            .devices()
            .unwrap()
            .into_iter()
            .filter(|d| d.parent_pf == Some(addr(NIC)))
            .collect::<Vec<_>>();
        (vfs.len() == 4 && vfs.iter().all(|v| v.driver.as_deref() == Some("vfio-pci")))
            .then_some(vfs)
    })
    .await;
    for v in &vfs {
        assert_eq!(h.kernel.driver_of(v.address).as_deref(), Some("vfio-pci"));
    }
    let tasks = h.store().tasks(Some(addr(NIC)), 10).unwrap();
    assert!(
        matches!(&tasks[..], [t] if t.kind == TaskKind::Split
            && t.state == TaskState::Success
            && t.requested_by == "vfiod (a driver bound to it)"),
        "{tasks:?}"
    );
}

/// An explicit request for VF mode while the PF has no driver is refused with the cause and the
/// fix, and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vf_mode_asked_of_a_pf_without_a_driver_says_why_it_waits() {
    let (model, _) = host_without_i40e();
    let h = Harness::start_with(CONFIG, model).await;
    let bus = h.bus.address().to_string();
    let (ok, out) = vfioctl(&bus, &["mode", NIC, "vf", "--vfs", "2", "--wait"]);
    assert!(!ok, "VF mode of a PF without a driver succeeded:\n{out}");
    assert!(
        out.contains("has no driver bound") && out.contains("load the PF's driver module"),
        "{out}"
    );
    assert_eq!(h.kernel.num_vfs(addr(NIC)), Some(0));
    assert_eq!(h.kernel.driver_of(addr(NIC)), None);
}

/// The NIC whole on vfio-pci (as a claim of it whole, or `pf_driver`, leaves it).
const NIC_ON_VFIO: &str = r#"
scenario = "private"
poll_interval = 3600
[[select]]
id = "8086:1572"
num_vfs = 4
pf_driver = "vfio-pci"
"#;

/// A PF vfiod moved to vfio-pci is split by its own driver: vfio-pci creates no VFs (Linux's
/// answers ENOENT unless loaded with enable_sriov), so the split gives the PF back to the driver
/// it had first. The split used to write `sriov_numvfs` to vfio-pci and fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pf_vfiod_moved_to_vfio_pci_is_split_by_its_own_driver() {
    let h = Harness::start(NIC_ON_VFIO).await;
    assert_eq!(h.kernel.driver_of(addr(NIC)).as_deref(), Some("vfio-pci"));
    let bus = h.bus.address().to_string();
    h.replace_config(CONFIG);
    let (ok, out) = vfioctl(&bus, &["reload"]);
    assert!(ok, "{out}");
    let task = eventually(HUNG, "the split after the reload", || {
        h.store()
            .tasks(Some(addr(NIC)), 1)
            .unwrap()
            .into_iter()
            .find(|t| t.kind == TaskKind::Split && t.state.is_final())
    })
    .await;
    assert_eq!(task.state, TaskState::Success, "{task:?}");
    assert_eq!(h.kernel.num_vfs(addr(NIC)), Some(4));
    assert_eq!(h.kernel.driver_of(addr(NIC)).as_deref(), Some("i40e"));
}
