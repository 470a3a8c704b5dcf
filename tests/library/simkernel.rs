//! The simulated kernel against the kernel facts in docs (design.md "Kernel facts", testbed.md
//! "Pitfalls seen"): every test drives it through `vfiod::host::sysfs::Sysfs`, as the daemon does, and
//! then checks the RESULTING STATE (directories, relative symlinks and what they resolve to,
//! attribute files, `read_function`, uevents, `lspci`), never just the bytes written.
//!
//! Everything lives under a fresh temporary root per test; nothing touches the real /sys.

use crate::common;

use crate::common::fast_tempdir as scratch_dir;
use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use vfiod::host::sysfs::{Sysfs, SysfsError};
use vfiod::host::uevent::{Action, EventReceiver, Uevent};
use vfiod::model::pci::PciAddress;
use vfiod::sim::kernel::{FaultAction, FaultTarget, FunctionSpec, HostModel, SimKernel};

const NIC: &str = "0000:3b:00.0"; // X710, 64 VFs 8086:154c, i40e / iavf, offset 16
const NIC_PORT: &str = "0000:00:02.0";
const QAT: &str = "0000:5e:00.0"; // 16 VFs, enabled at boot, VFs on c6xxvf
const GPU: &str = "0000:17:00.0";
const AUDIO: &str = "0000:17:00.1";
const FPGA: &str = "0000:af:00.0"; // 4 VFs, dfl-pci for PF and VFs
const DATA_NVME: &str = "0000:d8:00.0";
const DATA_NVME_PORT: &str = "0000:00:05.0";
const BOOT_NVME: &str = "0000:3d:00.0";

fn addr(s: &str) -> PciAddress {
    s.parse().expect("address")
}

// ----- harness -----------------------------------------------------------------------------

struct Host {
    _dir: tempfile::TempDir,
    kernel: Arc<SimKernel>,
    sysfs: Sysfs,
}

impl Host {
    fn reference() -> Host {
        Host::with(HostModel::reference())
    }

    fn with(model: HostModel) -> Host {
        let dir = scratch_dir();
        let kernel = SimKernel::build(&dir.path().join("root"), &model).expect("simulated host");
        let sysfs = kernel.sysfs();
        Host {
            _dir: dir,
            kernel,
            sysfs,
        }
    }

    /// The NIC's autoprobe off, then `n` VFs enabled: VFs with no driver, as vfiod's split
    /// leaves them before binding. Their addresses, in VF order.
    fn enable_unprobed_nic_vfs(&self, n: u32) -> Vec<String> {
        self.set(NIC, "sriov_drivers_autoprobe", "0");
        self.set(NIC, "sriov_numvfs", &n.to_string());
        vf_addresses(self, NIC, n)
            .iter()
            .map(|a| a.to_string())
            .collect()
    }

    fn root(&self) -> &Path {
        self.kernel.root()
    }

    /// `<root>/<rel>`.
    fn p(&self, rel: &str) -> PathBuf {
        self.root().join(rel)
    }

    /// `<root>/sys/bus/pci/devices/<a>` (the bus link, not resolved).
    fn dev(&self, a: &str) -> PathBuf {
        self.sysfs.device_dir(addr(a))
    }

    /// Where the kernel keeps a function's directory: under its upstream port.
    fn real_dir(&self, parent_port: &str, a: &str) -> PathBuf {
        self.p(&format!("sys/devices/pci0000:00/{parent_port}/{a}"))
    }

    /// An attribute file's content, trimmed (read straight from the tree).
    fn attr(&self, a: &str, name: &str) -> String {
        let p = self.dev(a).join(name);
        fs::read_to_string(&p)
            .unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
            .trim()
            .to_string()
    }

    fn try_set(&self, a: &str, attr: &str, value: &str) -> Result<(), SysfsError> {
        self.sysfs.write_device_attr(addr(a), attr, value)
    }

    fn set(&self, a: &str, attr: &str, value: &str) {
        self.try_set(a, attr, value)
            .unwrap_or_else(|e| panic!("{a}/{attr} <- {value:?}: {}", vfiod::error_chain(&e)));
    }

    /// `sys/bus/pci/<name>` <- value.
    fn bus(&self, name: &str, value: &str) -> Result<(), SysfsError> {
        self.sysfs
            .write(&self.sysfs.pci_bus_dir().join(name), value)
    }

    /// `sys/bus/pci/drivers/<driver>/<name>` <- value.
    fn drv(&self, driver: &str, name: &str, value: &str) -> Result<(), SysfsError> {
        self.sysfs
            .write(&self.sysfs.driver_dir(driver).join(name), value)
    }

    fn probe(&self, a: &str) {
        self.bus("drivers_probe", a)
            .unwrap_or_else(|e| panic!("drivers_probe {a}: {}", vfiod::error_chain(&e)));
    }

    /// The canonical path a (possibly relative, chained) link resolves to.
    fn canon(&self, p: &Path) -> PathBuf {
        fs::canonicalize(p).unwrap_or_else(|e| panic!("resolving {}: {e}", p.display()))
    }

    /// The driver a function is bound to, as its `driver` link says.
    fn driver_link(&self, a: &str) -> Option<String> {
        let link = self.dev(a).join("driver");
        if !exists(&link) {
            return None;
        }
        let target = self.canon(&link);
        assert_eq!(
            target.parent().unwrap(),
            self.p("sys/bus/pci/drivers"),
            "{a}/driver must point into sys/bus/pci/drivers"
        );
        Some(target.file_name().unwrap().to_str().unwrap().to_string())
    }

    /// The function's IOMMU group, from its `iommu_group` link (which must resolve into
    /// `sys/kernel/iommu_groups`).
    fn group(&self, a: &str) -> u32 {
        let target = self.canon(&self.dev(a).join("iommu_group"));
        assert_eq!(
            target.parent().unwrap(),
            self.p("sys/kernel/iommu_groups"),
            "{a}/iommu_group must point into sys/kernel/iommu_groups"
        );
        target
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .parse()
            .unwrap()
    }

    fn group_members(&self, g: u32) -> BTreeSet<String> {
        names_in(&self.p(&format!("sys/kernel/iommu_groups/{g}/devices")))
    }

    fn groups(&self) -> BTreeSet<u32> {
        names_in(&self.p("sys/kernel/iommu_groups"))
            .into_iter()
            .map(|n| n.parse().expect("numeric group"))
            .collect()
    }

    /// Numeric `/dev/vfio/N` nodes (the container node `vfio` is left out).
    fn vfio_nodes(&self) -> BTreeSet<u32> {
        names_in(&self.p("dev/vfio"))
            .into_iter()
            .filter_map(|n| n.parse().ok())
            .collect()
    }

    fn bus_devices(&self) -> BTreeSet<String> {
        names_in(&self.sysfs.pci_devices_dir())
    }

    fn read(&self, a: &str) -> vfiod::host::sysfs::RawFunction {
        self.sysfs
            .read_function(addr(a))
            .unwrap_or_else(|e| panic!("read_function {a}: {}", vfiod::error_chain(&e)))
    }
}

/// Entry names of a directory (empty when it does not exist).
fn names_in(dir: &Path) -> BTreeSet<String> {
    match fs::read_dir(dir) {
        Ok(rd) => rd
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeSet::new(),
        Err(e) => panic!("listing {}: {e}", dir.display()),
    }
}

/// The path itself exists (a dangling link counts: it must be gone too).
fn exists(p: &Path) -> bool {
    fs::symlink_metadata(p).is_ok()
}

/// The errno of a failed write; a success or an errno-less error fails the test.
fn errno(r: Result<(), SysfsError>) -> i32 {
    match r {
        Ok(()) => panic!("the write was expected to fail but succeeded"),
        Err(e) => e
            .errno()
            .unwrap_or_else(|| panic!("error without errno: {}", vfiod::error_chain(&e))),
    }
}

/// VF addresses from the PF's routing id, `sriov_offset` and `sriov_stride`, as the SR-IOV
/// spec defines them (independently of the simulator's own arithmetic).
fn vf_addresses(h: &Host, pf: &str, n: u32) -> Vec<PciAddress> {
    let offset: u32 = h.attr(pf, "sriov_offset").parse().unwrap();
    let stride: u32 = h.attr(pf, "sriov_stride").parse().unwrap();
    let p = addr(pf);
    let rid = (u32::from(p.bus) << 8) | (u32::from(p.slot) << 3) | u32::from(p.function);
    (0..n)
        .map(|i| {
            let r = rid + offset + stride * i;
            PciAddress::new(
                p.domain,
                (r >> 8) as u8,
                ((r >> 3) & 0x1f) as u8,
                (r & 7) as u8,
            )
        })
        .collect()
}

/// Every event queued so far.
fn drain(rx: &mut EventReceiver) -> Vec<Uevent> {
    let mut out = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        out.push(ev);
    }
    out
}

/// (action, PCI_SLOT_NAME) of each event, in order.
fn actions(events: &[Uevent]) -> Vec<(Action, String)> {
    events
        .iter()
        .map(|e| {
            (
                e.action,
                e.vars
                    .get("PCI_SLOT_NAME")
                    .cloned()
                    .unwrap_or_else(|| panic!("event without PCI_SLOT_NAME: {e:?}")),
            )
        })
        .collect()
}

/// Runs `f` on its own thread and fails the test (instead of hanging it) if it does not
/// finish in time: for checks that a hung write does not block anything else.
fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what} did not finish within {limit:?}"))
}

// ----- 1. splitting the NIC ----------------------------------------------------------------

