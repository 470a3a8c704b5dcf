"""Nested domains: small libvirt domains inside a guest, domains that run an OS (for PCI hot-plug),
their live hostdevs, and live migration between two guests."""

from __future__ import annotations

import re
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from .guest import Guest
from .image import NESTED_VMLINUX

# How every nested domain runs: TCG inside the guest, not KVM. Under KVM (the guest's AMD-V, itself emulated
# by the outer TCG) the guest's kernel failed in KVM's own paths: hung in kvm_destroy_vm on a lost IPI (stop
# 29's CI), panicked with "corrupted stack end detected inside scheduler" in a `CPU 0/KVM` thread right
# after a migration (stop 30's CI), and reset a busy nested kernel (docs/testbed.md). vfiod does not care
# which accelerator QEMU uses; the test bed must not fail for the emulator's sake.
DOMAIN_TYPE = "qemu"

# No disk, no network: SeaBIOS finds nothing to boot and idles, which is enough to run and to migrate.
# Two spare root ports leave room for hot-plugging a VF later.
SMALL_DOMAIN = """<domain type='{domain_type}'>
  <name>{name}</name>
  <memory unit='MiB'>{memory_mib}</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='q35'>hvm</type></os>
  <devices>
    <controller type='pci' model='pcie-root'/>
    <controller type='pci' model='pcie-root-port'/>
    <controller type='pci' model='pcie-root-port'/>
    <controller type='usb' model='none'/>
    <serial type='pty'/>
    <memballoon model='none'/>{hostdevs}
  </devices>
</domain>
"""


HOSTDEV = """
    <hostdev mode='subsystem' type='pci' managed='no'>
      <source><address domain='0x{domain}' bus='0x{bus}' slot='0x{slot}' function='0x{function}'/></source>
    </hostdev>"""


def hostdev_xml(address: str) -> str:
    """A `managed='no'` PCI hostdev for a function already on vfio-pci, e.g. `0000:02:00.1`."""
    domain, bus, rest = address.split(":")
    slot, function = rest.split(".")
    return HOSTDEV.format(domain=domain, bus=bus, slot=slot, function=function)


def define_small_domain(guest: Guest, name: str = "small", memory_mib: int = 128, start: bool = True,
                        hostdevs: tuple[str, ...] = ()) -> float:
    """Defines (and starts) a small persistent domain, with `hostdevs` (PCI addresses on vfio-pci)
    assigned; returns the seconds `virsh start` took."""
    path = f"/tmp/{name}.xml"
    xml = SMALL_DOMAIN.format(domain_type=DOMAIN_TYPE, name=name, memory_mib=memory_mib,
                              hostdevs="".join(hostdev_xml(a) for a in hostdevs))
    guest.run(f"cat > {path}", input=xml)
    guest.run(f"virsh define {path}")
    if not start:
        return 0.0
    t0 = time.monotonic()
    guest.run(f"virsh start {name}")
    return time.monotonic() - t0


def domain_state(guest: Guest, name: str) -> str:
    res = guest.run(f"virsh domstate {name}", check=False, quiet=True)
    return res.out.strip() if res.rc == 0 else "absent"


def migrate(src: Guest, dst: Guest, name: str, timeout: float = 300) -> float:
    """Live-migrates domain `name` from src to dst over the private link; returns the seconds it took.

    Control goes over ssh between the guests (qemu+ssh://<dst>/system), memory over a direct TCP stream to
    dst's private address. Afterwards the domain runs on dst and src no longer runs it.
    """
    if dst.link is None:
        raise ValueError(f"{dst.name} has no private link")
    t0 = time.monotonic()
    # virsh opens both connections (not --p2p); its default keepalive (5 s x 5) gave up on a busy
    # 2-core machine running two TCG guests ("connection closed due to keepalive timeout"): allow
    # two minutes of silence instead.
    src.run(f"virsh -k 10 -K 12 migrate --live --persistent --undefinesource {name} qemu+ssh://{dst.name}/system "
            f"--migrateuri tcp://{dst.link.address}", timeout=timeout)
    seconds = time.monotonic() - t0
    assert domain_state(dst, name) == "running", f"{name} is not running on {dst.name} after migration"
    assert domain_state(src, name) == "absent", f"{name} is still defined on {src.name} after migration"
    return seconds


# A domain that runs an OS: the guest's own kernel (uncompressed, booted by its PVH entry: image.NESTED_VMLINUX)
# and initramfs, no disk. A guest OS is what makes a live
# detach complete: QEMU's hot-unplug (ACPI, q35 default) waits for the guest kernel to eject the device.
# `break=top` stops the initramfs at its first step in a shell on the serial console: no udev, so no driver
# binds a hot-added VF, and the kernel keeps running (and answering hot-plug) for as long as the domain
# runs. No `panic=` on this command line: initramfs-tools reads it too and then halts instead of giving
# the shell. `loglevel=7` puts the kernel's PCI enumeration lines (`pci 0000:01:00.0: [1b36:0010] ...`) on
# the console. `on_reboot` restarts: a reset of the nested kernel boots it again instead of ending the
# domain.
OS_DOMAIN = """<domain type='{domain_type}'>
  <name>{name}</name>
  <memory unit='MiB'>{memory_mib}</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>{kernel}</kernel>
    <initrd>{initrd}</initrd>
    <cmdline>{cmdline}</cmdline>
  </os>
  <features><acpi/></features>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>restart</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <controller type='pci' model='pcie-root'/>
    <controller type='pci' model='pcie-root-port'/>
    <controller type='pci' model='pcie-root-port'/>
    <controller type='usb' model='none'/>
    <serial type='file'>
      <source path='{log}'/>
      <target port='0'/>
    </serial>
    <console type='file'>
      <source path='{log}'/>
      <target type='serial' port='0'/>
    </console>
    <memballoon model='none'/>{interfaces}{hostdevs}
  </devices>
</domain>
"""

