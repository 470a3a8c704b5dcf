"""Issue 32's holders on a real kernel: the NVMe PF's namespace held by a device-mapper target (holders/), by a
process with an exclusive open (O_EXCL), by a process that only has it open, and by a mount in a private mount
namespace (neither in vfiod's mount table nor open in any process: only the kernel's EBUSY to an exclusive
open tells); each time vfiod reports the PF used by the host naming the holder, `virsh start` of a domain
assigning the PF (managed='yes') is refused by the hook with that reason and the PF stays on nvme with its
namespace; once the holder is gone vfiod reports the PF usable again, by itself (no rescan).

Debian's kernel runs native NVMe multipath: the namespace's block device is
/sys/devices/virtual/nvme-subsystem/nvme-subsysN/nvmeXnY, with no PCI parent (the controller under the PF
holds only the hidden path nvmeXcZnY). Seeing through that is vfiod's job; this scenario only holds the
device that an operator would (/dev/nvmeXnY) and checks what vfiod says.

The checks run inside `host_guard`'s guest in the default set (one boot fewer in CI); this module's own
scenario runs them alone."""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass
from typing import Callable

from testbed import vfiod
from testbed.guest import Guest
from testbed.nested import DOMAIN_TYPE, SMALL_DOMAIN, domain_state
from testbed.runner import Testbed, scenario

PF = "0000:01:00.0"
DOMAIN = "taker"
HOOK = "/etc/libvirt/hooks/qemu.d/vfiod"
DM_NAME = "vfiodtest"
# vfiod polls every 2 s in the test drop-in and runs a pass on uevents: a holder must show within this.
NOTICE_TIMEOUT = 60

MANAGED_HOSTDEV = """
    <hostdev mode='subsystem' type='pci' managed='yes'>
      <source><address domain='0x{domain}' bus='0x{bus}' slot='0x{slot}' function='0x{function}'/></source>
    </hostdev>"""

# An exclusive open of a block device without O_CREAT: the kernel claims the device for the opener
# (what mount, swapon, md, LVM and ZFS do), or fails with EBUSY when someone else has claimed it.
# The image has perl, not python3. Prints the errno text on failure, nothing on success.
EXCL_OPEN = "use Fcntl; sysopen(my $f, $ARGV[0], O_RDONLY|O_EXCL) or do { print \"$!\\n\"; exit 1 }; " \
            "if (@ARGV > 1) { open(my $p, '>', $ARGV[1]) or die; print $p \"$$\\n\"; close $p; sleep 600 }"


def define_domain(g: Guest, name: str, address: str) -> None:
    """A small persistent domain assigning `address` with managed='yes' (libvirt would move it to vfio-pci)."""
    domain, bus, rest = address.split(":")
    slot, function = rest.split(".")
    hostdev = MANAGED_HOSTDEV.format(domain=domain, bus=bus, slot=slot, function=function)
    g.run(f"cat > /tmp/{name}.xml", input=SMALL_DOMAIN.format(domain_type=DOMAIN_TYPE, name=name, memory_mib=128,
                                                              hostdevs=hostdev))
    g.run(f"virsh define /tmp/{name}.xml")


def driver(g: Guest, address: str) -> str:
    return g.run(f"basename $(readlink /sys/bus/pci/devices/{address}/driver) 2>/dev/null || echo none",
                 quiet=True).out.strip()


def namespace(g: Guest) -> tuple[str, str]:
    """The PF's namespace block device: (name, its canonical sysfs path). Under native multipath it sits in
    the subsystem that lists the PF's controller; without multipath, under the controller itself."""
    script = (f"ctrl=$(ls /sys/bus/pci/devices/{PF}/nvme); "
              "for s in /sys/class/nvme-subsystem/*/; do [ -e \"$s$ctrl\" ] && ls -d \"$s\"nvme*n*; done; "
              f"ls -d /sys/bus/pci/devices/{PF}/nvme/$ctrl/nvme*n* 2>/dev/null; true")
    found = sorted({p.rsplit("/", 1)[-1] for p in g.run(script, quiet=True).out.split()})
    names = [n for n in found if re.fullmatch(r"nvme\d+n\d+", n)]  # not the hidden paths nvmeXcZnY
    assert len(names) == 1, f"expected one namespace block device of {PF}, found {found}"
    path = g.run(f"readlink -f /sys/class/block/{names[0]}", quiet=True).out.strip()
    return names[0], path


def exclusive_open(g: Guest, dev: str) -> str:
    """What the kernel answers an exclusive open of `dev`: "" when it succeeds, else the errno text."""
    res = g.run(f"perl -e {shlex.quote(EXCL_OPEN)} {dev}", check=False, quiet=True)
    return res.out.strip() if res.rc != 0 else ""


