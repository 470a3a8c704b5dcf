"""Cleaning between tenants on a real kernel (issue 23): a released VF is reset by the guest's kernel
(counted by a kprobe on `pcie_flr`, which records the function's devfn) and comes back to the pool; an
operator's `[[clean]]` command runs with the VF's address and IOMMU group, its output in the task's
result; a command that exits 1 quarantines the VF (broken, not claimable, not offered) until
`vfioctl task reset`; `vfioctl clean` resets on demand."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from testbed import vfiod
from testbed.guest import Guest
from testbed.runner import Testbed, scenario
from scenarios.claims import findable
from scenarios.modes import check_split, vfs

PF = "0000:01:00.0"
# The split makes 2 VFs: 01:00.1 is cleaned by its reset alone, 01:00.2 by its reset and the
# operator's command (a `[[clean]]` entry for its address).
PLAIN = "0000:01:00.1"
SCRUBBED = "0000:01:00.2"
SCRUB = "/usr/local/libexec/vfiod-test-scrub"
# The command runs inside vfiod's unit, whose ProtectSystem=strict leaves the file system read-only
# but for /var/lib/vfiod: a command that writes elsewhere needs ReadWritePaths= in a drop-in, as an
# operator's would (docs/config.md says so). The scenario does exactly that for its log.
SCRUB_DIR = "/var/log/vfiod-test-clean"
SCRUB_LOG = f"{SCRUB_DIR}/args"
# Present: the command fails (exit 1). Read-only for the command, which only tests for it.
SCRUB_FAILS = "/etc/vfiod-test-clean-fail"
SCRUB_SCRIPT = f"""#!/bin/sh
# tests/vm clean: an operator's [[clean]] command that records how vfiod called it.
echo "$*" >> {SCRUB_LOG}
echo "scrubbed $1 ($2)"
if [ -e {SCRUB_FAILS} ]; then
    echo "scrub of $1 failed on purpose" >&2
    exit 1
fi
"""
UNIT_DROPIN = f"""[Service]
# tests/vm clean: the [[clean]] command's log.
ReadWritePaths={SCRUB_DIR}
"""
DROPIN = vfiod.TEST_DROPIN + ('scenario = "public"\n'
                              '[[select]]\nid = "1b36:0010"\nnum_vfs = 2\n'
                              '[claims]\nreset_timeout = 30\n'
                              f'[[clean]]\naddress = "{SCRUBBED}"\n'
                              f'command = "{SCRUB} {{address}} group={{group}}"\n'
                              'timeout_seconds = 30\n')

TRACING = "/sys/kernel/tracing"
# The kernel function a FLR ends in, whatever asked for it (the `reset` attribute, vfio-pci): the
# `flr` reset method (pcie_reset_flr) calls it. A kprobe event on it records each call with the
# devfn of the function reset: `struct pci_dev` begins with bus_list (16 bytes), then five pointers
# (bus, subordinate, sysdata, procent, slot), then `unsigned int devfn` at byte 56 (include/linux/pci.h,
# unchanged since long before 6.1). A devfn that matched no VF would say the layout moved.
FLR_FUNCTION = "pcie_flr"
PROBE = "vfiodtest/flr"
PROBE_LINE = re.compile(r"^\s*(?P<comm>.+?)-(?P<pid>\d+)\s+\[\d+\].*?\s(?P<ts>\d+\.\d+): flr: \(\w+\+0x0/0x\w+\) "
                        r"devfn=(?P<devfn>\d+)\s*$")


@dataclass(frozen=True)
class Flr:
    """One call of FLR_FUNCTION: the thread that made it (name, id) and the devfn of the function."""
    thread: str
    tid: int
    devfn: int


# ---- the guest kernel's count of FLRs ----------------------------------------------------------------

def start_flr_trace(g: Guest) -> None:
    """A kprobe event on FLR_FUNCTION with the devfn of the function reset, into the trace buffer."""
    g.run(f"mountpoint -q {TRACING} || mount -t tracefs tracefs {TRACING}")
    listed = g.run(f"grep -c '^{FLR_FUNCTION}$' {TRACING}/available_filter_functions", check=False, quiet=True)
    assert listed.out.strip() == "1", (
        f"{FLR_FUNCTION} is not an out-of-line kernel function in {TRACING}/available_filter_functions "
        f"(inlined?): choose the traceable function the flr reset method ends in\n{listed.describe()}")
    g.run(f"echo 'p:{PROBE} {FLR_FUNCTION} devfn=+56(%di):u32' >> {TRACING}/kprobe_events && "
          f"echo > {TRACING}/trace && echo 1 > {TRACING}/events/{PROBE}/enable && echo 1 > {TRACING}/tracing_on")


def flrs(g: Guest) -> list[Flr]:
    """Every FLR the guest's kernel did since the trace started."""
    out = g.run(f"grep -v '^#' {TRACING}/trace || true", quiet=True).out
    calls = []
    for line in out.splitlines():
        m = PROBE_LINE.match(line)
        assert m, f"a line of {TRACING}/trace that is not the {PROBE} event:\n{line}"
        calls.append(Flr(m.group("comm").strip(), int(m.group("pid")), int(m.group("devfn"))))
    return calls


