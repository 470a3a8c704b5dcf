"""Nested domains: small libvirt domains inside a guest, and live migration between two guests."""

from __future__ import annotations

import time

from .guest import Guest

# No disk, no network: SeaBIOS finds nothing to boot and idles, which is enough to run and to migrate.
# Two spare root ports leave room for hot-plugging a VF later.
SMALL_DOMAIN = """<domain type='kvm'>
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
    xml = SMALL_DOMAIN.format(name=name, memory_mib=memory_mib, hostdevs="".join(hostdev_xml(a) for a in hostdevs))
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
