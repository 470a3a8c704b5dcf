"""The test bed itself, without vfiod: IOMMU, SR-IOV NVMe, VFIO binding and libvirt in a guest."""

from testbed.guest import Guest
from testbed.nested import define_small_domain, domain_state
from testbed.runner import Testbed, scenario

PF = "0000:01:00.0"
PF_SYSFS = f"/sys/bus/pci/devices/{PF}"


def read(g: Guest, path: str) -> str:
    return g.run(f"cat {path}", quiet=True).out.strip()


@scenario(default=False)
def testbed_smoke(tb: Testbed) -> None:
    """guest boots with IOMMU groups, the NVMe PF splits into VFs, a VF binds to vfio-pci, a domain runs"""
    g = tb.boot()
    groups = g.run("ls /sys/kernel/iommu_groups | wc -l").out.strip()
    assert int(groups) > 1, f"no IOMMU groups in the guest ({groups})"
    assert read(g, f"{PF_SYSFS}/class") == "0x010802", "01:00.0 is not an NVMe controller"
    assert read(g, f"{PF_SYSFS}/sriov_totalvfs") == "4"
    assert g.run(f"basename $(readlink {PF_SYSFS}/driver)").out.strip() == "nvme"

    with tb.timed("enable 2 VFs"):
        g.run(f"echo 0 > {PF_SYSFS}/sriov_drivers_autoprobe && echo 2 > {PF_SYSFS}/sriov_numvfs")
    for fn in (1, 2):
        vf = f"0000:01:00.{fn}"
        assert g.run(f"basename $(readlink /sys/bus/pci/devices/{vf}/physfn)").out.strip() == PF
    vf_groups = {g.run(f"basename $(readlink /sys/bus/pci/devices/0000:01:00.{fn}/iommu_group)").out.strip()
                 for fn in (1, 2)}
    assert len(vf_groups) == 2, f"VFs share an IOMMU group: {vf_groups}"

    with tb.timed("VF to vfio-pci"):
        g.run("modprobe vfio-pci && echo vfio-pci > /sys/bus/pci/devices/0000:01:00.1/driver_override && "
              "echo 0000:01:00.1 > /sys/bus/pci/drivers_probe")
    group = g.run("basename $(readlink /sys/bus/pci/devices/0000:01:00.1/iommu_group)").out.strip()
    g.run(f"test -c /dev/vfio/{group}")

    xml = g.run("virsh nodedev-dumpxml pci_0000_01_00_0").out
    assert "<capability type='virt_functions' maxCount='4'>" in xml, xml
    with tb.timed("nested domain start"):
        define_small_domain(g, "small")
    assert domain_state(g, "small") == "running"
    g.run("virsh destroy small && virsh undefine small")
    with tb.timed("disable VFs"):
        g.run(f"echo 0 > {PF_SYSFS}/sriov_numvfs")