def check_by_vfiod(g: Guest, flr: Flr) -> None:
    """The thread that made `flr` is one of vfiod's (its writer thread, which lives as long as vfiod)."""
    main = g.run("systemctl show -P MainPID vfiod", quiet=True).out.strip()
    tgid = g.run(f"awk '/^Tgid:/ {{print $2}}' /proc/{flr.tid}/status 2>/dev/null || true", quiet=True).out.strip()
    assert tgid == main, f"the FLR {flr} came from process {tgid or '(gone)'}, not from vfiod (PID {main})"


def devfn(address: str) -> int:
    slot, function = address.rsplit(":", 1)[1].split(".")
    return int(slot, 16) << 3 | int(function)


# ---- vfioctl -------------------------------------------------------------------------------------------

def show(g: Guest, address: str) -> dict:
    return g.json(f"vfioctl show {address} --json", quiet=True)


def claim(g: Guest, address: str, vm: str) -> int:
    c = g.json(f"vfioctl claim --address {address} --vm {vm} --json")
    assert c.get("address") == address and c.get("state") == "claimed" and c.get("vm_name") == vm, \
        f"`vfioctl claim --address {address} --vm {vm} --json` gave {c}"
    return int(c["id"])


def release(g: Guest, cid: int) -> None:
    r = g.json(f"vfioctl release {cid} --json")
    assert r.get("id") == cid and r.get("state") == "released", f"`vfioctl release {cid} --json` gave {r}"


def clean_tasks(g: Guest, address: str) -> list[dict]:
    """The clean tasks of `address`, oldest first."""
    tasks = g.json(f"vfioctl task list {address} --json --limit 100", quiet=True)
    return sorted((t for t in tasks if t["kind"] == "clean"), key=lambda t: t["id"])


def wait_clean(g: Guest, address: str, count: int, timeout: float = 60) -> dict:
    """Waits until `address` has `count` clean tasks and the last one ended; returns that task."""
    def ended():
        tasks = clean_tasks(g, address)
        if len(tasks) >= count and tasks[count - 1]["state"] in ("success", "error"):
            return tasks[count - 1]
        return None
    return g.wait_for(f"clean task {count} of {address} to end", ended, timeout=timeout, interval=0.5)


def history(g: Guest, address: str) -> list[dict]:
    """`address`'s clean events (`vfioctl events --kind clean`), oldest first."""
    entries = g.json(f"vfioctl events {address} --kind clean --json --limit 1000", quiet=True)
    return sorted(entries, key=lambda e: e["id"])


def messages(g: Guest, address: str) -> list[str]:
    return [e["message"] for e in history(g, address)]


def out_of_pool(g: Guest, address: str) -> float:
    """Seconds from the last hold of `address` (its claim's end) to its return to the pool, by the
    history's clock."""
    events = history(g, address)
    held = max(i for i, e in enumerate(events) if "held out of the pool" in e["message"])
    back = next(e for e in events[held:] if e["message"] == f"{address} is now usable")
    return (back["time_ms"] - events[held]["time_ms"]) / 1000


def seconds(task: dict) -> float:
    return (task["finished_ms"] - task["created_ms"]) / 1000


def scrub_calls(g: Guest) -> list[str]:
    return g.run(f"cat {SCRUB_LOG} 2>/dev/null || true", quiet=True).out.splitlines()


def group_of(g: Guest, address: str) -> int:
    return int(g.run(f"basename $(readlink /sys/bus/pci/devices/{address}/iommu_group)", quiet=True).out)


# ---- checks --------------------------------------------------------------------------------------------

