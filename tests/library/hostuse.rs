//! Issue 32: who uses a function, as the kernel answers it, read on the simulated kernel by
//! the edge (`host::sysfs::hostuse::read`) and decided by `vfiod::hostuse`: each kind of holder
//! makes the data NVMe drive used, with its reason, until it goes; an NVMe multipath head (no
//! PCI parent) counts for its subsystem's controller; a VF's VFIO device node held by a QEMU is
//! that VM's use, by any other process the host's. Reading writes nothing.

use crate::common::fast_tempdir as scratch_dir;
use std::sync::Arc;
use vfiod::host::sysfs::hostuse::{self, Scope};
use vfiod::hostuse::Use;
use vfiod::model::pci::PciAddress;
use vfiod::sim::kernel::{HostModel, ProcessSpec, SimKernel};

const DATA_NVME: &str = "0000:d8:00.0";
const NIC: &str = "0000:3b:00.0";

fn addr(s: &str) -> PciAddress {
    s.parse().expect("address")
}

fn host() -> (tempfile::TempDir, Arc<SimKernel>) {
    let dir = scratch_dir();
    let kernel = SimKernel::build(&dir.path().join("root"), &HostModel::reference()).expect("host");
    (dir, kernel)
}

fn uses_of(k: &Arc<SimKernel>, f: &str) -> Vec<Use> {
    let facts = hostuse::read(&k.sysfs(), Scope::All, &[]);
    let all = vfiod::hostuse::uses(&facts);
    // A read of only that function says the same.
    let only = [addr(f)];
    let scoped = vfiod::hostuse::uses(&hostuse::read(&k.sysfs(), Scope::Only(&only), &[]));
    assert_eq!(
        all.get(&addr(f)),
        scoped.get(&addr(f)),
        "scoped read of {f}"
    );
    all.get(&addr(f)).cloned().unwrap_or_default()
}

fn process(pid: u32, comm: &str, args: &[&str], nodes: &[&str]) -> ProcessSpec {
    ProcessSpec {
        pid,
        comm: comm.into(),
        cmdline: args.iter().map(|a| a.to_string()).collect(),
        nodes: nodes.iter().map(|n| n.to_string()).collect(),
    }
}

type Step = Box<dyn Fn(&SimKernel)>;

#[test]
fn each_holder_the_kernel_knows_makes_the_drive_used_until_it_goes() {
    for multipath in [false, true] {
        let (_dir, k) = host();
        k.add_disk(addr(DATA_NVME), 1, multipath).unwrap();
        assert_eq!(uses_of(&k, DATA_NVME), vec![], "an idle drive");
        let cases: Vec<(&str, Step, Step, &str)> = vec![
            (
                "an LVM volume",
                Box::new(|k: &SimKernel| {
                    k.add_holder("nvme1n1", "dm-0", Some("vg0-data")).unwrap()
                }),
                Box::new(|k: &SimKernel| k.remove_holder("nvme1n1", "dm-0").unwrap()),
                "block device nvme1n1 is held by dm-0 (vg0-data)",
            ),
            (
                "an md array",
                Box::new(|k: &SimKernel| k.add_holder("nvme1n1", "md127", None).unwrap()),
                Box::new(|k: &SimKernel| k.remove_holder("nvme1n1", "md127").unwrap()),
                "block device nvme1n1 is held by md127",
            ),
            (
                "an exclusive open (ZFS, O_EXCL)",
                Box::new(|k: &SimKernel| k.hold_exclusively("nvme1n1", true).unwrap()),
                Box::new(|k: &SimKernel| k.hold_exclusively("nvme1n1", false).unwrap()),
                "block device nvme1n1 is held exclusively",
            ),
            (
                "a process with the disk open",
                Box::new(|k: &SimKernel| {
                    k.spawn(process(812, "fio", &["fio"], &["/dev/nvme1n1"]))
                        .unwrap()
                }),
                Box::new(|k: &SimKernel| k.end(812).unwrap()),
                "block device nvme1n1 is open by pid 812 (fio)",
            ),
            (
                "a process with the controller's node open",
                Box::new(|k: &SimKernel| {
                    k.spawn(process(813, "nvme", &["nvme"], &["/dev/nvme1"]))
                        .unwrap()
                }),
                Box::new(|k: &SimKernel| k.end(813).unwrap()),
                "/dev/nvme1 is open by pid 813 (nvme)",
            ),
            (
                "a VM's raw disk, served by the host's driver",
                Box::new(|k: &SimKernel| {
                    k.spawn(process(
                        900,
                        "qemu-system-x86",
                        &["qemu-system-x86_64", "-name", "guest=vm1,debug-threads=on"],
                        &["/dev/nvme1n1"],
                    ))
                    .unwrap()
                }),
                Box::new(|k: &SimKernel| k.end(900).unwrap()),
                "block device nvme1n1 is open by pid 900 (qemu-system-x86)",
            ),
        ];
        for (what, hold, release, says) in cases {
            k.take_write_log();
            hold(&k);
            assert_eq!(
                uses_of(&k, DATA_NVME),
                vec![Use::Host(says.to_string())],
                "{what} (multipath {multipath})"
            );
            assert!(k.take_write_log().is_empty(), "{what}: a read wrote");
            release(&k);
            assert_eq!(uses_of(&k, DATA_NVME), vec![], "{what} gone");
        }
        // The boot drive keeps its named uses (and its busy partitions add nothing).
        let boot = uses_of(&k, "0000:3d:00.0");
        assert_eq!(
            boot,
            vec![
                Use::Host("block device nvme0n1p1 is mounted at /boot/efi".into()),
                Use::Host("block device nvme0n1p2 is mounted at /".into()),
                Use::Host("block device nvme0n1p3 is in use as swap".into()),
            ]
        );
    }
}