/// autoprobe 0 + sriov_numvfs 64: 64 VF functions at offset/stride addresses, each a sibling of
/// the PF under its root port, linked both ways, alone in a new IOMMU group, unbound.
#[test]
fn split_nic_creates_64_unbound_vfs_with_links_and_groups() {
    let h = Host::reference();
    let boot_groups = h.groups();
    let boot_devices = h.bus_devices();

    h.set(NIC, "sriov_drivers_autoprobe", "0");
    h.set(NIC, "sriov_numvfs", "64");

    assert_eq!(h.attr(NIC, "sriov_numvfs"), "64");
    assert_eq!(h.attr(NIC, "sriov_totalvfs"), "64");
    assert_eq!(h.attr(NIC, "sriov_drivers_autoprobe"), "0");
    assert_eq!(h.kernel.num_vfs(addr(NIC)), Some(64));

    let vfs = vf_addresses(&h, NIC, 64);
    assert_eq!(vfs[0], addr("0000:3b:02.0"), "offset 16, stride 1");
    assert_eq!(vfs[63], addr("0000:3b:09.7"));
    let vf_names: BTreeSet<String> = vfs.iter().map(|a| a.to_string()).collect();
    assert_eq!(vf_names.len(), 64);

    // Exactly the 64 VFs were added to the bus.
    let added: BTreeSet<String> = h.bus_devices().difference(&boot_devices).cloned().collect();
    assert_eq!(added, vf_names);

    let pf_dir = h.real_dir(NIC_PORT, NIC);
    assert_eq!(h.canon(&h.dev(NIC)), pf_dir);
    let mut vf_groups = BTreeSet::new();
    for (i, vf) in vfs.iter().enumerate() {
        let v = vf.to_string();
        let vf_dir = h.real_dir(NIC_PORT, &v);
        assert!(vf_dir.is_dir(), "{v}: no directory at {}", vf_dir.display());
        assert_eq!(h.canon(&h.dev(&v)), vf_dir, "bus link of {v}");
        assert_eq!(
            h.canon(&pf_dir.join(format!("virtfn{i}"))),
            vf_dir,
            "virtfn{i}"
        );
        assert_eq!(h.canon(&vf_dir.join("physfn")), pf_dir, "{v}/physfn");
        assert!(
            fs::read_link(vf_dir.join("physfn")).unwrap().is_relative(),
            "links are relative, as in sysfs"
        );

        // Own IOMMU group, new, containing exactly this VF (and resolving to it).
        let g = h.group(&v);
        assert!(!boot_groups.contains(&g), "{v} reuses boot group {g}");
        assert!(vf_groups.insert(g), "{v} shares group {g} with another VF");
        assert_eq!(h.group_members(g), BTreeSet::from([v.clone()]));
        assert_eq!(
            h.canon(&h.p(&format!("sys/kernel/iommu_groups/{g}/devices/{v}"))),
            vf_dir
        );

        // No driver: autoprobe is off.
        assert_eq!(h.driver_link(&v), None, "{v} must not be bound");
        assert_eq!(h.kernel.driver_of(*vf), None);
        assert_eq!(h.attr(&v, "driver_override"), "(null)");

        // Identity in the files and in uevent.
        assert_eq!(h.attr(&v, "vendor"), "0x8086");
        assert_eq!(h.attr(&v, "device"), "0x154c");
        let uevent = h.attr(&v, "uevent");
        let lines: BTreeSet<&str> = uevent.lines().collect();
        assert!(lines.contains("PCI_ID=8086:154C"), "{v} uevent: {uevent}");
        assert!(
            lines.contains(format!("PCI_SLOT_NAME={v}").as_str()),
            "{uevent}"
        );
        assert!(
            !uevent.contains("DRIVER="),
            "{v} uevent names a driver: {uevent}"
        );

        // And what the daemon's reader makes of it.
        let f = h.read(&v);
        assert_eq!((f.vendor_id, f.device_id), (0x8086, 0x154c));
        assert_eq!(f.driver, None);
        assert_eq!(f.driver_override, None);
        assert_eq!(f.physfn, Some(addr(NIC)));
        assert_eq!(f.iommu_group, Some(g));
        assert!(f.sriov.is_none(), "a VF is not SR-IOV capable");
    }
    assert!(!exists(&pf_dir.join("virtfn64")));
    assert_eq!(h.groups(), &boot_groups | &vf_groups);
    // Nothing bound to iavf, nothing bound to vfio-pci: no VFIO node for any group.
    assert!(names_in(&h.p("sys/bus/pci/drivers/iavf"))
        .iter()
        .all(|n| n.parse::<PciAddress>().is_err()));
    assert!(h.vfio_nodes().is_empty(), "{:?}", h.vfio_nodes());

    let pf = h.read(NIC);
    let sriov = pf.sriov.expect("PF shows SR-IOV");
    assert_eq!(sriov.total_vfs, 64);
    assert_eq!(sriov.num_vfs, 64);
    assert!(!sriov.drivers_autoprobe);
    assert_eq!(sriov.vfs, vfs);
    assert_eq!(sriov.vf_device_id, Some(0x154c));
    assert_eq!(
        pf.driver.as_deref(),
        Some("i40e"),
        "the PF keeps its driver"
    );
}

/// override + drivers_probe puts one VF on vfio-pci (its /dev/vfio node appears); numvfs 0
/// then removes every VF directory, link, group and VFIO node.
#[test]
fn vf_to_vfio_pci_then_restore_removes_everything() {
    let h = Host::reference();
    let boot_groups = h.groups();
    let boot_devices = h.bus_devices();
    let pf_dir = h.real_dir(NIC_PORT, NIC);

    let vfs = h.enable_unprobed_nic_vfs(64);
    let vf = vfs[5].clone();
    let g = h.group(&vf);
    let vf_groups: BTreeSet<u32> = vfs.iter().map(|a| h.group(a)).collect();

    h.set(&vf, "driver_override", "vfio-pci");
    assert_eq!(h.attr(&vf, "driver_override"), "vfio-pci");
    assert_eq!(
        h.driver_link(&vf),
        None,
        "setting the override alone binds nothing"
    );
    h.probe(&vf);

    assert_eq!(h.driver_link(&vf).as_deref(), Some("vfio-pci"));
    assert_eq!(
        h.canon(&h.p(&format!("sys/bus/pci/drivers/vfio-pci/{vf}"))),
        h.real_dir(NIC_PORT, &vf)
    );
    let f = h.read(&vf);
    assert_eq!(f.driver.as_deref(), Some("vfio-pci"));
    assert_eq!(f.driver_override.as_deref(), Some("vfio-pci"));
    assert!(h.attr(&vf, "uevent").contains("DRIVER=vfio-pci"));
    assert_eq!(
        h.vfio_nodes(),
        BTreeSet::from([g]),
        "exactly the VF's group node"
    );
    assert!(h.p(&format!("dev/vfio/{g}")).exists());
    for other in vfs.iter().filter(|a| a.to_string() != vf) {
        assert_eq!(
            h.kernel.driver_of(addr(other)),
            None,
            "{other} must stay unbound"
        );
    }

    // Restore.
    h.set(NIC, "sriov_numvfs", "0");
    assert_eq!(h.attr(NIC, "sriov_numvfs"), "0");
    assert_eq!(h.kernel.num_vfs(addr(NIC)), Some(0));
    assert_eq!(h.bus_devices(), boot_devices);
    assert_eq!(h.groups(), boot_groups);
    assert!(h.vfio_nodes().is_empty(), "{:?}", h.vfio_nodes());
    for (i, a) in vfs.iter().enumerate() {
        let v = a.to_string();
        assert!(!exists(&h.dev(&v)), "bus link of {v} left behind");
        assert!(
            !exists(&h.real_dir(NIC_PORT, &v)),
            "directory of {v} left behind"
        );
        assert!(
            !exists(&pf_dir.join(format!("virtfn{i}"))),
            "virtfn{i} left behind"
        );
        assert!(!exists(&h.p(&format!("sys/bus/pci/drivers/vfio-pci/{v}"))));
        assert!(!h.kernel.addresses().contains(&addr(a)));
    }
    for g in vf_groups {
        assert!(!exists(&h.p(&format!("sys/kernel/iommu_groups/{g}"))));
    }
    let pf = h.read(NIC);
    assert_eq!(pf.driver.as_deref(), Some("i40e"));
    assert_eq!(pf.sriov.unwrap().vfs, Vec::<PciAddress>::new());
    // And the PF can be split again from zero.
    h.set(NIC, "sriov_numvfs", "2");
    assert_eq!(h.bus_devices().len(), boot_devices.len() + 2);
}

/// With autoprobe left on, VFs bind to their native host driver at once.
#[test]
fn split_with_autoprobe_on_binds_native_vf_driver() {
    let h = Host::reference();
    assert_eq!(h.attr(FPGA, "sriov_drivers_autoprobe"), "1");
    h.set(FPGA, "sriov_numvfs", "4");
    let vfs = vf_addresses(&h, FPGA, 4);
    assert_eq!(vfs[0], addr("0000:af:00.1"));
    for a in &vfs {
        let v = a.to_string();
        assert_eq!(h.driver_link(&v).as_deref(), Some("dfl-pci"), "{v}");
        assert_eq!(h.attr(&v, "device"), "0x0b2c");
        assert!(exists(&h.p(&format!("sys/bus/pci/drivers/dfl-pci/{v}"))));
    }
    // The QAT booted split: its 16 VFs are on c6xxvf.
    let qat_vfs = vf_addresses(&h, QAT, 16);
    assert_eq!(h.read(QAT).sriov.unwrap().vfs, qat_vfs);
    for a in &qat_vfs {
        assert_eq!(h.driver_link(&a.to_string()).as_deref(), Some("c6xxvf"));
    }
}

// ----- 2. kernel errors ----------------------------------------------------------------------

