"""The kernel's reset attributes on a real kernel (Debian 12's 6.1), as the simulated kernel models them: one
method at a time through reset_method, EINVAL for a method the function does not support, `default`, an empty
list (resets disabled, ENOTTY), and the whole bus through the root port's reset_subordinate."""

from testbed.guest import Guest
from testbed.runner import Testbed, scenario

PF = "0000:01:00.0"
VF = "0000:01:00.1"
ROOT_PORT = "0000:00:10.0"
KERNEL_METHODS = ["device_specific", "acpi", "flr", "af_flr", "pm", "bus", "cxl_bus"]


def attr(address: str, name: str) -> str:
    return f"/sys/bus/pci/devices/{address}/{name}"


def read(g: Guest, path: str) -> str:
    return g.run(f"cat {path}", quiet=True).out.strip()


def write(g: Guest, path: str, value: str):
    """One write(2) of value (no trailing newline unless it says \\n), as vfiod writes."""
    return g.run(f"printf '%b' '{value}' > {path}", check=False)


def identity(g: Guest, address: str) -> bytes:
    """Vendor, device, revision and class from config space: what the health check compares."""
    header = bytes.fromhex(g.run(f"od -An -tx1 -N64 -v {attr(address, 'config')} | tr -d ' \\n'",
                                 quiet=True).out.strip())
    assert len(header) == 64 and header != b"\xff" * 64, f"{address}: config header {header.hex()}"
    return header[0:4] + header[8:12]


@scenario(default=False)
def reset_kernel(tb: Testbed) -> None:
    """reset, reset_method and reset_subordinate on Debian 12's kernel as src/sim/kernel models them (no vfiod)"""
    g = tb.boot()
    g.run(f"echo 0 > {attr(PF, 'sriov_drivers_autoprobe')} && echo 1 > {attr(PF, 'sriov_numvfs')}")
    g.run(f"modprobe vfio-pci && echo vfio-pci > {attr(VF, 'driver_override')} && "
          f"echo {VF} > /sys/bus/pci/drivers_probe")
    before = identity(g, VF)

    listed = read(g, attr(VF, "reset_method")).split()
    print(f"VF reset_method: {' '.join(listed)}; PF: {read(g, attr(PF, 'reset_method'))}", flush=True)
    assert listed, "the VF lists no reset method"
    assert all(m in KERNEL_METHODS for m in listed), listed
    g.run(f"test -e {attr(VF, 'reset')}")

    # A name the function does not support, or no method at all: EINVAL, the list unchanged.
    unsupported = next(m for m in reversed(KERNEL_METHODS) if m not in listed)
    for bad in (unsupported, f"{listed[0]} {unsupported}", "nonsense"):
        r = write(g, attr(VF, "reset_method"), bad)
        assert r.rc != 0 and "Invalid argument" in r.err, f"{bad!r}: {r.describe()}"
        assert read(g, attr(VF, "reset_method")).split() == listed, f"changed by {bad!r}"

    # One method at a time, then the reset: what host/sysfs/reset.rs does.
    for m in listed:
        assert write(g, attr(VF, "reset_method"), m).rc == 0
        assert read(g, attr(VF, "reset_method")) == m
        with tb.timed(f"reset by {m}"):
            r = write(g, attr(VF, "reset"), "1")
        assert r.rc == 0, f"{m}: {r.describe()}"
        assert g.run(f"basename $(readlink {attr(VF, 'driver')})").out.strip() == "vfio-pci", \
            f"the driver did not stay bound after {m}"
        assert identity(g, VF) == before, f"ids or class changed by {m}"

    # `reset` takes 1 only.
    r = write(g, attr(VF, "reset"), "2")
    assert r.rc != 0 and "Invalid argument" in r.err, r.describe()

    # An empty line disables resets: the list reads empty, `reset` stays and answers ENOTTY.
    assert write(g, attr(VF, "reset_method"), "\\n").rc == 0
    assert g.run(f"wc -c < {attr(VF, 'reset_method')}").out.strip() == "0", "not an empty file"
    g.run(f"test -e {attr(VF, 'reset')}")
    r = write(g, attr(VF, "reset"), "1")
    assert r.rc != 0 and "Inappropriate ioctl" in r.err, r.describe()

    # `default` brings back the kernel's list.
    assert write(g, attr(VF, "reset_method"), "default").rc == 0
    assert read(g, attr(VF, "reset_method")).split() == listed

    # The ordered list as it was read: what reset_function puts back.
    assert write(g, attr(VF, "reset_method"), " ".join(reversed(listed))).rc == 0
    assert read(g, attr(VF, "reset_method")).split() == list(reversed(listed))

    g.run(f"echo {VF} > /sys/bus/pci/drivers/vfio-pci/unbind && echo 0 > {attr(PF, 'sriov_numvfs')}")

    # The group reset: Debian 12's 6.1 shows reset_subordinate on the root port. It resets the
    # whole bus below (here the PF alone: with a VF enabled, the VF read all-ones afterwards),
    # the PF keeping its driver and identity. Behind QEMU's root port the kernel then waits for
    # a link-active bit that never comes and answers ENOTTY ("Data Link Layer Link Active not
    # set in 1000 msec"), although the bus was reset (nvme re-initialises its controller): a
    # failed reset write does not prove that nothing was reset.
    g.run(f"test -e {attr(ROOT_PORT, 'reset_subordinate')}")
    pf_before = identity(g, PF)
    count = "dmesg | grep -c 'nvme nvme0: .*queues'"
    controller_inits = int(g.run(count, quiet=True).out)
    with tb.timed("reset_subordinate"):
        r = write(g, attr(ROOT_PORT, "reset_subordinate"), "1")
    print(f"reset_subordinate: {'ok' if r.rc == 0 else r.err.strip()}", flush=True)
    assert r.rc == 0 or "Inappropriate ioctl" in r.err, r.describe()
    after = int(g.run(count, quiet=True).out)
    assert after == controller_inits + 1, \
        f"nvme did not re-initialise its controller after the bus reset ({controller_inits} -> {after})"
    assert identity(g, PF) == pf_before, "the PF's ids or class changed"
    now = g.run(f"basename $(readlink {attr(PF, 'driver')})").out.strip()
    assert now == "nvme", f"the PF is on {now!r} after the bus reset, not nvme"