OS_CMDLINE = "console=ttyS0 loglevel=7 break=top"

# QEMU's user-mode network (slirp, in the QEMU process): the domain reaches what its host reaches, by the
# host's own sockets, with no bridge, DHCP server or firewall rules in the guest; it migrates with the
# domain, and the destination's QEMU then opens the connections from the destination host.
USER_NET = """
    <interface type='user'>
      <mac address='{mac}'/>
      <model type='virtio'/>
    </interface>"""

# The initramfs shell's prompt: the nested kernel is up and its /init waits on the console.
OS_READY = "(initramfs)"


def serial_path(name: str) -> str:
    """Where an OS domain's serial console goes, in the guest."""
    return f"/var/log/nested-{name}.log"


def define_os_domain(guest: Guest, name: str, memory_mib: int = 256, start: bool = True,
                     hostdevs: tuple[str, ...] = (), initrd: str | None = None, cmdline: str = OS_CMDLINE,
                     user_net_mac: str | None = None, domain_type: str = DOMAIN_TYPE) -> float:
    """Defines (and starts) a persistent domain that boots the guest's own kernel and initramfs (see
    OS_DOMAIN), with `hostdevs` (PCI addresses, `managed='no'`) in its XML; returns the seconds
    `virsh start` took. `wait_os_ready` waits for its kernel. `initrd` and `cmdline` replace the guest's
    initramfs and the `break=top` command line; `user_net_mac` adds a virtio NIC on QEMU's user-mode
    network (USER_NET)."""
    release = guest.run("uname -r", quiet=True).out.strip()
    xml = OS_DOMAIN.format(domain_type=domain_type, name=name, memory_mib=memory_mib,
                           kernel=NESTED_VMLINUX.format(release=release),
                           initrd=initrd or f"/boot/initrd.img-{release}", cmdline=cmdline, log=serial_path(name),
                           interfaces=USER_NET.format(mac=user_net_mac) if user_net_mac else "",
                           hostdevs="".join(hostdev_xml(a) for a in hostdevs))
    path = f"/tmp/{name}.xml"
    guest.run(f"cat > {path}", input=xml)
    guest.run(f"virsh define {path}")
    if not start:
        return 0.0
    guest.run(f"rm -f {serial_path(name)}")
    t0 = time.monotonic()
    guest.run(f"virsh start {name}")
    return time.monotonic() - t0


def serial_lines(guest: Guest, name: str) -> list[str]:
    """The OS domain's serial console so far, one line each, without carriage returns."""
    text = guest.run(f"cat {serial_path(name)} 2>/dev/null || true", quiet=True).out
    return [line.rstrip("\r") for line in text.split("\n")]


def wait_os_ready(guest: Guest, name: str, timeout: float = 240) -> float:
    """Waits until the OS domain's initramfs shell prompt is on its console (its kernel runs); returns the
    seconds waited. Fails at once if the domain stops."""
    t0 = time.monotonic()

    def ready() -> bool:
        if any(line.startswith(OS_READY) for line in serial_lines(guest, name)):
            return True
        state = domain_state(guest, name)
        if state != "running":
            tail = "\n".join(serial_lines(guest, name)[-15:])
            raise AssertionError(f"nested domain {name} is {state!r} before its kernel came up; console:\n{tail}")
        return False

    guest.wait_for(f"the kernel of nested domain {name} ({OS_READY!r} on {serial_path(name)})", ready,
                   timeout=timeout, interval=2)
    return time.monotonic() - t0


def serial_mark(guest: Guest, name: str) -> int:
    """How many whole lines the OS domain's console has: pass it as `after` to `wait_serial` to look only
    at what comes next (the prompt line, which has no newline yet, is not counted: the kernel's next
    message continues it)."""
    return len(serial_lines(guest, name)) - 1


def wait_serial(guest: Guest, name: str, pattern: str, after: int = 0, timeout: float = 30) -> str:
    """Waits for a console line of the OS domain, after the first `after` lines (see `serial_mark`),
    that matches the regular expression `pattern`; returns that line."""
    rx = re.compile(pattern)

    def found():
        return next((line for line in serial_lines(guest, name)[after:] if rx.search(line)), None)

    return guest.wait_for(f"{pattern!r} on the console of {name}", found, timeout=timeout, interval=0.5)


@dataclass
class Hostdev:
    """A PCI hostdev of a domain's live XML."""
    source: str         # the host's function, e.g. 0000:01:00.1
    alias: str          # e.g. ua-vfiod-3-0 (libvirt's own are hostdev0, ...)
    guest_address: str  # where the domain sees it, e.g. 0000:01:00.0; "" if libvirt gives none

    @staticmethod
    def _address(element) -> str:
        if element is None:
            return ""
        value = {k: int(element.get(k, "0"), 16) for k in ("domain", "bus", "slot", "function")}
        return f"{value['domain']:04x}:{value['bus']:02x}:{value['slot']:02x}.{value['function']:x}"


def live_hostdevs(guest: Guest, name: str) -> list[Hostdev]:
    """The PCI hostdevs in the running domain's live XML (`virsh dumpxml`, captured whole first)."""
    root = ET.fromstring(guest.run(f"virsh dumpxml {name}", quiet=True).out)
    out = []
    for h in root.findall("./devices/hostdev[@type='pci']"):
        alias = h.find("alias")
        out.append(Hostdev(source=Hostdev._address(h.find("./source/address")),
                           alias=alias.get("name", "") if alias is not None else "",
                           guest_address=Hostdev._address(h.find("./address[@type='pci']"))))
    return out