#[test]
fn numvfs_nonzero_to_other_nonzero_is_ebusy_and_changes_nothing() {
    let h = Host::reference();
    let before = h.bus_devices();
    let qat_vfs = vf_addresses(&h, QAT, 16);

    assert_eq!(errno(h.try_set(QAT, "sriov_numvfs", "8")), libc::EBUSY);
    assert_eq!(errno(h.try_set(QAT, "sriov_numvfs", "15")), libc::EBUSY);
    assert_eq!(h.attr(QAT, "sriov_numvfs"), "16");
    assert_eq!(h.bus_devices(), before);
    assert_eq!(h.read(QAT).sriov.unwrap().vfs, qat_vfs);
    for a in &qat_vfs {
        assert_eq!(h.kernel.driver_of(*a).as_deref(), Some("c6xxvf"));
    }
    // Writing the current count is a no-op, not an error.
    h.set(QAT, "sriov_numvfs", "16");
    assert_eq!(h.bus_devices(), before);
    // 0 first, then the new count: accepted.
    h.set(QAT, "sriov_numvfs", "0");
    h.set(QAT, "sriov_numvfs", "8");
    assert_eq!(h.read(QAT).sriov.unwrap().vfs, vf_addresses(&h, QAT, 8));
}

#[test]
fn numvfs_above_total_is_erange() {
    let h = Host::reference();
    let before = h.bus_devices();
    assert_eq!(errno(h.try_set(NIC, "sriov_numvfs", "65")), libc::ERANGE);
    assert_eq!(errno(h.try_set(FPGA, "sriov_numvfs", "5")), libc::ERANGE);
    assert_eq!(h.attr(NIC, "sriov_numvfs"), "0");
    assert_eq!(h.attr(FPGA, "sriov_numvfs"), "0");
    assert_eq!(h.bus_devices(), before);
}

#[test]
fn numvfs_without_a_capable_pf_driver_is_enoent() {
    let h = Host::reference();
    let before = h.bus_devices();

    // No driver at all.
    h.drv("i40e", "unbind", NIC).unwrap();
    assert_eq!(h.driver_link(NIC), None);
    assert_eq!(errno(h.try_set(NIC, "sriov_numvfs", "4")), libc::ENOENT);
    assert_eq!(h.attr(NIC, "sriov_numvfs"), "0");
    assert_eq!(h.bus_devices(), before);

    // A driver without sriov_configure (pci-stub).
    h.set(NIC, "driver_override", "pci-stub");
    h.probe(NIC);
    assert_eq!(h.driver_link(NIC).as_deref(), Some("pci-stub"));
    assert_eq!(errno(h.try_set(NIC, "sriov_numvfs", "4")), libc::ENOENT);
    assert_eq!(h.bus_devices(), before);

    // Back on i40e, the same write works.
    h.set(NIC, "driver_override", "\n");
    h.drv("pci-stub", "unbind", NIC).unwrap();
    h.probe(NIC);
    assert_eq!(h.driver_link(NIC).as_deref(), Some("i40e"));
    h.set(NIC, "sriov_numvfs", "4");
    assert_eq!(h.bus_devices().len(), before.len() + 4);
}

#[test]
fn numvfs_garbage_is_einval() {
    let h = Host::reference();
    let before = h.bus_devices();
    for bad in ["four", "-1", "", "4 4", "0x"] {
        assert_eq!(
            errno(h.try_set(NIC, "sriov_numvfs", bad)),
            libc::EINVAL,
            "value {bad:?}"
        );
    }
    assert_eq!(
        errno(h.try_set(NIC, "sriov_drivers_autoprobe", "maybe")),
        libc::EINVAL
    );
    assert_eq!(h.attr(NIC, "sriov_numvfs"), "0");
    assert_eq!(h.attr(NIC, "sriov_drivers_autoprobe"), "1");
    assert_eq!(h.bus_devices(), before);
}

#[test]
fn read_only_attribute_write_is_eacces() {
    let h = Host::reference();
    for attr in ["vendor", "device", "class", "sriov_totalvfs", "numa_node"] {
        let before = h.attr(NIC, attr);
        assert_eq!(
            errno(h.try_set(NIC, attr, "0x1234")),
            libc::EACCES,
            "{attr}"
        );
        assert_eq!(h.attr(NIC, attr), before, "{attr} changed");
    }
    assert_eq!(h.read(NIC).device_id, 0x1572);
}

/// Real sysfs has no `sriov_numvfs` on a function without SR-IOV: open(2) fails with ENOENT.
#[test]
fn write_to_an_attribute_the_function_does_not_have_is_enoent() {
    let h = Host::reference();
    assert!(!exists(&h.dev(GPU).join("sriov_numvfs")));
    assert_eq!(errno(h.try_set(GPU, "sriov_numvfs", "1")), libc::ENOENT);
    assert_eq!(errno(h.try_set(GPU, "no_such_attr", "1")), libc::ENOENT);
    assert_eq!(
        errno(h.try_set(GPU, "sriov_drivers_autoprobe", "0")),
        libc::ENOENT
    );
    // A function that is not there at all.
    assert_eq!(
        errno(h.try_set("0000:99:00.0", "remove", "1")),
        libc::ENOENT
    );
    // A driver that is not loaded.
    assert_eq!(errno(h.drv("mlx5_core", "bind", NIC)), libc::ENOENT);
    assert!(
        !exists(&h.dev(GPU).join("no_such_attr")),
        "a write must not create files"
    );
    assert_eq!(h.driver_link(GPU).as_deref(), Some("nouveau"));
}

/// The testbed pitfall: with the PF's autoprobe off, even an explicit bind of a VF to its own
/// driver fails (ENODEV); with driver_override set, drivers_probe binds it.
#[test]
fn vf_explicit_bind_with_autoprobe_off_is_enodev_but_override_probe_works() {
    let h = Host::reference();
    let vfs = h.enable_unprobed_nic_vfs(4);

    assert_eq!(errno(h.drv("iavf", "bind", &vfs[0])), libc::ENODEV);
    assert_eq!(h.driver_link(&vfs[0]), None);
    assert!(!exists(
        &h.p(&format!("sys/bus/pci/drivers/iavf/{}", vfs[0]))
    ));
    // drivers_probe without an override finds nothing to bind: accepted, still unbound.
    h.probe(&vfs[0]);
    assert_eq!(h.driver_link(&vfs[0]), None);
    // Nor can vfio-pci take it without an override.
    assert_eq!(errno(h.drv("vfio-pci", "bind", &vfs[0])), libc::ENODEV);
    assert_eq!(h.driver_link(&vfs[0]), None);

    // The documented way: override, then drivers_probe.
    h.set(&vfs[0], "driver_override", "vfio-pci");
    h.probe(&vfs[0]);
    assert_eq!(h.driver_link(&vfs[0]).as_deref(), Some("vfio-pci"));

    // With an override the VF may be probed at all, so an explicit bind to the override's
    // driver works too; binding to another driver still does not match.
    h.set(&vfs[1], "driver_override", "iavf");
    assert_eq!(errno(h.drv("vfio-pci", "bind", &vfs[1])), libc::ENODEV);
    h.drv("iavf", "bind", &vfs[1]).unwrap();
    assert_eq!(h.driver_link(&vfs[1]).as_deref(), Some("iavf"));
    // The others are untouched.
    assert_eq!(h.driver_link(&vfs[2]), None);
    assert_eq!(h.driver_link(&vfs[3]), None);
}

#[test]
fn binding_a_bound_device_is_ebusy() {
    let h = Host::reference();
    assert_eq!(errno(h.drv("nvme", "bind", DATA_NVME)), libc::EBUSY);
    assert_eq!(h.driver_link(DATA_NVME).as_deref(), Some("nvme"));
    // With an override naming vfio-pci, vfio-pci matches but the device is still taken.
    h.set(DATA_NVME, "driver_override", "vfio-pci");
    assert_eq!(errno(h.drv("vfio-pci", "bind", DATA_NVME)), libc::EBUSY);
    assert_eq!(h.driver_link(DATA_NVME).as_deref(), Some("nvme"));
    assert!(!exists(
        &h.p(&format!("sys/bus/pci/drivers/vfio-pci/{DATA_NVME}"))
    ));
}

/// Linux checks that the driver matches before it looks at the device's current driver:
/// a driver that does not match gets ENODEV even when the device is bound elsewhere.
#[test]
fn binding_to_a_non_matching_driver_is_enodev() {
    let h = Host::reference();
    assert_eq!(errno(h.drv("vfio-pci", "bind", DATA_NVME)), libc::ENODEV);
    assert_eq!(errno(h.drv("igc", "bind", DATA_NVME)), libc::ENODEV);
    h.drv("nvme", "unbind", DATA_NVME).unwrap();
    assert_eq!(errno(h.drv("igc", "bind", DATA_NVME)), libc::ENODEV);
    assert_eq!(errno(h.drv("vfio-pci", "bind", DATA_NVME)), libc::ENODEV);
    assert_eq!(errno(h.drv("nvme", "bind", "0000:99:00.0")), libc::ENODEV);
    assert_eq!(errno(h.drv("nvme", "bind", "garbage")), libc::ENODEV);
    assert_eq!(h.driver_link(DATA_NVME), None);
    h.drv("nvme", "bind", DATA_NVME).unwrap();
    assert_eq!(h.driver_link(DATA_NVME).as_deref(), Some("nvme"));
}

#[test]
fn unbind_from_a_driver_it_is_not_bound_to_is_enodev() {
    let h = Host::reference();
    assert_eq!(errno(h.drv("vfio-pci", "unbind", DATA_NVME)), libc::ENODEV);
    assert_eq!(errno(h.drv("igc", "unbind", DATA_NVME)), libc::ENODEV);
    assert_eq!(h.driver_link(DATA_NVME).as_deref(), Some("nvme"));
    assert!(exists(
        &h.p(&format!("sys/bus/pci/drivers/nvme/{DATA_NVME}"))
    ));
    h.drv("nvme", "unbind", DATA_NVME).unwrap();
    assert_eq!(h.driver_link(DATA_NVME), None);
    assert!(!exists(
        &h.p(&format!("sys/bus/pci/drivers/nvme/{DATA_NVME}"))
    ));
    assert!(!h.attr(DATA_NVME, "uevent").contains("DRIVER="));
    // Unbinding an unbound device: ENODEV too.
    assert_eq!(errno(h.drv("nvme", "unbind", DATA_NVME)), libc::ENODEV);
}

