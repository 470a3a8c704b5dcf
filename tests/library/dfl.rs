//! The simulated DFL FPGA card: the FME and port the DFL drivers show while `dfl-pci` drives
//! the card, and partial reconfiguration through `Backend::fpga_port_pr` with the errors the
//! driver gives.

use crate::common::addr;
use vfiod::host::sysfs::dfl::read_card;
use vfiod::sim::kernel::{
    FaultAction, FaultTarget, HostModel, SimKernel, REFERENCE_FPGA_AFU, REFERENCE_FPGA_INTERFACE,
};

const NEW_AFU: &str = "d8424dc4a4a3c413f89e433683f9040b";

#[test]
fn the_reference_fpga_shows_its_fme_and_port_and_takes_a_partial_reconfiguration() {
    let dir = tempfile::tempdir().unwrap();
    let k = SimKernel::build(&dir.path().join("root"), &HostModel::reference()).unwrap();
    let sysfs = k.sysfs();
    let af = addr("0000:af:00.0");
    let card = read_card(&sysfs, af).unwrap().expect("a DFL card");
    assert_eq!(card.index, 0);
    assert_eq!(card.interface_id.as_deref(), Some(REFERENCE_FPGA_INTERFACE));
    assert_eq!(card.afu_id.as_deref(), Some(REFERENCE_FPGA_AFU));
    assert_eq!(card.fme_node, k.root().join("dev/dfl-fme.0"));
    // Not a DFL card.
    assert_eq!(read_card(&sysfs, addr("0000:3b:00.0")).unwrap(), None);

    let be = sysfs.backend();
    // Errors as the driver gives them.
    let errno = |r: std::io::Result<()>| r.unwrap_err().raw_os_error();
    assert_eq!(
        errno(be.fpga_port_pr(&card.fme_node, 1, b"bits", Some(NEW_AFU))),
        Some(libc::EINVAL)
    );
    assert_eq!(
        errno(be.fpga_port_pr(&card.fme_node, 0, b"", Some(NEW_AFU))),
        Some(libc::EINVAL)
    );
    assert_eq!(
        errno(be.fpga_port_pr(&k.root().join("dev/dfl-fme.7"), 0, b"bits", Some(NEW_AFU))),
        Some(libc::ENOENT)
    );
    k.inject(
        FaultTarget::DeviceAttr(af, "dfl-fme-pr".into()),
        FaultAction::Errno(libc::EIO),
        Some(1),
    );
    assert_eq!(
        errno(be.fpga_port_pr(&card.fme_node, 0, b"bits", Some(NEW_AFU))),
        Some(libc::EIO)
    );
    assert_eq!(k.afu_id_of(af).as_deref(), Some(REFERENCE_FPGA_AFU));

    be.fpga_port_pr(&card.fme_node, 0, b"bits", Some(NEW_AFU))
        .unwrap();
    assert_eq!(
        read_card(&sysfs, af).unwrap().unwrap().afu_id.as_deref(),
        Some(NEW_AFU)
    );
    assert_eq!(std::fs::read(&card.fme_node).unwrap(), b"bits");
    assert!(k
        .take_write_log()
        .iter()
        .any(|(p, v)| p.ends_with("dev/dfl-fme.0") && v == "PR port 0: 4 bytes"));

    // While SR-IOV is on the port belongs to a VF: EBUSY.
    sysfs
        .write(&sysfs.device_attr(af, "sriov_numvfs"), "2")
        .unwrap();
    assert_eq!(
        errno(be.fpga_port_pr(&card.fme_node, 0, b"bits", Some(REFERENCE_FPGA_AFU))),
        Some(libc::EBUSY)
    );
    sysfs
        .write(&sysfs.device_attr(af, "sriov_numvfs"), "0")
        .unwrap();

    // Off dfl-pci the FME and its node are gone.
    sysfs
        .write(
            &sysfs.path("sys/bus/pci/drivers/dfl-pci/unbind"),
            "0000:af:00.0",
        )
        .unwrap();
    assert_eq!(read_card(&sysfs, af).unwrap(), None);
    assert!(!card.fme_node.exists());
    sysfs
        .write(&sysfs.path("sys/bus/pci/drivers_probe"), "0000:af:00.0")
        .unwrap();
    assert_eq!(
        read_card(&sysfs, af).unwrap().unwrap().afu_id.as_deref(),
        Some(NEW_AFU)
    );
}

#[test]
fn a_second_card_has_its_own_fme() {
    let dir = tempfile::tempdir().unwrap();
    let k = SimKernel::build(&dir.path().join("root"), &HostModel::two_fpgas()).unwrap();
    let card = read_card(&k.sysfs(), addr("0000:b1:00.0"))
        .unwrap()
        .unwrap();
    assert_eq!(card.index, 1);
    assert_eq!(card.fme_node, k.root().join("dev/dfl-fme.1"));
}
