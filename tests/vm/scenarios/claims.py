"""Claims on a real kernel: a VF claimed for a nested domain that runs an OS, live-attached and detached
through vfiod (libvirt hot-plug, seen by the nested kernel); a detach the paused domain does not acknowledge
fails after detach_timeout and completes later on libvirt's device-removed event; an attach libvirt refuses
releases its claim; an unselected device cannot be claimed; a claimed VF keeps its PF split."""

from __future__ import annotations

import re
import time

from testbed import vfiod
from testbed.guest import Guest, patient
from testbed.nested import (define_os_domain, domain_state, live_hostdevs, serial_mark, serial_path,
                            wait_os_ready, wait_serial)
from testbed.runner import Testbed, scenario
from scenarios.modes import check_split, vfs

PF = "0000:01:00.0"
VM = "nested1"
DETACH_TIMEOUT = 10
DROPIN = vfiod.TEST_DROPIN + ('scenario = "public"\n'
                              '[[select]]\nid = "1b36:0010"\nnum_vfs = 2\n'
                              f'[claims]\ndetach_timeout = {DETACH_TIMEOUT}\n')
# A function vfiod must not hand out: not selected, not used by the host (the root disk 00:02.0 and the
# ssh NIC 00:03.0 are "protected", which is another refusal), alone in its IOMMU group. The repository's
# 9p share: nothing needs it after `make install`.
UNSELECTED = "0000:00:05.0"
# What the nested kernel prints when it enumerates a hot-added NVMe VF (drivers/pci/probe.c).
VF_SEEN = r"\[1b36:0010\] type 00 class 0x010802"
ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


# ---- vfioctl ------------------------------------------------------------------------------------------

def findable(g: Guest) -> list[str]:
    """`vfioctl find --vf`: the VFs a claim could get now (one address a line; none: nothing, exit 6)."""
    res = g.run("vfioctl find --vf --id 1b36:0010", quiet=True, check=False)
    assert res.rc in (0, 6), f"`vfioctl find` failed (exit {res.rc}): {res.err}"
    out = res.out
    return [line.strip() for line in out.splitlines() if ADDRESS.match(line.strip())]


def freed(g: Guest, address: str, what: str, timeout: float = 30) -> None:
    """Waits until `address` is offered again: a claim's end holds it until its clean (a reset and a
    health check, about half a second in a guest) has brought it back to the pool."""
    g.wait_for(f"{address} to be cleaned and offered again ({what})", lambda: address in findable(g),
               timeout, 0.3)


def all_offered(g: Guest, addresses: list[str], what: str, timeout: float = 30) -> None:
    """Waits until `vfioctl find --vf` offers exactly `addresses` (their cleans done)."""
    g.wait_for(f"`vfioctl find --vf` to offer {sorted(addresses)} ({what}); it offers {findable(g)}",
               lambda: sorted(findable(g)) == sorted(addresses), timeout, 0.3)


def active_claims(g: Guest) -> dict[int, dict]:
    """`vfioctl claims --json`, by claim number."""
    data = g.json("vfioctl claims --json", quiet=True)
    assert isinstance(data, list), f"`vfioctl claims --json` is not a JSON array: {data!r}"
    return {c["id"]: c for c in data}


def claim(g: Guest, vm: str, *requirements: str) -> tuple[int, str]:
    """`vfioctl claim ... --vm VM`; returns the claim's number and its device, checked against `claims`."""
    res = g.run(f"vfioctl claim {' '.join(requirements)} --vm {vm}")
    m = re.match(r"claim (\d+): (\S+) for (\S+) \(", res.out.strip())
    assert m, f"unexpected output of vfioctl claim (want 'claim N: ADDRESS for VM (path)'):\n{res.describe()}"
    cid, address = int(m.group(1)), m.group(2)
    assert m.group(3) == vm, f"claim {cid} is for {m.group(3)}, asked for {vm}:\n{res.describe()}"
    c = active_claims(g).get(cid)
    assert c is not None, f"claim {cid} is not in `vfioctl claims --json`"
    expected = {"address": address, "functions": [address], "vm_name": vm, "state": "claimed",
                "guest_address": ""}
    wrong = {k: (c.get(k), v) for k, v in expected.items() if c.get(k) != v}
    assert not wrong, f"claim {cid} right after `vfioctl claim` (field: (is, expected)): {wrong}\n{c}"
    assert address not in findable(g), f"{address} is claimed (claim {cid}) yet `vfioctl find --vf` offers it"
    return cid, address


def attach(g: Guest, cid: int, vm: str, check: bool = True):
    return g.run(f"vfioctl attach {cid} {vm} --live --wait", check=check, timeout=120)


def detach(g: Guest, cid: int, check: bool = True):
    return g.run(f"vfioctl detach {cid} --wait", check=check, timeout=120)


# ---- checks -------------------------------------------------------------------------------------------