/// Unbinding a PF driver tears its VFs down (the driver's remove() disables SR-IOV).
#[test]
fn unbinding_a_pf_driver_removes_its_vfs() {
    let h = Host::reference();
    let qat_vfs = vf_addresses(&h, QAT, 16);
    h.drv("c6xx", "unbind", QAT).unwrap();
    assert_eq!(h.attr(QAT, "sriov_numvfs"), "0");
    for a in &qat_vfs {
        assert!(
            !exists(&h.dev(&a.to_string())),
            "{a} survived its PF's unbind"
        );
    }
    assert!(!exists(&h.dev(QAT).join("virtfn0")));
}

/// `new_id` binds every unbound device with those ids: the collateral damage design.md warns of.
#[test]
fn new_id_binds_every_matching_unbound_device() {
    let h = Host::reference();
    h.set(NIC, "sriov_numvfs", "4");
    let vfs: Vec<String> = vf_addresses(&h, NIC, 4)
        .iter()
        .map(|a| a.to_string())
        .collect();
    for v in &vfs {
        assert_eq!(h.driver_link(v).as_deref(), Some("iavf"), "autoprobe on");
    }
    h.drv("iavf", "unbind", &vfs[1]).unwrap();
    h.drv("iavf", "unbind", &vfs[2]).unwrap();
    h.drv("vfio-pci", "new_id", "8086 154c").unwrap();
    assert_eq!(h.driver_link(&vfs[0]).as_deref(), Some("iavf"));
    assert_eq!(h.driver_link(&vfs[1]).as_deref(), Some("vfio-pci"));
    assert_eq!(h.driver_link(&vfs[2]).as_deref(), Some("vfio-pci"));
    assert_eq!(h.driver_link(&vfs[3]).as_deref(), Some("iavf"));
    assert_eq!(
        errno(h.drv("vfio-pci", "new_id", "zzzz 154c")),
        libc::EINVAL
    );
}

// ----- 3. the GPU's IOMMU group ------------------------------------------------------------

#[test]
fn gpu_group_is_viable_only_when_every_member_is_off_host_drivers() {
    let h = Host::reference();
    let g = h.group(GPU);
    assert_eq!(h.group(AUDIO), g, "GPU and HDMI audio share a group");
    assert_eq!(
        h.group_members(g),
        BTreeSet::from([GPU.to_string(), AUDIO.to_string()])
    );
    assert!(h.vfio_nodes().is_empty());

    // The GPU alone on vfio-pci while the audio is still on its host driver: not viable.
    h.drv("nouveau", "unbind", GPU).unwrap();
    h.set(GPU, "driver_override", "vfio-pci");
    h.set(AUDIO, "driver_override", "vfio-pci");
    h.probe(GPU);
    assert_eq!(h.driver_link(GPU).as_deref(), Some("vfio-pci"));
    assert_eq!(h.driver_link(AUDIO).as_deref(), Some("snd_hda_intel"));
    assert!(
        !h.p(&format!("dev/vfio/{g}")).exists(),
        "group {g} has a member on snd_hda_intel: no VFIO node"
    );

    // Both on vfio-pci: viable.
    h.drv("snd_hda_intel", "unbind", AUDIO).unwrap();
    h.probe(AUDIO);
    assert_eq!(h.driver_link(AUDIO).as_deref(), Some("vfio-pci"));
    assert_eq!(h.vfio_nodes(), BTreeSet::from([g]));
    for a in [GPU, AUDIO] {
        let f = h.read(a);
        assert_eq!(f.driver.as_deref(), Some("vfio-pci"), "{a}");
        assert_eq!(f.driver_override.as_deref(), Some("vfio-pci"), "{a}");
        assert_eq!(f.iommu_group, Some(g));
    }

    // Back: clear the overrides, unbind, reprobe.
    for (a, native) in [(GPU, "nouveau"), (AUDIO, "snd_hda_intel")] {
        h.set(a, "driver_override", "\n");
        assert_eq!(h.attr(a, "driver_override"), "(null)");
        h.drv("vfio-pci", "unbind", a).unwrap();
        h.probe(a);
        assert_eq!(h.driver_link(a).as_deref(), Some(native), "{a}");
        assert_eq!(h.read(a).driver_override, None);
    }
    assert!(h.vfio_nodes().is_empty(), "{:?}", h.vfio_nodes());
    assert!(names_in(&h.p("sys/bus/pci/drivers/vfio-pci"))
        .iter()
        .all(|n| n.parse::<PciAddress>().is_err()));
}

/// pci-stub and "no driver" do not spoil a group's viability; they do not make one either.
#[test]
fn group_with_pci_stub_or_unbound_member_is_viable() {
    let h = Host::reference();
    let g = h.group(GPU);
    h.drv("nouveau", "unbind", GPU).unwrap();
    h.drv("snd_hda_intel", "unbind", AUDIO).unwrap();
    assert!(h.vfio_nodes().is_empty(), "nothing on vfio-pci yet");

    h.set(AUDIO, "driver_override", "pci-stub");
    h.probe(AUDIO);
    assert_eq!(h.driver_link(AUDIO).as_deref(), Some("pci-stub"));
    assert!(
        h.vfio_nodes().is_empty(),
        "pci-stub alone creates no VFIO node"
    );

    h.set(GPU, "driver_override", "vfio-pci");
    h.probe(GPU);
    assert_eq!(h.vfio_nodes(), BTreeSet::from([g]), "vfio-pci + pci-stub");

    h.drv("pci-stub", "unbind", AUDIO).unwrap();
    assert_eq!(h.vfio_nodes(), BTreeSet::from([g]), "vfio-pci + no driver");

    // A host driver grabbing the audio function makes the group unusable again.
    h.set(AUDIO, "driver_override", "\n");
    h.probe(AUDIO);
    assert_eq!(h.driver_link(AUDIO).as_deref(), Some("snd_hda_intel"));
    assert!(h.vfio_nodes().is_empty(), "{:?}", h.vfio_nodes());
}

// ----- 4. remove, rescan, uevents ----------------------------------------------------------

#[test]
fn remove_and_rescan_data_nvme_with_uevents() {
    let h = Host::reference();
    let mut rx = h.kernel.subscribe();
    let g = h.group(DATA_NVME);
    let dir = h.real_dir(DATA_NVME_PORT, DATA_NVME);
    assert_eq!(h.canon(&h.dev(DATA_NVME)), dir);

    h.set(DATA_NVME, "remove", "1");
    assert!(!exists(&h.dev(DATA_NVME)));
    assert!(!exists(&dir));
    assert!(!exists(
        &h.p(&format!("sys/bus/pci/drivers/nvme/{DATA_NVME}"))
    ));
    assert!(!exists(&h.p(&format!("sys/kernel/iommu_groups/{g}"))));
    assert!(!h.kernel.addresses().contains(&addr(DATA_NVME)));
    assert!(!h.sysfs.list_functions().unwrap().contains(&addr(DATA_NVME)));
    let e = h.sysfs.read_function(addr(DATA_NVME)).unwrap_err();
    assert!(e.is_not_found(), "{}", vfiod::error_chain(&e));
    // The boot NVMe and the port are untouched.
    assert_eq!(h.driver_link(BOOT_NVME).as_deref(), Some("nvme"));
    assert!(exists(&h.dev(DATA_NVME_PORT)));

    let removed = drain(&mut rx);
    assert_eq!(
        actions(&removed),
        vec![
            (Action::Unbind, DATA_NVME.to_string()),
            (Action::Remove, DATA_NVME.to_string())
        ]
    );
    let rm = &removed[1];
    assert_eq!(rm.pci_address(), Some(addr(DATA_NVME)));
    assert_eq!(rm.subsystem(), Some("pci"));
    assert_eq!(
        rm.devpath,
        format!("/devices/pci0000:00/{DATA_NVME_PORT}/{DATA_NVME}")
    );

    h.bus("rescan", "1").unwrap();
    assert_eq!(h.canon(&h.dev(DATA_NVME)), dir);
    assert_eq!(h.driver_link(DATA_NVME).as_deref(), Some("nvme"));
    let f = h.read(DATA_NVME);
    assert_eq!((f.vendor_id, f.device_id), (0x144d, 0xa824));
    assert_eq!(f.driver.as_deref(), Some("nvme"));
    let g2 = h.group(DATA_NVME);
    assert_eq!(h.group_members(g2), BTreeSet::from([DATA_NVME.to_string()]));

    let added = drain(&mut rx);
    assert_eq!(
        actions(&added),
        vec![
            (Action::Add, DATA_NVME.to_string()),
            (Action::Bind, DATA_NVME.to_string())
        ]
    );
    assert_eq!(
        added[1].vars.get("DRIVER").map(String::as_str),
        Some("nvme")
    );
    // Sequence numbers only grow.
    let seq: Vec<u64> = removed
        .iter()
        .chain(&added)
        .map(|e| e.vars["SEQNUM"].parse().unwrap())
        .collect();
    assert!(seq.windows(2).all(|w| w[0] < w[1]), "{seq:?}");

    // A second rescan has nothing to bring back.
    h.bus("rescan", "1").unwrap();
    assert!(drain(&mut rx).is_empty());
}

