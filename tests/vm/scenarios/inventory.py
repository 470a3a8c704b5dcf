"""vfiod's inventory against the kernel's (sysfs), lspci's and libvirt's view of the same PCI functions."""

from __future__ import annotations

import re
import time
import xml.etree.ElementTree as ET

from testbed import vfiod
from testbed.guest import Guest
from testbed.runner import Testbed, scenario

PF = "0000:01:00.0"
PF_SYSFS = f"/sys/bus/pci/devices/{PF}"
KEYS = {"address", "vendor_id", "device_id", "subsystem_vendor_id", "subsystem_device_id", "class",
        "vendor_name", "device_name", "kind", "driver", "numa_node", "iommu_group", "role", "separable", "mode",
        "total_vfs", "num_vfs", "parent_pf", "state", "state_reason"}

SYSFS_DUMP = r"""
for d in /sys/bus/pci/devices/*; do
    link() { if [ -e "$d/$1" ]; then basename "$(readlink "$d/$1")"; else echo -; fi; }
    echo "${d##*/} $(cat $d/vendor $d/device $d/subsystem_vendor $d/subsystem_device $d/class $d/numa_node | tr '\n' ' ')" \
         "$(link driver) $(link iommu_group) $(link physfn)" \
         "$(cat $d/sriov_totalvfs 2>/dev/null || echo -) $(cat $d/sriov_numvfs 2>/dev/null || echo -)"
done
"""


def nodedev_name(address: str) -> str:
    return "pci_" + re.sub(r"[:.]", "_", address)


def kernel_view(g: Guest) -> dict[str, dict]:
    """What vfioctl should say about each function, derived from sysfs alone."""
    view = {}
    for line in g.run(SYSFS_DUMP, quiet=True).out.splitlines():
        addr, ven, dev, sven, sdev, cls, numa, drv, grp, physfn, total, num = line.split()
        total_vfs = 0 if total == "-" else int(total)
        view[addr] = {
            "vendor_id": ven.removeprefix("0x"), "device_id": dev.removeprefix("0x"),
            "subsystem_vendor_id": sven.removeprefix("0x"), "subsystem_device_id": sdev.removeprefix("0x"),
            "class": cls, "numa_node": None if int(numa) < 0 else int(numa),
            "driver": None if drv == "-" else drv, "iommu_group": None if grp == "-" else int(grp),
            "parent_pf": None if physfn == "-" else physfn,
            "total_vfs": total_vfs, "num_vfs": 0 if num == "-" else int(num),
            "role": "vf" if physfn != "-" else ("pf" if total_vfs > 0 else "function"),
        }
    return view


def lspci_view(g: Guest) -> dict[str, dict]:
    """`lspci -nn -k -D` in its machine-readable form (-vmm): same fields, one `Key:\tvalue` per line."""
    view = {}
    for block in g.run("lspci -vmm -nn -k -D", quiet=True).out.strip().split("\n\n"):
        fields = dict(line.split(":\t", 1) for line in block.splitlines())
        ids = {k: re.search(r"\[([0-9a-f]{4})\]\s*$", fields[k]).group(1)
               for k in ("Class", "Vendor", "Device") if k in fields}
        view[fields["Slot"]] = {
            "vendor_id": ids["Vendor"], "device_id": ids["Device"],
            "class": "0x" + ids["Class"] + fields.get("ProgIf", "00"),
            "driver": fields.get("Driver"),
            "iommu_group": int(fields["IOMMUGroup"]) if "IOMMUGroup" in fields else None,
        }
        for key, name in (("SVendor", "subsystem_vendor_id"), ("SDevice", "subsystem_device_id")):
            if key in fields:
                view[fields["Slot"]][name] = re.search(r"\[([0-9a-f]{4})\]\s*$", fields[key]).group(1)
    return view


def address_of(elem: ET.Element) -> str:
    return "{:04x}:{:02x}:{:02x}.{:x}".format(*(int(elem.get(k), 16) for k in ("domain", "bus", "slot", "function")))


def libvirt_view(g: Guest, address: str) -> dict:
    """`virsh nodedev-dumpxml pci_...` of one function, reduced to the fields vfioctl has."""
    root = ET.fromstring(g.run(f"virsh nodedev-dumpxml {nodedev_name(address)}", quiet=True).out)
    cap = root.find("capability[@type='pci']")
    pci = "{:04x}:{:02x}:{:02x}.{:x}".format(*(int(cap.findtext(k), 0) for k in ("domain", "bus", "slot", "function")))
    vfs = cap.find("capability[@type='virt_functions']")
    physfn = cap.find("capability[@type='phys_function']/address")
    group = cap.find("iommuGroup")
    return {
        "address": pci,
        "vendor_id": cap.find("vendor").get("id").removeprefix("0x"),
        "device_id": cap.find("product").get("id").removeprefix("0x"),
        "class": cap.findtext("class"),
        "driver": root.findtext("driver/name"),
        "iommu_group": int(group.get("number")) if group is not None else None,
        "total_vfs": int(vfs.get("maxCount")) if vfs is not None else 0,
        "vf_addresses": sorted(address_of(a) for a in vfs.findall("address")) if vfs is not None else [],
        "parent_pf": address_of(physfn) if physfn is not None else None,
    }