def check_attached(g: Guest, cid: int, address: str, mark: int) -> dict:
    """After `vfioctl attach`: the claim is attached at a guest address, the domain's live XML has the VF
    under vfiod's alias at that address, and the nested kernel enumerated it."""
    c = active_claims(g).get(cid)
    assert c is not None, f"claim {cid} is gone after a successful attach"
    assert c["state"] == "attached", f"claim {cid} is {c['state']!r} after `vfioctl attach --wait`, not 'attached'"
    assert ADDRESS.match(c["guest_address"]), f"claim {cid} has no guest address after the attach: {c}"
    alias = f"ua-vfiod-{cid}-0"
    devs = live_hostdevs(g, VM)
    mine = [h for h in devs if h.source == address]
    assert len(mine) == 1, f"{VM}'s live XML should have one hostdev for {address}, has {devs}"
    assert mine[0].alias == alias, f"the hostdev of {address} has alias {mine[0].alias!r}, expected {alias!r}"
    assert mine[0].guest_address == c["guest_address"], (
        f"claim {cid} says guest address {c['guest_address']}, the live XML {mine[0].guest_address}")
    line = wait_serial(g, VM, VF_SEEN, after=mark, timeout=30)
    print(f"    {VM}'s kernel: {line.strip()}")
    return c


def check_detached(g: Guest, cid: int, address: str) -> None:
    assert cid not in active_claims(g), f"claim {cid} is still listed after its detach: {active_claims(g).get(cid)}"
    devs = live_hostdevs(g, VM)
    assert not [h for h in devs if h.source == address], f"{address} is still in {VM}'s live XML: {devs}"
    freed(g, address, f"after claim {cid}'s detach")


def check_journal(g: Guest, late: int) -> None:
    """No warning or error in vfiod's journal but the ones this scenario provokes on purpose."""
    expected = [
        re.compile(r"refused: .*nested1"),                                    # PF mode while claimed (step 5)
        re.compile(rf"(?i)(claim {late}\b.*detach|detach.*claim {late}\b)"),  # the paused domain (step 7)
        re.compile(r"(?i)detach.*(did not complete|timed? ?out)"),
        re.compile(r"nosuchvm"),                                              # libvirt refuses (step 8)
        re.compile(r"task failed; (rolling back|its rollback settled it)"),  # steps 7 and 8's tasks
        re.compile(rf"{re.escape(UNSELECTED)}.*not selected"),                # unselected (step 9)
    ]
    unexpected = [p for p in vfiod.journal_problems(g) if not any(rx.search(p) for rx in expected)]
    assert not unexpected, "vfiod logged unexpected warnings or errors:\n  " + "\n  ".join(unexpected)


# Not in the default run by itself: there, `quickstart` runs these steps after its own, in its guest and with
# its nested domain (`after_quickstart`), which saves a guest boot and a nested kernel's (150-250 s of CI).
@scenario(default=False)
def claims(tb: Testbed) -> None:
    """claim a VF for a nested domain running an OS, attach/detach it live (the nested kernel sees it);
    a claimed VF keeps the PF split; a timed-out detach completes on the late device-removed event; a
    refused attach releases the claim; an unselected device cannot be claimed (the default run has these
    steps in `quickstart`)"""
    g = tb.boot()
    # The nested domain boots while vfiod installs and splits the NVMe (both take tens of seconds).
    t0 = time.monotonic()
    define_os_domain(g, VM)
    tb.note("install+enable (split at start)", vfiod.install(g, dropin=DROPIN))
    g.wait_for("the split at start-up", lambda: len(vfs(g)) == 2, 60)
    check_split(g)
    wait_os_ready(g, VM)
    tb.note(f"{VM} start to kernel up", time.monotonic() - t0)
    steps(tb, g)


def after_quickstart(tb: Testbed, g: Guest, quickstart_dropin: str) -> None:
    """The claims steps in the guest the quickstart leaves (vfiod installed, nested1 running, nothing
    claimed): its drop-in replaced by this scenario's, a reload splits the NVMe."""
    # The quickstart's claim left the PF on vfio-pci (it was claimed whole): the split gives it back to nvme
    # first, since vfio-pci creates no VFs (unless loaded with enable_sriov; it answers ENOENT).
    on = g.run(f"basename $(readlink /sys/bus/pci/devices/{PF}/driver)", quiet=True).out.strip()
    assert on == "vfio-pci", f"the quickstart left {PF} on {on}, not vfio-pci: the case below is not tested"
    g.run(f"rm {quickstart_dropin}")
    g.run("cat > /etc/vfiod/conf.d/test.toml", input=DROPIN)
    g.run("systemctl reload vfiod")
    g.wait_for("the split after the reload", lambda: len(vfs(g)) == 2 and not g.json(
        "vfioctl task list --json --limit 1", quiet=True)[0]["state"] in ("prepare", "running"), 60)
    check_split(g)
    split = g.json("vfioctl task list --json --limit 1", quiet=True)[0]
    assert split["kind"] == "split" and split["state"] == "success", f"the split after the reload: {split}"
    steps(tb, g)