#[test]
fn remove_and_rescan_qat_pf_with_vfs_enabled() {
    let h = Host::reference();
    let boot_devices = h.bus_devices();
    let qat_vfs = vf_addresses(&h, QAT, 16);
    let vf_groups: Vec<u32> = qat_vfs.iter().map(|a| h.group(&a.to_string())).collect();
    let mut rx = h.kernel.subscribe();

    h.set(QAT, "remove", "1");
    assert!(!exists(&h.dev(QAT)));
    for (a, g) in qat_vfs.iter().zip(&vf_groups) {
        let v = a.to_string();
        assert!(!exists(&h.dev(&v)), "{v}");
        assert!(!exists(&h.real_dir("0000:00:03.0", &v)), "{v}");
        assert!(!exists(&h.p(&format!("sys/bus/pci/drivers/c6xxvf/{v}"))));
        assert!(!exists(&h.p(&format!("sys/kernel/iommu_groups/{g}"))));
    }
    assert_eq!(h.bus_devices().len(), boot_devices.len() - 17);

    let events = drain(&mut rx);
    let removes: Vec<String> = actions(&events)
        .into_iter()
        .filter(|(a, _)| *a == Action::Remove)
        .map(|(_, s)| s)
        .collect();
    let mut expected: BTreeSet<String> = qat_vfs.iter().map(|a| a.to_string()).collect();
    expected.insert(QAT.to_string());
    assert_eq!(removes.iter().cloned().collect::<BTreeSet<_>>(), expected);
    assert_eq!(removes.len(), 17, "one remove each: {removes:?}");
    assert_eq!(
        removes.last().map(String::as_str),
        Some(QAT),
        "VFs go before their PF"
    );
    for e in events.iter().filter(|e| e.action == Action::Remove) {
        let slot = &e.vars["PCI_SLOT_NAME"];
        assert!(e.devpath.ends_with(&format!("/{slot}")), "{e:?}");
    }

    h.bus("rescan", "1").unwrap();
    assert_eq!(h.driver_link(QAT).as_deref(), Some("c6xx"));
    assert_eq!(
        h.attr(QAT, "sriov_numvfs"),
        "0",
        "VFs do not come back by themselves"
    );
    assert_eq!(h.attr(QAT, "sriov_drivers_autoprobe"), "1");
    assert!(!exists(&h.dev(QAT).join("virtfn0")));
    for a in &qat_vfs {
        assert!(!exists(&h.dev(&a.to_string())));
    }
    let sriov = h.read(QAT).sriov.unwrap();
    assert_eq!((sriov.num_vfs, sriov.total_vfs), (0, 16));
    assert!(sriov.vfs.is_empty());
    assert_eq!(h.bus_devices().len(), boot_devices.len() - 16);

    let back = actions(&drain(&mut rx));
    assert_eq!(
        back,
        vec![
            (Action::Add, QAT.to_string()),
            (Action::Bind, QAT.to_string())
        ]
    );
    // It can be split again.
    h.set(QAT, "sriov_numvfs", "2");
    assert_eq!(h.bus_devices().len(), boot_devices.len() - 14);
}

/// Removing a root port takes what is behind it; rescan restores parent before child.
#[test]
fn remove_root_port_takes_its_children_and_rescan_restores_them() {
    let h = Host::reference();
    let mut rx = h.kernel.subscribe();
    h.set(DATA_NVME_PORT, "remove", "1");
    assert!(!exists(&h.dev(DATA_NVME)));
    assert!(!exists(&h.dev(DATA_NVME_PORT)));
    let removes: Vec<String> = actions(&drain(&mut rx))
        .into_iter()
        .filter(|(a, _)| *a == Action::Remove)
        .map(|(_, s)| s)
        .collect();
    assert_eq!(
        removes,
        vec![DATA_NVME.to_string(), DATA_NVME_PORT.to_string()]
    );

    h.bus("rescan", "1").unwrap();
    assert_eq!(
        h.canon(&h.dev(DATA_NVME)),
        h.real_dir(DATA_NVME_PORT, DATA_NVME)
    );
    assert_eq!(h.driver_link(DATA_NVME).as_deref(), Some("nvme"));
    assert_eq!(h.driver_link(DATA_NVME_PORT).as_deref(), Some("pcieport"));
    let adds: Vec<String> = actions(&drain(&mut rx))
        .into_iter()
        .filter(|(a, _)| *a == Action::Add)
        .map(|(_, s)| s)
        .collect();
    assert_eq!(
        adds,
        vec![DATA_NVME_PORT.to_string(), DATA_NVME.to_string()]
    );
}

#[test]
fn hot_add_and_aer_error_emit_events_and_update_files() {
    let h = Host::reference();
    let mut rx = h.kernel.subscribe();

    let spec = FunctionSpec::new("0000:d8:00.1", 0x144d, 0xa824, 0x010802)
        .driver("nvme")
        .under(DATA_NVME_PORT);
    h.kernel.hot_add(spec).unwrap();
    assert_eq!(h.driver_link("0000:d8:00.1").as_deref(), Some("nvme"));
    assert_eq!(
        actions(&drain(&mut rx)),
        vec![
            (Action::Add, "0000:d8:00.1".to_string()),
            (Action::Bind, "0000:d8:00.1".to_string())
        ]
    );

    h.kernel.aer_error(addr(DATA_NVME), true, true).unwrap();
    assert!(h
        .attr(DATA_NVME, "aer_dev_fatal")
        .contains("TOTAL_ERR_FATAL 1"));
    let evs = drain(&mut rx);
    let aer: Vec<_> = evs.iter().map(|e| (e.action, e.aer_event())).collect();
    assert_eq!(
        aer,
        vec![
            (Action::Change, Some(("BEGIN_RECOVERY", Some(false)))),
            (Action::Change, Some(("SUCCESSFUL_RECOVERY", Some(true)))),
        ]
    );
    h.kernel.aer_error(addr(DATA_NVME), false, false).unwrap();
    assert!(h
        .attr(DATA_NVME, "aer_dev_nonfatal")
        .contains("TOTAL_ERR_NONFATAL 1"));
    assert_eq!(
        drain(&mut rx).last().and_then(|e| e.aer_event()),
        Some(("FAILED_RECOVERY", Some(false)))
    );
}

// ----- 5. faults -----------------------------------------------------------------------------

#[test]
fn errno_fault_fails_the_write_and_leaves_state_unchanged() {
    let h = Host::reference();
    let before = h.bus_devices();
    h.kernel.inject(
        FaultTarget::DeviceAttr(addr(NIC), "sriov_numvfs".into()),
        FaultAction::Errno(libc::EIO),
        None,
    );
    for _ in 0..3 {
        assert_eq!(errno(h.try_set(NIC, "sriov_numvfs", "8")), libc::EIO);
    }
    assert_eq!(h.attr(NIC, "sriov_numvfs"), "0");
    assert_eq!(h.bus_devices(), before);
    assert_eq!(h.kernel.num_vfs(addr(NIC)), Some(0));
    // Only the targeted attribute is affected.
    h.set(NIC, "sriov_drivers_autoprobe", "0");
    h.set(FPGA, "sriov_numvfs", "1");

    h.kernel.clear_faults();
    h.set(NIC, "sriov_numvfs", "8");
    assert_eq!(h.kernel.num_vfs(addr(NIC)), Some(8));
}

#[test]
fn fault_targets_match_only_their_writes() {
    let h = Host::reference();
    let vfs = h.enable_unprobed_nic_vfs(2);
    for v in &vfs {
        h.set(v, "driver_override", "vfio-pci");
    }
    // AnyFor: a bus write naming that VF fails, the same write for another VF does not.
    h.kernel.inject(
        FaultTarget::AnyFor(addr(&vfs[0])),
        FaultAction::Errno(libc::EIO),
        None,
    );
    assert_eq!(errno(h.bus("drivers_probe", &vfs[0])), libc::EIO);
    assert_eq!(h.driver_link(&vfs[0]), None);
    h.probe(&vfs[1]);
    assert_eq!(h.driver_link(&vfs[1]).as_deref(), Some("vfio-pci"));
    h.kernel.clear_faults();

    // DriverAttr with a driver name: only that driver's attribute.
    h.kernel.inject(
        FaultTarget::DriverAttr(Some("vfio-pci".into()), "unbind".into()),
        FaultAction::Errno(libc::EBUSY),
        None,
    );
    assert_eq!(errno(h.drv("vfio-pci", "unbind", &vfs[1])), libc::EBUSY);
    assert_eq!(h.driver_link(&vfs[1]).as_deref(), Some("vfio-pci"));
    h.drv("nvme", "unbind", DATA_NVME).unwrap();
    h.kernel.clear_faults();

    // DriverAttr without a driver name: every driver's attribute.
    h.kernel.inject(
        FaultTarget::DriverAttr(None, "bind".into()),
        FaultAction::Errno(libc::EPERM),
        None,
    );
    assert_eq!(errno(h.drv("nvme", "bind", DATA_NVME)), libc::EPERM);
    assert_eq!(errno(h.drv("vfio-pci", "bind", &vfs[0])), libc::EPERM);
    assert_eq!(h.driver_link(DATA_NVME), None);
    assert_eq!(h.driver_link(&vfs[0]), None);
    h.kernel.clear_faults();

    // BusAttr.
    h.kernel.inject(
        FaultTarget::BusAttr("drivers_probe".into()),
        FaultAction::Errno(libc::EAGAIN),
        None,
    );
    assert_eq!(errno(h.bus("drivers_probe", DATA_NVME)), libc::EAGAIN);
    assert_eq!(h.driver_link(DATA_NVME), None);
    h.drv("nvme", "bind", DATA_NVME).unwrap();
}