def differences(source: str, vfioctl: dict[str, dict], other: dict[str, dict]) -> list[str]:
    problems = []
    if set(vfioctl) != set(other):
        problems.append(f"addresses differ from {source}: only in vfioctl {sorted(set(vfioctl) - set(other))}, "
                        f"only in {source} {sorted(set(other) - set(vfioctl))}")
    for addr in sorted(set(vfioctl) & set(other)):
        for key, want in other[addr].items():
            if key in vfioctl[addr] and vfioctl[addr][key] != want:
                problems.append(f"{addr} {key}: vfioctl says {vfioctl[addr][key]!r}, {source} says {want!r}")
    return problems


def compare(g: Guest, vfs: list[str]) -> list[str]:
    """All disagreements between vfioctl and the kernel, lspci and libvirt; checks the PF and VFs in detail."""
    devices = vfiod.list_devices(g)
    listed = {d.get("address"): d for d in devices}
    problems = []
    for d in devices:
        # Keys beyond the contract's are extensions, not errors.
        if not KEYS <= set(d):
            problems.append(f"{d.get('address')}: keys of the contract missing: {sorted(KEYS - set(d))}")
    if len(listed) != len(devices):
        problems.append("vfioctl lists an address twice")
    problems += differences("sysfs", listed, kernel_view(g))
    problems += differences("lspci", listed, lspci_view(g))
    for addr in [PF, *vfs]:
        lv = libvirt_view(g, addr)
        if addr == PF and lv["vf_addresses"] != vfs:
            problems.append(f"libvirt lists VFs {lv['vf_addresses']} for {PF}, expected {vfs}")
        lv.pop("vf_addresses")
        problems += differences(f"virsh nodedev-dumpxml {nodedev_name(addr)}", {addr: listed.get(addr, {})},
                                {addr: lv})

    pf = listed.get(PF, {})
    want_pf = {"kind": "nvme", "role": "pf", "mode": "vf" if vfs else "pf", "total_vfs": 4, "num_vfs": len(vfs),
               "parent_pf": None, "driver": "nvme", "state": "usable"}
    problems += [f"{PF} {k}: {pf.get(k)!r}, expected {v!r}" for k, v in want_pf.items() if pf.get(k) != v]
    groups = {pf.get("iommu_group")}
    for addr in vfs:
        vf = listed.get(addr, {})
        want_vf = {"kind": "nvme", "role": "vf", "mode": "none", "parent_pf": PF, "driver": None, "total_vfs": 0,
                   "num_vfs": 0, "state": "usable"}
        problems += [f"{addr} {k}: {vf.get(k)!r}, expected {v!r}" for k, v in want_vf.items() if vf.get(k) != v]
        groups.add(vf.get("iommu_group"))
    if len(groups) != 1 + len(vfs) or None in groups:
        problems.append(f"the PF and each VF should have an IOMMU group of their own: {groups}")
    for d in devices:
        if d.get("role") not in ("pf", "vf", "function") or d.get("state") not in ("usable", "protected", "broken"):
            problems.append(f"{d.get('address')}: role {d.get('role')!r} / state {d.get('state')!r} not in the contract")
        if not isinstance(d.get("separable"), bool):
            problems.append(f"{d.get('address')}: separable {d.get('separable')!r} is not a boolean")
    return problems


def vfs_seen(g: Guest, count: int) -> bool:
    listed = {d["address"]: d for d in vfiod.list_devices(g)}
    vfs = [a for a, d in listed.items() if d.get("parent_pf") == PF]
    return len(vfs) == count and listed.get(PF, {}).get("num_vfs") == count


def assert_none(problems: list[str], stage: str) -> None:
    assert not problems, f"{stage}: vfioctl disagrees with the system:\n  " + "\n  ".join(problems)


@scenario()
def inventory(tb: Testbed) -> None:
    """vfioctl list --json agrees with sysfs, lspci and virsh nodedev-dumpxml, before and after VFs appear"""
    g = tb.boot()
    with tb.timed("install+start"):
        vfiod.install(g)
    assert_none(compare(g, vfs=[]), "PF only")

    vfs = ["0000:01:00.1", "0000:01:00.2"]
    t0 = time.monotonic()
    g.run(f"echo 0 > {PF_SYSFS}/sriov_drivers_autoprobe && echo 2 > {PF_SYSFS}/sriov_numvfs")
    g.wait_for("vfiod to list 2 VFs", lambda: vfs_seen(g, 2), timeout=30)
    tb.note("VFs seen by vfiod", time.monotonic() - t0)
    # libvirt learns about new functions from udev, asynchronously.
    g.wait_for("libvirt to list the VFs",
               lambda: all(nodedev_name(v) in g.run("virsh nodedev-list --cap pci", quiet=True).out for v in vfs),
               timeout=30)
    assert_none(compare(g, vfs=vfs), "2 VFs enabled by hand")
    problems = vfiod.journal_problems(g)
    assert not problems, "vfiod logged warnings or errors:\n  " + "\n  ".join(problems)

    shown = g.json(f"vfioctl show {PF} --json")
    listed = {d["address"]: d for d in vfiod.list_devices(g)}[PF]
    assert shown == listed, f"`vfioctl show {PF} --json` differs from its `list --json` entry:\n{shown}\n{listed}"

    t0 = time.monotonic()
    g.run(f"echo 0 > {PF_SYSFS}/sriov_numvfs")
    g.wait_for("vfiod to drop the VFs", lambda: vfs_seen(g, 0), timeout=30)
    tb.note("VFs gone in vfiod", time.monotonic() - t0)
    assert_none(compare(g, vfs=[]), "VFs disabled again")
