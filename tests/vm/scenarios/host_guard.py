"""Issue 19's host guard on a real kernel: a domain whose XML assigns the guest's own up NIC (the private
link's function, 00:04.0) with managed='yes' is refused by `virsh start` with vfiod's line, and the NIC stays
on its driver with its address; the same with vfiod stopped (the hook's fallback reads the store); a domain
naming an unselected, unused function (the NVMe PF, 01:00.0) is refused while its namespace is held (dm,
O_EXCL, a plain open, a private-namespace mount: host_holders' checks, run in this guest) and starts once it
is free: vfiod leaves it to libvirt."""

from __future__ import annotations

from testbed import vfiod
from testbed.guest import Guest, private_pair
from testbed.nested import DOMAIN_TYPE, SMALL_DOMAIN, domain_state
from testbed.runner import Testbed, scenario
from scenarios import host_holders

NIC = "0000:00:04.0"
FREE = "0000:01:00.0"
HOOK = "/etc/libvirt/hooks/qemu.d/vfiod"

MANAGED_HOSTDEV = """
    <hostdev mode='subsystem' type='pci' managed='yes'>
      <source><address domain='0x{domain}' bus='0x{bus}' slot='0x{slot}' function='0x{function}'/></source>
    </hostdev>"""


def define(g: Guest, name: str, address: str) -> None:
    domain, bus, rest = address.split(":")
    slot, function = rest.split(".")
    hostdev = MANAGED_HOSTDEV.format(domain=domain, bus=bus, slot=slot, function=function)
    g.run(f"cat > /tmp/{name}.xml", input=SMALL_DOMAIN.format(domain_type=DOMAIN_TYPE, name=name, memory_mib=128, hostdevs=hostdev))
    g.run(f"virsh define /tmp/{name}.xml")


def driver(g: Guest, address: str) -> str:
    return g.run(f"basename $(readlink /sys/bus/pci/devices/{address}/driver)", quiet=True).out.strip()


def nic_state(g: Guest, iface: str) -> tuple[str, str]:
    """The NIC's driver and its interface's addresses, as `ip -br addr` shows them."""
    return driver(g, NIC), g.run(f"ip -br addr show {iface}", quiet=True).out.split(None, 2)[-1].strip()


def refused(g: Guest, name: str, says: str) -> str:
    res = g.run(f"virsh start {name}", check=False, timeout=120)
    assert res.rc != 0, f"virsh start {name} must be refused:\n{res.describe()}"
    text = res.out + res.err
    assert says in text, f"virsh start {name}: expected {says!r} in:\n{text}"
    assert domain_state(g, name) == "shut off", domain_state(g, name)
    return text


@scenario()
def host_guard(tb: Testbed) -> None:
    """virsh start of a domain assigning the host's own up NIC (managed='yes') is refused with vfiod's
    line, with vfiod running and stopped, the NIC untouched; the NVMe PF is refused while a dm target, an
    O_EXCL open, a plain open or a private-namespace mount holds its namespace (host_holders), and starts
    once it is free"""
    link, _ = private_pair()
    g = tb.boot("hosta", link=link)
    iface = g.run(f"ls /sys/bus/pci/devices/{NIC}/virtio*/net/", quiet=True).out.split()[0]
    # systemd-networkd may give the link its address a moment after the boot is "running".
    def addressed():
        state = nic_state(g, iface)
        return state if link.address in state[1] else None

    before = g.wait_for("the private link's address", addressed, 30)
    assert before[0] == "virtio-pci", f"the link NIC before: {before}"

    vfiod.install(g)
    g.run(f"test -x {HOOK}")
    g.run("systemctl restart libvirtd")
    g.wait_for("libvirtd back", lambda: g.run("virsh list", check=False, quiet=True).rc == 0, 60)
    dev = g.wait_for(f"{NIC} listed", lambda: next(
        (d for d in vfiod.list_devices(g) if d["address"] == NIC), None), 30)
    assert dev["state"] == "protected", dev

    define(g, "thief", NIC)
    line = f"{NIC} is used by the host: network interface {iface} is up"
    text = refused(g, "thief", f"vfiod: domain thief cannot start: {line}")
    print(f"    refused with vfiod running: {text.strip().splitlines()[-1]}")
    assert nic_state(g, iface) == before, f"the NIC changed: {nic_state(g, iface)} (was {before})"

    # vfiod stopped: the hook's fallback refuses it from the store's records.
    g.run("systemctl stop vfiod")
    text = refused(g, "thief", line)
    print(f"    refused with vfiod stopped: {text.strip().splitlines()[-1]}")
    assert nic_state(g, iface) == before, f"the NIC changed: {nic_state(g, iface)} (was {before})"
    g.run("systemctl start vfiod")

    # Issue 32: the same function held through its namespace (dm, O_EXCL, an open, a mount) is the host's,
    # refused each time; free again once the holder is gone (host_holders, run here to save a boot).
    define(g, "free", FREE)
    host_holders.check_holders(tb, g, "free")

    # Unselected and unused: libvirt's, and the domain starts with it.
    free_driver = driver(g, FREE)
    res = g.run("virsh start free", check=False, timeout=180)
    assert res.rc == 0, f"a domain with an unselected unused function must start:\n{res.describe()}"
    assert domain_state(g, "free") == "running"
    assert driver(g, FREE) == "vfio-pci", driver(g, FREE)
    g.run("virsh destroy free")
    g.wait_for(f"{FREE} back on {free_driver}", lambda: driver(g, FREE) == free_driver, 60)
    assert nic_state(g, iface) == before