#[test]
fn a_vfs_vfio_device_node_is_its_vms_or_the_hosts() {
    let (_dir, k) = host();
    let s = k.sysfs();
    let nic = addr(NIC);
    s.write(&s.device_attr(nic, "sriov_drivers_autoprobe"), "0")
        .unwrap();
    s.write(&s.device_attr(nic, "sriov_numvfs"), "2").unwrap();
    let vf = addr("0000:3b:02.0");
    s.write(&s.device_attr(vf, "driver_override"), "vfio-pci")
        .unwrap();
    s.write(&s.pci_bus_dir().join("drivers_probe"), &vf.to_string())
        .unwrap();
    assert_eq!(k.driver_of(vf).as_deref(), Some("vfio-pci"));
    let node = k.vfio_device_node(vf).expect("a VFIO device node");
    assert!(node.starts_with("/dev/vfio/devices/vfio"), "{node}");
    assert_eq!(uses_of(&k, "0000:3b:02.0"), vec![]);

    k.spawn(process(
        900,
        "qemu-system-x86",
        &[
            "qemu-system-x86_64",
            "-name",
            "guest=vm1",
            "-object",
            "iommufd,id=fd0",
        ],
        &["/dev/iommu", &node],
    ))
    .unwrap();
    assert_eq!(
        uses_of(&k, "0000:3b:02.0"),
        vec![Use::Vm {
            vm: Some("vm1".into()),
            pid: 900,
            why: format!("{node} is open by pid 900 (qemu-system-x86)"),
        }]
    );
    assert!(uses_of(&k, "0000:3b:02.1").is_empty(), "the other VF");
    k.end(900).unwrap();

    k.spawn(process(77, "dpdk-testpmd", &["dpdk-testpmd"], &[&node]))
        .unwrap();
    assert_eq!(
        uses_of(&k, "0000:3b:02.0"),
        vec![Use::Host(format!(
            "{node} is open by pid 77 (dpdk-testpmd)"
        ))]
    );
    k.end(77).unwrap();

    // `/dev/vfio/<group>` keeps counting.
    let group = s.read_function(vf).unwrap().iommu_group.unwrap();
    k.spawn(process(
        901,
        "qemu-system-x86",
        &["qemu-system-x86_64"],
        &[&format!("/dev/vfio/{group}")],
    ))
    .unwrap();
    assert_eq!(
        uses_of(&k, "0000:3b:02.0"),
        vec![Use::Vm {
            vm: None,
            pid: 901,
            why: format!("IOMMU group {group} is open by pid 901 (qemu-system-x86)"),
        }]
    );
    k.end(901).unwrap();
    assert!(
        uses_of(&k, "0000:3b:02.0").is_empty(),
        "nobody holds it any more"
    );
}