def check_back(g: Guest, address: str, task: dict, flrs_before: int, cleans: int) -> dict:
    """After a clean that succeeded: one more FLR, of `address`, by vfiod; the reset health says flr;
    `address` usable again, on vfio-pci, offered by `vfioctl find`. Returns its reset health."""
    assert task["state"] == "success", f"the clean of {address} ended {task['state']}: {task['result']}"
    assert f"{address}: reset by flr in " in task["result"] and "healthy" in task["result"], task["result"]
    calls = flrs(g)
    new = calls[flrs_before:]
    assert [f.devfn for f in new] == [devfn(address)], (
        f"the guest kernel's FLRs during the clean of {address} (devfn {devfn(address)}): {new}; all: {calls}")
    check_by_vfiod(g, new[0])
    d = show(g, address)
    h = d.get("reset_health") or {}
    wrong = {k: (h.get(k), v) for k, v in {"method": "flr", "cleans": cleans, "failures_in_row": 0}.items()
             if h.get(k) != v}
    assert not wrong, f"{address}'s reset_health (field: (is, expected)): {wrong}\n{h}"
    assert isinstance(h.get("duration_ms"), int) and h["duration_ms"] >= 100, (
        f"{address}'s reset took {h.get('duration_ms')} ms: a FLR waits 100 ms for the function (pcie_flr)")
    assert (d["state"], d["task_state"], d["driver"]) == ("usable", "idle", "vfio-pci"), \
        f"{address} after its clean: state {d['state']!r}, task {d['task_state']!r}, driver {d['driver']!r}"
    assert address in findable(g), f"{address} is clean again but `vfioctl find --vf` does not offer it"
    return h


def check_journal(g: Guest) -> None:
    """No warning or error in vfiod's journal but the failed clean's own."""
    expected = [
        re.compile(r"^task failed(; rolling back)?$"),  # the clean whose command exits 1 (step 3)
        re.compile(rf"^{re.escape(SCRUBBED)} is now broken: quarantined: the clean command failed: "),
        # The command's stderr, the last line of that quarantine's reason (its output is in it).
        re.compile(rf"^scrub of {re.escape(SCRUBBED)} failed on purpose$"),
    ]
    unexpected = [p for p in vfiod.journal_problems(g) if not any(rx.search(p) for rx in expected)]
    assert not unexpected, "vfiod logged unexpected warnings or errors:\n  " + "\n  ".join(unexpected)