#[test]
fn counted_faults_fire_only_that_many_times() {
    let h = Host::reference();
    h.kernel.inject(
        FaultTarget::DeviceAttr(addr(NIC), "sriov_drivers_autoprobe".into()),
        FaultAction::Errno(libc::EIO),
        Some(1),
    );
    assert_eq!(
        errno(h.try_set(NIC, "sriov_drivers_autoprobe", "0")),
        libc::EIO
    );
    assert_eq!(h.attr(NIC, "sriov_drivers_autoprobe"), "1");
    h.set(NIC, "sriov_drivers_autoprobe", "0");
    assert_eq!(h.attr(NIC, "sriov_drivers_autoprobe"), "0");
    h.set(NIC, "sriov_drivers_autoprobe", "1");

    h.drv("nvme", "unbind", DATA_NVME).unwrap();
    h.kernel.inject(
        FaultTarget::BusAttr("drivers_probe".into()),
        FaultAction::Errno(libc::EAGAIN),
        Some(2),
    );
    assert_eq!(errno(h.bus("drivers_probe", DATA_NVME)), libc::EAGAIN);
    assert_eq!(errno(h.bus("drivers_probe", DATA_NVME)), libc::EAGAIN);
    assert_eq!(h.driver_link(DATA_NVME), None);
    h.probe(DATA_NVME);
    assert_eq!(h.driver_link(DATA_NVME).as_deref(), Some("nvme"));
}

/// `times: Some(0)` means "the next 0 writes": it never fires (and must not break the kernel).
#[test]
fn fault_with_zero_times_never_fires() {
    let h = Host::reference();
    h.kernel.inject(
        FaultTarget::DeviceAttr(addr(NIC), "sriov_drivers_autoprobe".into()),
        FaultAction::Errno(libc::EIO),
        Some(0),
    );
    h.set(NIC, "sriov_drivers_autoprobe", "0");
    assert_eq!(h.attr(NIC, "sriov_drivers_autoprobe"), "0");
    h.set(NIC, "sriov_drivers_autoprobe", "1");
    assert_eq!(h.attr(NIC, "sriov_drivers_autoprobe"), "1");
}

/// The reference host with a 200 ms write timeout, where the next unbind from nvme hangs (for
/// two minutes, or until released).
fn host_with_a_hung_nvme_unbind() -> (Host, Sysfs) {
    let h = Host::reference();
    let sysfs = h
        .sysfs
        .clone()
        .with_write_timeout(Duration::from_millis(200));
    h.kernel.inject(
        FaultTarget::DriverAttr(Some("nvme".into()), "unbind".into()),
        FaultAction::Hang(Duration::from_secs(120)),
        Some(1),
    );
    (h, sysfs)
}

#[test]
fn hung_write_times_out_quickly_and_blocks_nothing_else() {
    let (h, sysfs) = host_with_a_hung_nvme_unbind();
    let unbind = sysfs.driver_dir("nvme").join("unbind");

    let t = Instant::now();
    let r = sysfs.write(&unbind, DATA_NVME);
    let took = t.elapsed();
    match &r {
        Err(SysfsError::WriteTimeout { timeout, .. }) => {
            assert_eq!(*timeout, Duration::from_millis(200))
        }
        other => panic!("expected WriteTimeout, got {other:?}"),
    }
    // It gave up at its timeout, not at the hang's end: the hang (120 s) still holds. That is
    // the claim, whatever the machine's load (it used to be "under 2 s", a race).
    assert!(
        took >= Duration::from_millis(200),
        "returned before the timeout: {took:?}"
    );
    assert_eq!(
        h.kernel.hanging(),
        1,
        "the hung unbind is still in the kernel"
    );

    // While that write is still stuck in the "kernel": another write, reads and the test
    // views all work (no lock is held across the hang): they end while the hang still holds.
    let s = sysfs.clone();
    within(
        common::HUNG,
        "a second write while the first hangs",
        move || s.write_device_attr(addr(NIC), "sriov_drivers_autoprobe", "0"),
    )
    .expect("a second write while the first hangs");
    assert_eq!(
        h.kernel.hanging(),
        1,
        "the second write waited for the hang"
    );
    assert_eq!(h.attr(NIC, "sriov_drivers_autoprobe"), "0");
    let k = Arc::clone(&h.kernel);
    let s = sysfs.clone();
    let (drv, f) = within(common::HUNG, "reads during a hang", move || {
        (
            k.driver_of(addr(DATA_NVME)),
            s.read_function(addr(DATA_NVME)).map(|f| f.driver),
        )
    });
    assert_eq!(
        drv.as_deref(),
        Some("nvme"),
        "the hung unbind has not happened"
    );
    assert_eq!(f.unwrap().as_deref(), Some("nvme"));

    h.kernel.release_hangs();
    // The fault was `Some(1)`: the same unbind now goes through.
    sysfs
        .write(&unbind, DATA_NVME)
        .expect("unbind after release");
    assert_eq!(h.driver_link(DATA_NVME), None);
}

/// A released hang ends the write with EINTR and without effect.
#[test]
fn released_hang_fails_with_eintr_and_no_effect() {
    let h = Host::reference();
    h.kernel.inject(
        FaultTarget::DeviceAttr(addr(NIC), "sriov_numvfs".into()),
        FaultAction::Hang(Duration::from_secs(120)),
        None,
    );
    let backend = Arc::clone(h.sysfs.backend());
    let path = h.sysfs.device_attr(addr(NIC), "sriov_numvfs");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(backend.write(&path, b"4"));
    });
    // The write reaches its hang (the kernel counts it) and has not returned by itself: no
    // window of silence, the state says so.
    common::eventually_blocking(common::HUNG, "the write reaches its hang", || {
        (h.kernel.hanging() == 1).then_some(())
    });
    assert!(rx.try_recv().is_err(), "the write should be hanging");
    h.kernel.release_hangs();
    let r = rx
        .recv_timeout(common::HUNG)
        .expect("release_hangs must wake the write");
    assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EINTR));
    assert_eq!(h.attr(NIC, "sriov_numvfs"), "0");
    assert!(h.kernel.take_write_log().is_empty());
}

#[test]
fn vanish_after_write_removes_the_device() {
    let h = Host::reference();
    let mut rx = h.kernel.subscribe();
    h.kernel.inject(
        FaultTarget::DeviceAttr(addr(DATA_NVME), "driver_override".into()),
        FaultAction::VanishAfter(addr(DATA_NVME)),
        Some(1),
    );
    h.set(DATA_NVME, "driver_override", "vfio-pci");
    assert!(!exists(&h.dev(DATA_NVME)));
    assert!(!exists(&h.real_dir(DATA_NVME_PORT, DATA_NVME)));
    assert!(!h.kernel.addresses().contains(&addr(DATA_NVME)));
    assert!(h
        .sysfs
        .read_function(addr(DATA_NVME))
        .unwrap_err()
        .is_not_found());
    // The write itself was accepted, then the device went.
    let log = h.kernel.take_write_log();
    assert_eq!(log.len(), 1, "{log:?}");
    assert!(log[0].0.ends_with(format!("{DATA_NVME}/driver_override")));
    assert!(drain(&mut rx)
        .iter()
        .any(|e| e.action == Action::Remove && e.pci_address() == Some(addr(DATA_NVME))));
    // Further writes to it fail: the directory is gone.
    assert_eq!(
        errno(h.try_set(DATA_NVME, "driver_override", "")),
        libc::ENOENT
    );

    // It comes back on a rescan, as a new device: native driver, no override.
    h.bus("rescan", "1").unwrap();
    assert_eq!(h.driver_link(DATA_NVME).as_deref(), Some("nvme"));
    assert_eq!(h.read(DATA_NVME).driver_override, None);
}

#[test]
fn unreadable_attribute_makes_read_function_fail_with_that_errno() {
    let h = Host::reference();
    h.kernel.make_unreadable(addr(NIC), "config", libc::EIO);
    let e = h.sysfs.read_function(addr(NIC)).unwrap_err();
    assert_eq!(e.errno(), Some(libc::EIO), "{}", vfiod::error_chain(&e));
    assert!(!e.is_not_found());
    // Other functions still read.
    h.read(GPU);
    h.read(QAT);

    // A link, too.
    h.kernel
        .make_unreadable(addr(GPU), "iommu_group", libc::EACCES);
    let e = h.sysfs.read_function(addr(GPU)).unwrap_err();
    assert_eq!(e.errno(), Some(libc::EACCES), "{}", vfiod::error_chain(&e));

    h.kernel.make_readable(addr(NIC), "config");
    h.kernel.make_readable(addr(GPU), "iommu_group");
    assert_eq!(h.read(NIC).device_id, 0x1572);
    assert_eq!(h.read(GPU).iommu_group, Some(h.group(GPU)));
}

#[test]
fn config_all_ones_is_reported_as_such() {
    let h = Host::reference();
    h.kernel.set_config_all_ones(addr(GPU), true).unwrap();
    let config = fs::read(h.dev(GPU).join("config")).unwrap();
    assert!(config.iter().all(|&b| b == 0xff));
    match h.sysfs.read_function(addr(GPU)) {
        Err(SysfsError::ConfigAllOnes { path }) => assert_eq!(path, h.dev(GPU).join("config")),
        other => panic!("expected ConfigAllOnes, got {other:?}"),
    }
    // Its group peer is fine; a VF (whose ids legitimately read 0xffff) is not "gone".
    h.read(AUDIO);
    let qat_vf = vf_addresses(&h, QAT, 1)[0];
    let vf_config = fs::read(h.sysfs.device_attr(qat_vf, "config")).unwrap();
    assert_eq!(
        &vf_config[0..4],
        &[0xff; 4],
        "VF id registers read all-ones"
    );
    assert_eq!(h.read(&qat_vf.to_string()).device_id, 0x37c9);

    h.kernel.set_config_all_ones(addr(GPU), false).unwrap();
    assert_eq!(h.read(GPU).vendor_id, 0x10de);
    assert_eq!(
        h.kernel
            .set_config_all_ones(addr("0000:99:00.0"), true)
            .unwrap_err()
            .raw_os_error(),
        Some(libc::ENODEV)
    );
}