def steps(tb: Testbed, g: Guest) -> None:
    """Steps 2-10, from a split NVMe under DROPIN and nested1's kernel up."""
    # 2. Both VFs can be claimed.
    both = vfs(g)
    assert sorted(findable(g)) == sorted(both), f"`vfioctl find --vf` offers {findable(g)}, the VFs are {both}"

    # 3-4. Claim one for nested1 and attach it live: libvirt hot-plugs it, the nested kernel sees it.
    cid, vf = claim(g, VM, "--vf", "--id", "1b36:0010")
    mark = serial_mark(g, VM)
    t = time.monotonic()
    attach(g, cid, VM)
    tb.note("vfioctl attach --live --wait", time.monotonic() - t)
    c = check_attached(g, cid, vf, mark)
    print(f"    claim {cid}: {vf} attached to {VM} at {c['guest_address']}")

    # 5. The PF cannot go back to PF mode while its VF is claimed and attached: the refusal names the VM.
    res = g.run(f"vfioctl mode {PF} pf --wait", check=False)
    assert res.rc != 0, f"PF mode was allowed while {vf} is attached to {VM}:\n{res.describe()}"
    assert VM in res.err, f"the refusal of PF mode does not name {VM}:\n{res.describe()}"
    check_split(g)
    assert any(h.source == vf for h in live_hostdevs(g, VM)), f"{vf} left {VM} after the refused PF mode"

    # 6. Detach: the nested kernel ejects it, the claim ends, the VF is free again.
    t = time.monotonic()
    detach(g, cid)
    seconds = time.monotonic() - t
    # No bound on the seconds (a performance figure, it goes to the summary): a detach the guest did not
    # acknowledge within detach_timeout fails, and detach() would have raised.
    tb.note("vfioctl detach --wait", seconds)
    check_detached(g, cid, vf)

    # 7. A paused domain does not acknowledge the unplug: the detach fails after detach_timeout, the claim
    # stays (detaching) and keeps the VF; on resume the guest ejects it, libvirt's device-removed event
    # arrives late and completes the detach.
    late, vf = claim(g, VM, "--vf", "--id", "1b36:0010")
    mark = serial_mark(g, VM)
    attach(g, late, VM)
    check_attached(g, late, vf, mark)
    g.run(f"virsh suspend {VM}")
    t = time.monotonic()
    res = detach(g, late, check=False)
    seconds = time.monotonic() - t
    tb.note("detach of a paused domain (fails)", seconds)
    assert res.rc != 0, f"vfioctl detach succeeded although {VM} is paused:\n{res.describe()}"
    assert re.search(r"(?i)did not complete|timed? ?out|not (yet )?(complete|removed|acknowledged)", res.err), \
        f"the failed detach does not say that it did not complete in time:\n{res.describe()}"
    # At least detach_timeout (vfiod waited for the guest); the upper bound only says it did not hang.
    assert DETACH_TIMEOUT - 1 <= seconds <= DETACH_TIMEOUT + patient(20), \
        f"the failed detach took {seconds:.1f} s, detach_timeout is {DETACH_TIMEOUT} s:\n{res.describe()}"
    c = active_claims(g).get(late)
    assert c is not None and c["state"] == "detaching", \
        f"after the timed-out detach claim {late} should be 'detaching', is {c and c['state']!r}: {c}"
    assert vf not in findable(g), f"{vf} is still in the paused {VM} yet `vfioctl find --vf` offers it"
    assert any(h.source == vf for h in live_hostdevs(g, VM)), \
        f"{vf} left the live XML of the paused {VM}: the late-event case did not happen"
    assert domain_state(g, VM) == "paused", f"{VM} is {domain_state(g, VM)!r}, expected paused"
    g.run(f"virsh resume {VM}")
    t = time.monotonic()
    g.wait_for(f"claim {late} to end on the late device-removed event", lambda: late not in active_claims(g), 30)
    tb.note("resume to late detach done", time.monotonic() - t)
    check_detached(g, late, vf)

    # 8. An attach libvirt refuses (no such domain) fails with libvirt's word and releases the claim.
    refused, vf = claim(g, "nosuchvm", "--vf", "--id", "1b36:0010")
    res = attach(g, refused, "nosuchvm", check=False)
    assert res.rc != 0, f"attaching to a domain that does not exist succeeded:\n{res.describe()}"
    assert "nosuchvm" in res.err, f"the failed attach does not name the domain nosuchvm:\n{res.describe()}"
    assert refused not in active_claims(g), \
        f"claim {refused} survived the refused attach: {active_claims(g).get(refused)}"
    freed(g, vf, "after the refused attach")

    # 9. A function the configuration does not select cannot be claimed.
    res = g.run(f"vfioctl claim --address {UNSELECTED} --vm {VM}", check=False)
    assert res.rc != 0, f"{UNSELECTED} (not selected) could be claimed:\n{res.describe()}"
    assert re.search(r"(?i)not selected|not managed|no device", res.err), \
        f"the refusal to claim {UNSELECTED} does not say it is not selected:\n{res.describe()}"
    assert not active_claims(g), f"claims left at the end: {active_claims(g)}"
    all_offered(g, both, "at the end")

    # 10. Nothing unexpected in vfiod's journal; the nested domain ran all along.
    check_journal(g, late)
    assert domain_state(g, VM) == "running", f"{VM} is {domain_state(g, VM)!r} at the end; see {serial_path(VM)}"
    g.run(f"virsh destroy {VM}")