def kernel_answers(g: Guest, dev: str, expected: str, when: str) -> None:
    """Waits (10 s at most) for an exclusive open of `dev` to get `expected` ("" = success): vfiod's own
    exclusive-open probe may hold the device for an instant just then."""
    last = ""

    def probe():
        nonlocal last
        last = exclusive_open(g, dev)
        return last == expected

    try:
        g.wait_for(f"an exclusive open of {dev} {when}", probe, 10, interval=0.2)
    except AssertionError as e:
        raise AssertionError(f"{e}: it got {last or 'success'!r}, expected {expected or 'success'!r}") from None


def show(g: Guest) -> dict:
    d = g.json(f"vfioctl show {PF} --json", quiet=True)
    assert isinstance(d, dict) and d.get("address") == PF, f"`vfioctl show {PF} --json`: {d!r}"
    return d


def wait_state(g: Guest, what: str, ok: Callable[[dict], bool]) -> tuple[dict, float]:
    """Waits (NOTICE_TIMEOUT at most) until vfiod's record of the PF satisfies `ok`; returns it and the
    seconds it took. The failure says what vfiod said last."""
    start = time.monotonic()
    last: dict = {}

    def probe():
        nonlocal last
        last = show(g)
        return last if ok(last) else None

    try:
        d = g.wait_for(what, probe, NOTICE_TIMEOUT, interval=0.5)
    except AssertionError as e:
        raise AssertionError(f"{e}; vfiod's last word on {PF}: state {last.get('state')!r}, "
                             f"reason {last.get('state_reason')!r}, driver {last.get('driver')!r}") from None
    return d, time.monotonic() - start


@dataclass
class Holder:
    kind: str           # what holds the namespace, for messages and timings
    names: list[str]    # what vfiod's reason (and the hook's line) must say about the holder
    release: str        # the command that lets go of the namespace


def hold_dm(g: Guest, ns: str) -> Holder:
    g.run(f"dmsetup create {DM_NAME} --table '0 2048 linear /dev/{ns} 0'")
    dm = g.run(f"basename $(readlink -f /dev/mapper/{DM_NAME})", quiet=True).out.strip()
    holders = g.run(f"ls /sys/class/block/{ns}/holders", quiet=True).out.split()
    assert holders == [dm], f"{ns}'s holders/ lists {holders}, expected [{dm!r}] ({DM_NAME})"
    return Holder("dm linear", [ns, f"{dm} ({DM_NAME})"], f"dmsetup remove {DM_NAME}")


def background(g: Guest, what: str, cmd: str, pidfile: str) -> str:
    """Starts `cmd` detached from the ssh session; it writes its pid to `pidfile` once it holds the device."""
    g.run(f"rm -f {pidfile}; setsid nohup {cmd} </dev/null >/dev/null 2>&1 &")
    return g.wait_for(f"{what} to hold the namespace",
                      lambda: g.run(f"cat {pidfile} 2>/dev/null", check=False, quiet=True).out.strip(), 30)


def hold_excl(g: Guest, ns: str) -> Holder:
    pid = background(g, "the O_EXCL holder", f"perl -e {shlex.quote(EXCL_OPEN)} /dev/{ns} /run/vfiodtest-excl.pid",
                     "/run/vfiodtest-excl.pid")
    # The process is the exclusive holder and has the node open: vfiod names it.
    return Holder("O_EXCL open", [ns, f"pid {pid} (perl)"], stop(pid))


def hold_open(g: Guest, ns: str) -> Holder:
    script = ("echo $$ > /run/vfiodtest-open.tmp; mv /run/vfiodtest-open.tmp /run/vfiodtest-open.pid; "
              f"exec sleep 600 < /dev/{ns}")
    pid = background(g, "the plain opener", f"sh -c {shlex.quote(script)}", "/run/vfiodtest-open.pid")
    # The pid file is written before the exec: wait for sleep to have the namespace as its stdin.
    g.wait_for(f"pid {pid} to be sleep with /dev/{ns} open", lambda: g.run(
        f"[ \"$(cat /proc/{pid}/comm)\" = sleep ] && [ \"$(readlink /proc/{pid}/fd/0)\" = /dev/{ns} ]",
        check=False, quiet=True).rc == 0, 30)
    return Holder("plain open", [ns, f"pid {pid} (sleep)"], stop(pid))