// ----- 6. write log --------------------------------------------------------------------------

#[test]
fn write_log_lists_exactly_the_accepted_writes() {
    let h = Host::reference();
    assert!(
        h.kernel.take_write_log().is_empty(),
        "boot writes are not logged"
    );
    let rel = |p: PathBuf| h.canon(&p).strip_prefix(h.root()).unwrap().to_path_buf();
    let nic_dir = rel(h.dev(NIC));
    let vf = vf_addresses(&h, NIC, 1)[0].to_string();

    h.set(NIC, "sriov_drivers_autoprobe", "0"); // accepted
    assert!(h.try_set(NIC, "sriov_numvfs", "65").is_err()); // ERANGE
    assert!(h.try_set(NIC, "vendor", "0x1").is_err()); // EACCES
    h.set(NIC, "sriov_numvfs", "2"); // accepted
    assert!(h.drv("iavf", "bind", &vf).is_err()); // ENODEV
    h.kernel.inject(
        FaultTarget::DeviceAttr(vf.parse().unwrap(), "driver_override".into()),
        FaultAction::Errno(libc::EIO),
        Some(1),
    );
    assert!(h.try_set(&vf, "driver_override", "vfio-pci").is_err()); // injected EIO
    h.set(&vf, "driver_override", "vfio-pci"); // accepted
    h.probe(&vf); // accepted
    assert!(h.drv("nvme", "bind", DATA_NVME).is_err()); // EBUSY

    let vf_dir = rel(h.dev(&vf));
    let log = h.kernel.take_write_log();
    let expected: Vec<(PathBuf, String)> = vec![
        (nic_dir.join("sriov_drivers_autoprobe"), "0".into()),
        (nic_dir.join("sriov_numvfs"), "2".into()),
        (vf_dir.join("driver_override"), "vfio-pci".into()),
        (PathBuf::from("sys/bus/pci/drivers_probe"), vf.clone()),
    ];
    assert_eq!(log, expected);
    assert!(
        h.kernel.take_write_log().is_empty(),
        "taking the log empties it"
    );
    assert_eq!(h.driver_link(&vf).as_deref(), Some("vfio-pci"));
}

// ----- 7. lspci --------------------------------------------------------------------------------

/// lspci -D -nn -k blocks: the device line, then indented detail lines.
fn lspci_blocks(out: &str) -> Vec<(String, Vec<String>)> {
    let mut blocks: Vec<(String, Vec<String>)> = Vec::new();
    for line in out.lines() {
        if line.starts_with(char::is_whitespace) {
            if let Some(b) = blocks.last_mut() {
                b.1.push(line.trim().to_string());
            }
        } else if !line.is_empty() {
            blocks.push((line.to_string(), Vec::new()));
        }
    }
    blocks
}

#[test]
fn lspci_sees_the_split_tree() {
    let h = Host::reference();
    h.set(NIC, "sriov_drivers_autoprobe", "0");
    h.set(NIC, "sriov_numvfs", "64");
    let vfs = vf_addresses(&h, NIC, 64);
    let bound = vfs[0].to_string();
    h.set(&bound, "driver_override", "vfio-pci");
    h.probe(&bound);

    let out = match std::process::Command::new("lspci")
        .arg("-A")
        .arg("linux-sysfs")
        .arg("-O")
        .arg(format!("sysfs.path={}", h.p("sys/bus/pci").display()))
        .args(["-nn", "-D", "-k"])
        .output()
    {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!(
                "SKIPPED lspci_sees_the_split_tree: lspci is not installed (install pciutils)"
            );
            println!("SKIPPED lspci_sees_the_split_tree: lspci is not installed");
            return;
        }
        Err(e) => panic!("running lspci: {e}"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "lspci failed: {stderr}");
    let blocks = lspci_blocks(&stdout);

    // lspci lists exactly what the bus lists.
    let listed: BTreeSet<String> = blocks
        .iter()
        .map(|(l, _)| l.split_whitespace().next().unwrap().to_string())
        .collect();
    assert_eq!(listed, h.bus_devices(), "lspci output:\n{stdout}");

    let vf_lines: Vec<&(String, Vec<String>)> = blocks
        .iter()
        .filter(|(l, _)| l.contains("[8086:154c]"))
        .collect();
    let vf_listed: Vec<String> = vf_lines
        .iter()
        .map(|(l, _)| l.split_whitespace().next().unwrap().to_string())
        .collect();
    let vf_expected: Vec<String> = vfs.iter().map(|a| a.to_string()).collect();
    assert_eq!(vf_listed, vf_expected, "VFs as lspci sees them:\n{stdout}");
    for (line, details) in &vf_lines {
        assert!(line.contains("Ethernet controller [0200]"), "{line}");
        let driver = details
            .iter()
            .find_map(|d| d.strip_prefix("Kernel driver in use: "));
        if line.starts_with(&bound) {
            assert_eq!(driver, Some("vfio-pci"), "{line} {details:?}");
        } else {
            assert_eq!(driver, None, "{line} {details:?}");
        }
    }
    let pf = blocks
        .iter()
        .find(|(l, _)| l.starts_with(NIC))
        .expect("PF listed");
    assert!(pf.0.contains("[8086:1572]"), "{}", pf.0);
    assert!(
        pf.1.iter().any(|d| d == "Kernel driver in use: i40e"),
        "{pf:?}"
    );
    let gpu = blocks.iter().find(|(l, _)| l.starts_with(GPU)).unwrap();
    assert!(
        gpu.0.contains("[10de:2204]") && gpu.0.contains("[0300]"),
        "{}",
        gpu.0
    );
}

// ----- 8. scale ------------------------------------------------------------------------------

#[test]
fn large_model_builds_over_1000_functions() {
    let model = HostModel::large(15);
    let expected = model.functions.len()
        + model
            .functions
            .iter()
            .filter_map(|f| f.sriov.as_ref())
            .map(|s| s.initial_vfs as usize)
            .sum::<usize>();
    let h = Host::with(model);
    let listed = h.sysfs.list_functions().unwrap();
    assert!(listed.len() > 1000, "{} functions", listed.len());
    assert_eq!(listed.len(), expected);
    assert_eq!(h.kernel.addresses(), listed);
    for i in 0..15u8 {
        let pf = format!("0000:{:02x}:00.0", 0x60 + i);
        assert_eq!(h.attr(&pf, "sriov_numvfs"), "64", "{pf}");
        let vfs = vf_addresses(&h, &pf, 64);
        assert_eq!(h.read(&pf).sriov.unwrap().vfs, vfs, "{pf}");
        let last = vfs[63].to_string();
        assert_eq!(h.read(&last).physfn, Some(addr(&pf)));
        assert_eq!(
            h.driver_link(&last).as_deref(),
            Some("iavf"),
            "autoprobe on at boot"
        );
    }
    // Every function is readable.
    for a in &listed {
        h.sysfs
            .read_function(*a)
            .unwrap_or_else(|e| panic!("{a}: {}", vfiod::error_chain(&e)));
    }
}

/// A program run as one bounded job ([`Sysfs::run_bounded`]): its posts reach the caller in
/// order, a write that hangs inside it is reported with its path after the timeout, the
/// abandoned job's later writes are refused once the hang ends, and other writes keep working.
#[test]
fn bounded_job_reports_a_hung_write_and_is_abandoned() {
    let (h, sysfs) = host_with_a_hung_nvme_unbind();
    let (after_tx, after_rx) = mpsc::channel();
    let mut posts = Vec::new();
    let t = Instant::now();
    let r = sysfs.run_bounded(
        move |inline: &Sysfs, post: &dyn Fn(u32)| {
            post(1);
            inline
                .write_device_attr(addr(NIC), "sriov_drivers_autoprobe", "0")
                .expect("first write");
            post(2);
            let hung = inline.write(&inline.driver_dir("nvme").join("unbind"), DATA_NVME);
            let later = inline.write_device_attr(addr(NIC), "sriov_drivers_autoprobe", "1");
            let _ = after_tx.send((hung.is_ok(), later));
        },
        &mut |m| posts.push(m),
    );
    let took = t.elapsed();
    match &r {
        Err(SysfsError::WriteTimeout { path, value, .. }) => {
            assert!(path.ends_with("drivers/nvme/unbind"), "{path:?}");
            assert_eq!(value, DATA_NVME);
        }
        other => panic!("expected WriteTimeout, got {other:?}"),
    }
    // Abandoned at the timeout, while the hang (120 s) still holds: not a bound on speed.
    assert!(took >= Duration::from_millis(200), "{took:?}");
    assert_eq!(
        h.kernel.hanging(),
        1,
        "the job's hung write is still in the kernel"
    );
    assert_eq!(posts, vec![1, 2]);
    assert_eq!(h.attr(NIC, "sriov_drivers_autoprobe"), "0");

    // The writer thread is stuck in the job: plain writes get a thread of their own.
    sysfs
        .write_device_attr(addr(NIC), "sriov_drivers_autoprobe", "1")
        .expect("a write while the job hangs");
    sysfs
        .write_device_attr(addr(NIC), "sriov_drivers_autoprobe", "0")
        .unwrap();

    h.kernel.release_hangs();
    let (hung_ok, later) = after_rx
        .recv_timeout(common::HUNG)
        .expect("the job ends once the hang is released");
    assert!(!hung_ok, "a released hang fails (EINTR)");
    let msg = vfiod::error_chain(&later.expect_err("the abandoned job must not write on"));
    assert!(msg.contains("abandoned"), "{msg}");
    assert_eq!(
        h.attr(NIC, "sriov_drivers_autoprobe"),
        "0",
        "written after abandon"
    );

    // A job that panics is reported as an error and leaves the writer usable.
    let r = sysfs.run_bounded(
        |_: &Sysfs, _: &dyn Fn(())| -> () { panic!("job bug") },
        &mut |_| {},
    );
    assert!(r.is_err());
    sysfs
        .write_device_attr(addr(NIC), "sriov_drivers_autoprobe", "1")
        .expect("a write after a job panicked");
    assert_eq!(h.attr(NIC, "sriov_drivers_autoprobe"), "1");
}