@scenario()
def clean(tb: Testbed) -> None:
    """a released VF is reset by the kernel (a kprobe on pcie_flr counts it) and back in the pool;
    a [[clean]] command runs with the address and group, its output in the task's result; one that
    exits 1 quarantines the VF until `vfioctl task reset`; `vfioctl clean` on demand"""
    g = tb.boot()
    g.run(f"install -d -m 0755 {SCRUB_DIR} /usr/local/libexec /etc/systemd/system/vfiod.service.d")
    g.run(f"cat > {SCRUB} && chmod 0755 {SCRUB}", input=SCRUB_SCRIPT)
    g.run("cat > /etc/systemd/system/vfiod.service.d/test-clean.conf", input=UNIT_DROPIN)
    tb.note("install+enable (split at start)", vfiod.install(g, dropin=DROPIN))
    g.wait_for("the split at start-up", lambda: len(vfs(g)) == 2, 60)
    check_split(g)
    assert sorted(vfs(g)) == [PLAIN, SCRUBBED], f"the split made {vfs(g)}, expected {[PLAIN, SCRUBBED]}"
    # QEMU's NVMe VF has a FLR capability; its power management capability says NoSoftRst+ (no
    # pm reset) and it shares its bus with the PF (no bus reset): Linux 6.1 lists flr alone.
    for a in vfs(g):
        m = g.run(f"cat /sys/bus/pci/devices/{a}/reset_method", quiet=True).out.strip()
        assert m == "flr", f"{a}'s reset_method reads {m!r}, expected 'flr'"
    start_flr_trace(g)
    assert flrs(g) == [], f"FLRs before any clean: {flrs(g)}"

    # 1. A claim of PLAIN ends: the kernel resets it once (one FLR, its devfn, asked by vfiod), the
    # reset health says so, and it is offered again.
    cid = claim(g, PLAIN, "tenant1")
    assert PLAIN not in findable(g), f"{PLAIN} is claimed yet `vfioctl find` offers it"
    before = len(flrs(g))
    release(g, cid)
    task = wait_clean(g, PLAIN, 1)
    h = check_back(g, PLAIN, task, before, cleans=1)
    assert task["parameters"].get("claim") == cid, f"the clean task does not name claim {cid}: {task}"
    assert task["requested_by"] == f"vfiod (claim {cid} ended)", task
    events = messages(g, PLAIN)
    assert any("held out of the pool until it is cleaned" in e for e in events), events
    assert any("is clean (reset: flr" in e and "back in the pool" in e for e in events), events
    tb.note("clean task after a release (created->finished)", seconds(task))
    tb.note("its FLR (reset_health duration_ms)", h["duration_ms"] / 1000)
    tb.note("release to back in the pool", out_of_pool(g, PLAIN))
    print(f"    {PLAIN}: {task['result']}")
    print(f"    times: the FLR {h['duration_ms']} ms (reset_health), the clean task "
          f"{task['finished_ms'] - task['created_ms']} ms (created->finished), release to back in the pool "
          f"{out_of_pool(g, PLAIN) * 1000:.0f} ms (history)")
    # The next tenant gets it, and its clean is the same.
    cid = claim(g, PLAIN, "tenant2")
    before = len(flrs(g))
    release(g, cid)
    check_back(g, PLAIN, wait_clean(g, PLAIN, 2), before, cleans=2)

    # 2. A claim of SCRUBBED ends: reset, then the operator's command with its address and group.
    group = group_of(g, SCRUBBED)
    before = len(flrs(g))
    release(g, claim(g, SCRUBBED, "tenant1"))
    task = wait_clean(g, SCRUBBED, 1)
    check_back(g, SCRUBBED, task, before, cleans=1)
    assert scrub_calls(g) == [f"{SCRUBBED} group={group}"], \
        f"the [[clean]] command's calls: {scrub_calls(g)}, expected one with {SCRUBBED} group={group}"
    assert f"scrubbed {SCRUBBED} (group={group})" in task["result"], \
        f"the command's output is not in the task's result: {task['result']}"
    tb.note("clean task with the [[clean]] command", seconds(task))
    print(f"    {SCRUBBED}: {task['result']}")

    # 3. The command exits 1: SCRUBBED is quarantined (broken), not claimable, not offered.
    g.run(f"touch {SCRUB_FAILS}")
    before = len(flrs(g))
    release(g, claim(g, SCRUBBED, "tenant2"))
    task = wait_clean(g, SCRUBBED, 2)
    assert task["state"] == "error", f"the clean whose command exits 1 ended {task['state']}: {task['result']}"
    assert "the clean command failed" in task["result"] and "exit status: 1" in task["result"], task["result"]
    assert [f.devfn for f in flrs(g)[before:]] == [devfn(SCRUBBED)], "the reset ran before the failing command"
    assert len(scrub_calls(g)) == 2, f"the failing command ran {len(scrub_calls(g)) - 1} times: {scrub_calls(g)}"
    d = show(g, SCRUBBED)
    assert d["state"] == "broken" and d["state_reason"].startswith("quarantined: "), \
        f"{SCRUBBED} after the failed clean: state {d['state']!r}, reason {d['state_reason']!r}"
    assert "the clean command failed" in d["state_reason"], d["state_reason"]
    assert d["task_state"] == "error", d
    h = d["reset_health"]
    assert h["failures_in_row"] == 1 and "the clean command failed" in (h.get("failure") or ""), h
    res = g.run(f"vfioctl claim --address {SCRUBBED} --vm tenant3", check=False)
    assert res.rc == 6, f"a claim of the quarantined {SCRUBBED} should fail with 6 (no device):\n{res.describe()}"
    assert "quarantined" in res.err, f"the refusal does not say it is quarantined:\n{res.describe()}"
    assert SCRUBBED not in findable(g), f"`vfioctl find` offers the quarantined {SCRUBBED}"
    assert not g.json("vfioctl claims --json", quiet=True), "the refused claim left a claim behind"
    print(f"    {SCRUBBED}: {d['state_reason']}")

    # The operator fixes the cause and resets the task: cleaned again (reset, command), back.
    g.run(f"rm {SCRUB_FAILS}")
    before = len(flrs(g))
    g.run(f"vfioctl task reset {SCRUBBED}")
    task = wait_clean(g, SCRUBBED, 3)
    check_back(g, SCRUBBED, task, before, cleans=2)
    assert len(scrub_calls(g)) == 3, f"the command's calls after the task reset: {scrub_calls(g)}"
    assert any("quarantine cleared by" in e for e in messages(g, SCRUBBED)), messages(g, SCRUBBED)
    # And the next tenant's claim of it ends in a clean as before.
    before = len(flrs(g))
    release(g, claim(g, SCRUBBED, "tenant3"))
    check_back(g, SCRUBBED, wait_clean(g, SCRUBBED, 4), before, cleans=3)
    assert len(scrub_calls(g)) == 4, f"the command's calls: {scrub_calls(g)}"

    # 4. `vfioctl clean --wait` resets on demand.
    before = len(flrs(g))
    t = time.monotonic()
    done = g.json(f"vfioctl clean {PLAIN} --wait --json")
    tb.note("vfioctl clean --wait", time.monotonic() - t)
    assert done["kind"] == "clean" and done["state"] == "success", done
    check_back(g, PLAIN, wait_clean(g, PLAIN, 3), before, cleans=3)

    check_journal(g)