def hold_mount(g: Guest, ns: str) -> Holder:
    """Mounted in a private mount namespace: not in vfiod's mount table, no process has the node open, no
    holders/: only the kernel's EBUSY to an exclusive open tells."""
    g.run(f"mkfs.ext4 -q -F /dev/{ns}")
    script = (f"mount -o ro /dev/{ns} /mnt && echo $$ > /run/vfiodtest-mount.tmp && "
              "mv /run/vfiodtest-mount.tmp /run/vfiodtest-mount.pid && exec sleep 600")
    pid = background(g, "the private-namespace mount",
                     f"unshare --mount --propagation private sh -c {shlex.quote(script)}", "/run/vfiodtest-mount.pid")
    assert ns not in g.run("cat /proc/mounts", quiet=True).out, "the private mount shows in the host's mount table"
    return Holder("private mount", [ns, "held exclusively"], stop(pid))


def stop(pid: str) -> str:
    return f"kill {pid}; while kill -0 {pid} 2>/dev/null; do sleep 0.1; done"


# Each holder and what a second exclusive open then gets from the kernel (EBUSY for a claim, success for a
# plain open): checked first, so that a change in the test bed shows as such and not as vfiod's fault.
HOLDERS = [
    (hold_dm, "Device or resource busy"),
    (hold_excl, "Device or resource busy"),
    (hold_open, ""),
    (hold_mount, "Device or resource busy"),
]


def check_holders(tb: Testbed, g: Guest, domain: str) -> None:
    """The holders, one after the other, against `domain` (defined, assigning PF with managed='yes').
    vfiod is running with its hook installed before libvirtd started; the PF is free on entry and on exit."""
    ns, path = namespace(g)
    print(f"    {PF}'s namespace: /dev/{ns} = {path}")
    d, _ = wait_state(g, f"{PF} usable before any holder", lambda d: d["state"] == "usable")
    assert driver(g, PF) == "nvme", f"{PF} is on {driver(g, PF)} before the holders, expected nvme"
    kernel_answers(g, f"/dev/{ns}", "", "before any holder")

    for hold, kernel_says in HOLDERS:
        with tb.timed(hold.__name__.replace("hold_", "holder ") + " (all steps)"):
            holder = hold(g, ns)
            kernel_answers(g, f"/dev/{ns}", kernel_says, f"with the {holder.kind}")

            def used(d: dict) -> bool:
                return d["state"] == "protected" and all(n in d["state_reason"] for n in holder.names)

            d, seconds = wait_state(g, f"vfiod to report {PF} used by the host ({holder.kind}: "
                                       f"{', '.join(holder.names)})", used)
            tb.note(f"{holder.kind}: vfiod saw it", seconds)
            assert d["state_reason"].startswith("used by the host: "), d["state_reason"]
            print(f"    {holder.kind}: vfiod says {d['state']}: {d['state_reason']}")

            res = g.run(f"virsh start {domain}", check=False, timeout=120)
            text = res.out + res.err
            assert res.rc != 0, f"{holder.kind}: virsh start {domain} must be refused:\n{res.describe()}"
            line = f"vfiod: domain {domain} cannot start: {PF} is used by the host: "
            assert line in text, f"{holder.kind}: expected {line!r} in:\n{text}"
            refusal = text[text.index(line):].splitlines()[0]
            missing = [n for n in holder.names if n not in refusal]
            assert not missing, f"{holder.kind}: the refusal does not name {missing}: {refusal}"
            print(f"    {holder.kind}: virsh start refused: {refusal}")
            assert domain_state(g, domain) == "shut off", domain_state(g, domain)
            assert driver(g, PF) == "nvme", f"{holder.kind}: {PF} is on {driver(g, PF)} after the refusal"
            assert namespace(g)[0] == ns, f"{holder.kind}: the namespace changed: {namespace(g)} (was {ns})"

            g.run(holder.release)
            kernel_answers(g, f"/dev/{ns}", "", f"after the {holder.kind} is gone")
            d, seconds = wait_state(g, f"vfiod to report {PF} usable after the {holder.kind} is gone",
                                    lambda d: d["state"] == "usable" and d["state_reason"] == "")
            tb.note(f"{holder.kind}: vfiod saw it go", seconds)


@scenario(default=False)
def host_holders(tb: Testbed) -> None:
    """the NVMe PF's namespace held by a dm target, an O_EXCL open, a plain open, a private-namespace mount:
    each time vfiod reports it used by the host naming the holder and the hook refuses a domain assigning it
    (managed='yes'), the PF staying on nvme; usable again once the holder is gone (run by default inside
    host_guard's guest)"""
    g = tb.boot("hosta")
    vfiod.install(g)
    g.run(f"test -x {HOOK}")
    # libvirt reads its hooks at start.
    g.run("systemctl restart libvirtd")
    g.wait_for("libvirtd back", lambda: g.run("virsh list", check=False, quiet=True).rc == 0, 60)
    define_domain(g, DOMAIN, PF)
    check_holders(tb, g, DOMAIN)