// ----- persistence across SIGKILL ------------------------------------------------------------

/// Set (to a persistent kernel's root) only in the child [`churn_child`] runs in.
const CHURN_ROOT_ENV: &str = "VFIOD_TEST_CHURN_ROOT";

/// One round of what vfiod does to the NIC and the FPGA: enable VFs, move two VFs to vfio-pci
/// and back (override, unbind, probe), disable the VFs. Every write must succeed.
fn churn_once(sysfs: &Sysfs) {
    let set = |a: PciAddress, attr: &str, v: &str| {
        sysfs
            .write_device_attr(a, attr, v)
            .unwrap_or_else(|e| panic!("{a}/{attr} <- {v:?}: {}", vfiod::error_chain(&e)))
    };
    let write = |p: PathBuf, v: &str| {
        sysfs
            .write(&p, v)
            .unwrap_or_else(|e| panic!("{} <- {v:?}: {}", p.display(), vfiod::error_chain(&e)))
    };
    let (nic, fpga) = (addr(NIC), addr(FPGA));
    set(nic, "sriov_numvfs", "8");
    set(fpga, "sriov_numvfs", "4");
    let vfs = [addr("0000:3b:02.0"), addr("0000:3b:02.1")];
    for (from, to) in [("iavf", "vfio-pci"), ("vfio-pci", "iavf")] {
        for vf in vfs {
            set(vf, "driver_override", if to == "iavf" { "\n" } else { to });
            write(sysfs.driver_dir(from).join("unbind"), &vf.to_string());
            write(sysfs.pci_bus_dir().join("drivers_probe"), &vf.to_string());
        }
    }
    set(fpga, "sriov_numvfs", "0");
    set(nic, "sriov_numvfs", "0");
}

/// The child process of [`a_persistent_kernel_killed_at_random_reopens_whole`] (the test itself,
/// run again as its helper): it churns until killed.
fn churn_child() -> ! {
    let root = std::env::var_os(CHURN_ROOT_ENV).expect("the helper is given the kernel's root");
    let root = PathBuf::from(root);
    let kernel = SimKernel::open(&root).expect("reopen the persistent kernel");
    let sysfs = kernel.sysfs();
    // The last child was killed anywhere in a round: start the rounds from no VFs.
    for pf in [addr(NIC), addr(FPGA)] {
        if kernel.num_vfs(pf) != Some(0) {
            sysfs.write_device_attr(pf, "sriov_numvfs", "0").unwrap();
        }
    }
    churn_once(&sysfs);
    // Tells the parent that the loop runs (and that one whole round worked).
    fs::write(root.with_file_name("churning"), "").unwrap();
    loop {
        churn_once(&sysfs);
    }
}

/// The churning child, killed whatever happens to the test; its log is printed when the test
/// fails while it is held (the log's directory goes with the test).
struct Churner {
    child: std::process::Child,
    log: PathBuf,
}

impl Drop for Churner {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "the churning child's log:\n{}",
                fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }
}

/// A random duration in `[lo, hi)` (std's per-map random keys: no dependency for this).
fn random_between(lo: Duration, hi: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let r = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    lo + Duration::from_micros(r % (hi - lo).as_micros() as u64)
}

/// The files of a kernel agree with its model: the same functions on the bus, and for each
/// its driver link (both ends), `driver_override`, `sriov_numvfs` and `virtfnN` links.
fn assert_tree_is_the_model(k: &SimKernel, context: &str) {
    let root = k.root();
    let devices = root.join("sys/bus/pci/devices");
    let model: BTreeSet<PciAddress> = k.addresses().into_iter().collect();
    let listed: BTreeSet<PciAddress> = names_in(&devices)
        .iter()
        .map(|n| n.parse().expect("address"))
        .collect();
    assert_eq!(listed, model, "{context}: functions on the bus");
    for a in &model {
        let dir = devices.join(a.to_string());
        let driver = fs::read_link(dir.join("driver"))
            .ok()
            .map(|t| t.file_name().unwrap().to_str().unwrap().to_string());
        assert_eq!(driver, k.driver_of(*a), "{context}: {a}/driver");
        if let Some(d) = &driver {
            let back = root.join("sys/bus/pci/drivers").join(d).join(a.to_string());
            assert!(exists(&back), "{context}: {} missing", back.display());
        }
        let over = fs::read_to_string(dir.join("driver_override")).unwrap();
        assert_eq!(
            over.trim_end(),
            k.driver_override_of(*a).as_deref().unwrap_or("(null)"),
            "{context}: {a}/driver_override"
        );
        if let Ok(n) = fs::read_to_string(dir.join("sriov_numvfs")) {
            assert_eq!(
                n.trim().parse::<u32>().ok(),
                k.num_vfs(*a),
                "{context}: {a}/sriov_numvfs"
            );
            let links = names_in(&dir)
                .iter()
                .filter(|n| n.starts_with("virtfn"))
                .count();
            assert_eq!(
                Some(links as u32),
                k.num_vfs(*a),
                "{context}: {a}/virtfnN links"
            );
        }
    }
    for d in names_in(&root.join("sys/bus/pci/drivers")) {
        for n in names_in(&root.join("sys/bus/pci/drivers").join(&d)) {
            if let Ok(a) = n.parse::<PciAddress>() {
                assert_eq!(
                    k.driver_of(a).as_deref(),
                    Some(d.as_str()),
                    "{context}: drivers/{d}/{a} of a function not bound to {d}"
                );
            }
        }
    }
}

/// The churning child killed at random moments is this test again, as its own helper process
/// (`common::helper_process`).
#[test]
fn a_persistent_kernel_killed_at_random_reopens_whole() {
    let name = common::test_name(
        module_path!(),
        "a_persistent_kernel_killed_at_random_reopens_whole",
    );
    if common::is_helper(&name) {
        churn_child();
    }
    let dir = scratch_dir();
    let root = dir.path().join("root");
    let ready = dir.path().join("churning");
    let log = dir.path().join("child.log");
    SimKernel::open_or_build(&root, &HostModel::reference()).expect("build and save");
    for round in 0..8 {
        let _ = fs::remove_file(&ready);
        let out = fs::File::create(&log).unwrap();
        let mut child = Churner {
            child: common::helper_process(&name)
                .env(CHURN_ROOT_ENV, &root)
                .stdout(out.try_clone().unwrap())
                .stderr(out)
                .spawn()
                .expect("start the churning child"),
            log: log.clone(),
        };
        let exited = common::eventually_blocking(
            Duration::from_secs(60),
            &format!("round {round}: the child starts churning"),
            || {
                if exists(&ready) {
                    return Some(None);
                }
                child.child.try_wait().unwrap().map(Some)
            },
        );
        if let Some(status) = exited {
            panic!("round {round}: the child ended before churning ({status})");
        }
        // The scenario, not a wait: the kill lands at a random moment of the churn.
        std::thread::sleep(random_between(
            Duration::from_millis(1),
            Duration::from_millis(300),
        ));
        let still_running = child.child.try_wait().unwrap().is_none();
        let _ = child.child.kill(); // SIGKILL
        let _ = child.child.wait();
        assert!(
            still_running,
            "round {round}: the child stopped churning by itself (its log follows)"
        );
        let k = SimKernel::open(&root).expect("reopen after SIGKILL");
        assert_tree_is_the_model(&k, &format!("round {round}, reopened"));
    }

    // And the reopened kernel works: restore, split onto vfio-pci, restore again.
    let k = SimKernel::open(&root).unwrap();
    let sysfs = k.sysfs();
    let (nic, fpga) = (addr(NIC), addr(FPGA));
    for pf in [nic, fpga] {
        if k.num_vfs(pf) != Some(0) {
            sysfs.write_device_attr(pf, "sriov_numvfs", "0").unwrap();
        }
    }
    sysfs
        .write_device_attr(nic, "sriov_drivers_autoprobe", "0")
        .unwrap();
    sysfs.write_device_attr(nic, "sriov_numvfs", "4").unwrap();
    let vfs: Vec<PciAddress> = (0..4).map(|i| addr(&format!("0000:3b:02.{i}"))).collect();
    for vf in &vfs {
        assert_eq!(k.driver_of(*vf), None, "{vf}: autoprobe is off");
        sysfs
            .write_device_attr(*vf, "driver_override", "vfio-pci")
            .unwrap();
        sysfs
            .write(&sysfs.pci_bus_dir().join("drivers_probe"), &vf.to_string())
            .unwrap();
        assert_eq!(k.driver_of(*vf).as_deref(), Some("vfio-pci"));
    }
    for vf in &vfs {
        sysfs
            .write_device_attr(*vf, "driver_override", "\n")
            .unwrap();
        sysfs
            .write(
                &sysfs.driver_dir("vfio-pci").join("unbind"),
                &vf.to_string(),
            )
            .unwrap_or_else(|e| panic!("unbind {vf}: {}", vfiod::error_chain(&e)));
    }
    sysfs.write_device_attr(nic, "sriov_numvfs", "0").unwrap();
    sysfs
        .write_device_attr(nic, "sriov_drivers_autoprobe", "1")
        .unwrap();
    assert_eq!(k.driver_of(nic).as_deref(), Some("i40e"));
    assert_tree_is_the_model(&k, "after the final restore");
    drop(k);
    // What was saved last is what a next open shows.
    let k = SimKernel::open(&root).unwrap();
    assert_eq!(k.num_vfs(nic), Some(0));
    assert_eq!(k.driver_override_of(vfs[0]), None);
    assert_tree_is_the_model(&k, "reopened after the final restore");
}
