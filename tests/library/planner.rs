//! Plans for every selected device while the host changes under them: a device that goes away
//! between the store's listing and its plan (a restore removing VFs beside the planning, a
//! surprise removal before the next pass) has no plan, and the other devices still get theirs.
//! Found by the soak: one vanished function made a whole reconcile give up.

use crate::common;

use std::sync::Arc;
use vfiod::config::Settings;
use vfiod::engine::{Core, Modprobe};
use vfiod::sim::kernel::{HostModel, SimKernel};
use vfiod::store::Store;

#[test]
fn a_device_gone_before_the_next_pass_does_not_spoil_the_other_plans() {
    let dir = common::fast_tempdir();
    let kernel = SimKernel::build(&dir.path().join("root"), &HostModel::reference()).unwrap();
    let mut settings =
        Settings::from_toml_str(common::STEADY_CONFIG, std::path::Path::new("test.toml")).unwrap();
    settings.sysfs_root = kernel.root().to_path_buf();
    let store = Arc::new(Store::open(&dir.path().join("state")).unwrap());
    let core = Core::new(
        settings.clone(),
        None,
        kernel.sysfs(),
        Arc::clone(&store),
        Arc::new(Modprobe),
    )
    .unwrap();
    core.refresh().unwrap();
    let before = vfiod::mode::planner::plan_all(&kernel.sysfs(), &store, &settings).unwrap();
    let nvme = common::addr("0000:d8:00.0");
    assert!(before.iter().any(|p| p.address == nvme));

    // Gone from the kernel; the store still lists it (no pass has run).
    kernel
        .sysfs()
        .write_device_attr(nvme, "remove", "1")
        .unwrap();
    assert!(store.device(nvme).unwrap().is_some());
    let after = vfiod::mode::planner::plan_all(&kernel.sysfs(), &store, &settings)
        .expect("the other devices are planned");
    assert!(after.iter().all(|p| p.address != nvme), "{after:?}");
    assert_eq!(after.len(), before.len() - 1);
}
