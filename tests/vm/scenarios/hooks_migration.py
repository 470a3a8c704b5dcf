"""libvirt's qemu hook and live migration with a passthrough VF, on a real kernel and two hosts: a domain
whose XML names a managed VF starts through the hook (claimed, attached) and releases it when it stops; a
second domain naming a held VF is refused naming the holder; with vfiod stopped nothing that must not fail
fails, a domain with a managed VF is refused and vfiod's reconcile catches up when it is back; `vfioctl
migrate` carries a VF-backed domain from hosta to hostb (detached, migrated, an equivalent VF claimed and
hot-added on hostb), against a plain `virsh migrate` of the same-sized domain; a destination without a free
VF refuses the migration and the domain keeps its VF on hosta."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

from testbed import vfiod
from testbed.guest import Guest
from testbed.nested import (define_os_domain, define_small_domain, domain_state, live_hostdevs, migrate,
                            serial_path, wait_os_ready, wait_serial)
from testbed.runner import Testbed, scenario
from scenarios.claims import ADDRESS, VF_SEEN, active_claims, findable, freed
from scenarios.modes import check_split, driver, vfs

DROPIN = vfiod.TEST_DROPIN + 'scenario = "public"\n[[select]]\nid = "1b36:0010"\nnum_vfs = 2\n'
HOOK = "/etc/libvirt/hooks/qemu.d/vfiod"

MOVER = "mover"      # OS domain with a VF, migrated by vfioctl migrate (hosta -> hostb)
PLAIN = "plain"      # the same OS domain without a device, migrated by virsh (hosta -> hostb)
STAYER = "stayer"    # OS domain with a VF whose migration hostb refuses (no free VF)
HOOKED = "hooked"    # small domain with a VF: started, stopped, destroyed while vfiod is down
INTRUDER = "intruder"  # small domain naming a VF that another domain holds (or while vfiod is down)
BLOCKER = "blocker"  # a VM that does not exist, holding hostb's VFs


# ---- helpers --------------------------------------------------------------------------------------------

def claims_of(g: Guest, vm: str) -> list[dict]:
    return [c for c in active_claims(g).values() if vm in (c.get("vm_name"), c.get("vm_uuid"))]


def one_claim(g: Guest, vm: str) -> dict:
    mine = claims_of(g, vm)
    assert len(mine) == 1, f"{g.name}: {vm} should hold one claim, `vfioctl claims --json` has {mine}"
    return mine[0]


def wait_attached(g: Guest, vm: str, timeout: float = 30) -> dict:
    """Waits for vm's one claim to be `attached` with a guest address; returns it."""
    def attached():
        mine = claims_of(g, vm)
        return mine[0] if len(mine) == 1 and mine[0]["state"] == "attached" and mine[0]["guest_address"] else None

    try:
        return g.wait_for(f"{vm}'s claim to be attached", attached, timeout=timeout, interval=0.5)
    except AssertionError as e:
        raise AssertionError(f"{e}; claims now: {claims_of(g, vm)}") from None


def domid(g: Guest, name: str) -> str:
    return g.run(f"virsh domid {name}", quiet=True).out.strip()


def job_summary(g: Guest, name: str) -> str:
    """What libvirt on the destination says of the domain's completed incoming migration (for the log)."""
    out = g.run(f"virsh domjobinfo {name} --completed", check=False, quiet=True).out
    keep = ("Time elapsed", "Data processed:", "Memory bandwidth:", "Downtime", "Setup time:", "Iteration")
    return "; ".join(" ".join(line.split()) for line in out.splitlines() if line.strip().startswith(keep))


def on_both(a: Guest, b: Guest, fn) -> None:
    """fn(a) and fn(b) at once (two guests, two ssh connections); the first failure is raised."""
    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(fn, a), pool.submit(fn, b)]:
            f.result()


def setup(g: Guest) -> None:
    """vfiod with `make install` (which installs the hook), the NVMe split, libvirtd restarted for the hook."""
    vfiod.install(g, dropin=DROPIN)
    g.wait_for("the split at start-up", lambda: len(vfs(g)) == 2, 60)
    check_split(g)
    g.run(f"test -x {HOOK} && ls -l {HOOK} && test \"$(readlink {HOOK})\" = /usr/local/libexec/vfiod-qemu-hook")
    g.run("systemctl restart libvirtd")
    g.wait_for("libvirtd back", lambda: g.run("virsh list", check=False, quiet=True).rc == 0, 60)


def check_journal(g: Guest, expected: list[tuple[str, str]]) -> None:
    """No warning or error in vfiod's journal but the ones listed (regex, why)."""
    problems = vfiod.journal_problems(g)
    unexpected = [p for p in problems if not any(re.search(rx, p) for rx, _ in expected)]
    assert not unexpected, f"{g.name}: vfiod logged unexpected warnings or errors:\n  " + "\n  ".join(unexpected)
    for p in problems:
        print(f"    {g.name}: expected journal line: {p}")


# ---- the scenario ---------------------------------------------------------------------------------------

def save_journals(guests: list[Guest], boots: dict[str, str]) -> None:
    """vfiod's and libvirtd's journals (every boot), into each guest's run directory (kept on failure).
    Says so when a guest rebooted meanwhile: nested SVM under TCG once reset hosta in the middle of a run."""
    for g in guests:
        for unit in ("vfiod", "libvirtd"):
            res = g.run(f"journalctl -u {unit} --no-pager -o short-precise", check=False, quiet=True, timeout=60)
            (g.rundir / f"journal-{unit}.txt").write_text(res.out + res.err)
        now = g.run("cat /proc/sys/kernel/random/boot_id", check=False, quiet=True).out.strip()
        if now != boots.get(g.name):
            print(f"    {g.name} REBOOTED during the scenario (boot id {boots.get(g.name)} -> {now}): the failure "
                  f"is likely its consequence; see {g.serial_log}")


@scenario()
def hooks_migration(tb: Testbed) -> None:
    """qemu hook (start claims and attaches a VF named in the XML, stop releases, a held VF refuses naming
    the holder, vfiod down: fail closed for managed VFs only, reconcile after) and `vfioctl migrate` of a
    VF-backed domain hosta -> hostb (VF hot-added there) vs plain virsh migrate; a destination without a
    free VF refuses and the domain keeps its VF"""
    a, b = tb.boot_pair()
    boots = {g.name: g.boot_id() for g in (a, b)}
    try:
        run(tb, a, b)
    finally:
        save_journals([a, b], boots)


def run(tb: Testbed, a: Guest, b: Guest) -> None:
    t0 = time.monotonic()
    on_both(a, b, setup)
    tb.note("install vfiod + hook, restart libvirtd (both hosts)", time.monotonic() - t0)
    vf1, vf2 = sorted(vfs(a))

    # ---- A.1: a domain whose XML names a managed VF starts through `prepare` --------------------------
    define_os_domain(a, MOVER, start=False, hostdevs=(vf2,))
    assert not claims_of(a, MOVER), f"a claim for {MOVER} before it started: {claims_of(a, MOVER)}"
    a.run(f"rm -f {serial_path(MOVER)}")
    t = time.monotonic()
    a.run(f"virsh start {MOVER}")
    tb.note("virsh start, VF claimed+bound+attached by the hook", time.monotonic() - t)
    c = one_claim(a, MOVER)
    assert c["address"] == vf2, f"{MOVER}'s claim is on {c['address']}, its XML names {vf2}: {c}"
    assert driver(a, vf2) == "vfio-pci", f"{vf2} is on {driver(a, vf2)} after prepare, not vfio-pci"
    assert c["requested_by"] == "libvirt hook", f"{MOVER}'s claim was not made by the hook: {c}"
    c = wait_attached(a, MOVER, timeout=10)
    mover_claim = c["id"]
    # Its history: claimed at `prepare`, attached at `started` (libvirt runs both before `virsh start` returns).
    events = a.run(f"vfioctl events {vf2} --limit 20", quiet=True).out
    assert re.search(rf"attached: domain {MOVER} started with it", events), \
        f"no event says the started hook attached claim {mover_claim}:\n{events}"
    print(f"    {MOVER}: claim {c['id']} on {vf2}, {c['state']} at {c['guest_address']} (by the hook)")
    assert vf2 not in findable(a), f"{vf2} is in {MOVER} yet `vfioctl find --vf` offers it"
    # The hook's own cost: the shim, vfioctl, one D-Bus call. `started` again with the live XML changes
    # nothing (the claim is attached already); the median of 3 runs, timed inside the guest.
    ms = a.run(f"virsh dumpxml {MOVER} > /tmp/{MOVER}-live.xml; for i in 1 2 3; do t0=$(date +%s%N); "
               f"{HOOK} {MOVER} started begin - < /tmp/{MOVER}-live.xml >/dev/null; "
               f"t1=$(date +%s%N); echo $(( (t1 - t0) / 1000000 )); done", quiet=True).out.split()
    tb.note("one hook run (started, by hand), median", sorted(int(x) for x in ms)[1] / 1000)
    print(f"    {HOOK} {MOVER} started begin - (by hand): {', '.join(ms)} ms")
    assert one_claim(a, MOVER) == c, f"running the started hook again changed the claim: {one_claim(a, MOVER)}"

    # A small domain with the other VF: started through the hook too, then destroyed: the claim ends.
    define_small_domain(a, HOOKED, start=False, hostdevs=(vf1,))
    t = time.monotonic()
    a.run(f"virsh start {HOOKED}")
    tb.note("virsh start of a small domain with a VF (hook)", time.monotonic() - t)
    hooked = wait_attached(a, HOOKED, timeout=10)
    assert hooked["address"] == vf1, hooked
    held_by = hooked["id"]

    # ---- A.2: a domain naming a VF that a running domain holds does not start -------------------------
    define_small_domain(a, INTRUDER, start=False, hostdevs=(vf1,))
    res = a.run(f"virsh start {INTRUDER}", check=False)
    assert res.rc != 0, f"{INTRUDER} started with {vf1}, which {HOOKED} holds:\n{res.describe()}"
    assert HOOKED in res.err and vf1 in res.err, \
        f"the refusal does not name {HOOKED} and {vf1}:\n{res.describe()}"
    refusal = [line for line in res.err.splitlines() if "vfiod" in line]
    assert len(refusal) == 1, f"vfiod's refusal should be one line:\n{res.describe()}"
    print(f"    {INTRUDER} refused: {refusal[0].strip()}")
    assert domain_state(a, INTRUDER) == "shut off", domain_state(a, INTRUDER)
    assert not claims_of(a, INTRUDER), f"the refused {INTRUDER} holds claims: {claims_of(a, INTRUDER)}"

    # A.1, the end: destroying the domain releases its claim (stopped/release hooks); the VF is free.
    a.run(f"virsh destroy {HOOKED}")
    a.wait_for(f"{HOOKED}'s claim to end", lambda: not claims_of(a, HOOKED), 10, 0.5)
    freed(a, vf1, f"after {HOOKED} stopped")
    assert hooked["id"] not in active_claims(a)

    # ---- A.3: vfiod stopped --------------------------------------------------------------------------
    a.run(f"virsh start {HOOKED}")
    hooked = wait_attached(a, HOOKED, timeout=10)
    wait_os_ready(a, MOVER)
    mover_id = domid(a, MOVER)
    a.run("systemctl stop vfiod")
    a.run(f"virsh destroy {HOOKED}")   # stopped/release hooks: vfiod does not answer, they pass
    t = time.monotonic()
    a.run("systemctl restart libvirtd")  # the reconnect hook for mover: passes
    a.wait_for("libvirtd back", lambda: a.run("virsh list", check=False, quiet=True).rc == 0, 60)
    tb.note("libvirtd restart with vfiod stopped", time.monotonic() - t)
    assert domain_state(a, MOVER) == "running" and domid(a, MOVER) == mover_id, \
        f"{MOVER} did not stay running through libvirtd's restart: {domain_state(a, MOVER)}, id {domid(a, MOVER)}"
    res = a.run(f"virsh start {INTRUDER}", check=False)
    assert res.rc != 0, f"{INTRUDER} (names managed {vf1}) started while vfiod is stopped:\n{res.describe()}"
    assert vf1 in res.err and re.search(r"vfiod cannot check|start vfiod", res.err), \
        f"the refusal while vfiod is stopped does not say so:\n{res.describe()}"
    print(f"    {INTRUDER} refused while vfiod is stopped: {res.err.strip().splitlines()[-1]}")
    # No hostdev: starts although vfiod is stopped (the same OS domain as mover, without its VF).
    tb.note("virsh start of the same domain without a device", define_os_domain(a, PLAIN))
    assert domain_state(a, PLAIN) == "running"
    a.run("systemctl start vfiod")

    # The reconcile: HOOKED stopped while vfiod was down, MOVER ran all along.
    def settled():
        return not claims_of(a, HOOKED) and [c["state"] for c in claims_of(a, MOVER)] == ["attached"]

    try:
        a.wait_for("the reconcile after vfiod's start", settled, timeout=20, interval=1)
    except AssertionError:
        raise AssertionError(f"after vfiod's start: {HOOKED} claims {claims_of(a, HOOKED)} (expected none, it "
                             f"was destroyed while vfiod was down), {MOVER} claims {claims_of(a, MOVER)} "
                             f"(expected one, attached)") from None
    assert one_claim(a, MOVER)["id"] == mover_claim
    freed(a, vf1, "after the reconcile")
    events = a.run(f"vfioctl events {vf1} --limit 20", quiet=True).out
    assert re.search(rf"released by the reconcile: {HOOKED} no longer runs", events), \
        f"no event says the reconcile released claim {hooked['id']} of {HOOKED}:\n{events}"
    # What the hook could not tell vfiod went to the journal (syslog identifier vfiod-hook).
    missed = a.run("journalctl -b -t vfiod-hook --no-pager -o cat", quiet=True).out
    for op, dom in (("stopped end", HOOKED), ("release end", HOOKED), ("reconnect begin", MOVER)):
        assert re.search(rf"vfiod: {op} of {dom} not recorded: .*reconcile will catch up", missed), \
            f"the hook did not log the {op} of {dom} it could not record:\n{missed}"
    print(f"    while vfiod was stopped, the hook logged: {missed.strip().splitlines()}")

    # ---- B.4: vfioctl migrate mover hosta -> hostb --------------------------------------------------
    uri = f"qemu+ssh://{b.name}/system"
    t = time.monotonic()
    res = a.run(f"vfioctl migrate {MOVER} {uri} --migrate-uri tcp://{b.link.address} --wait", check=False,
                timeout=300)
    took = time.monotonic() - t
    if res.rc != 0:
        journal = a.run("journalctl -u vfiod -b --no-pager -o cat | tail -30", check=False, quiet=True).out
        raise AssertionError(f"vfioctl migrate failed:\n{res.describe()}\nhosta's vfiod journal:\n{journal}")
    tb.note("vfioctl migrate --wait (VF detached, migrated)", took)
    m = re.search(r"migrated \S+ to \S+ in ([0-9.]+) s", res.out)
    assert m, f"the migrate task does not say how long libvirt's migration took:\n{res.describe()}"
    tb.note("  of which libvirt's migration", float(m.group(1)))
    print(f"    {res.out.strip()}")
    print(f"    hostb, {MOVER}'s migration: {job_summary(b, MOVER)}")
    assert domain_state(b, MOVER) == "running", f"{MOVER} is {domain_state(b, MOVER)} on hostb"
    assert domain_state(a, MOVER) == "absent", f"{MOVER} is {domain_state(a, MOVER)} on hosta after its migration"
    t = time.monotonic()
    on_b = wait_attached(b, MOVER, timeout=60)
    tb.note("hostb: migrate done to claim attached", time.monotonic() - t)
    alias = f"ua-vfiod-{on_b['id']}-0"
    devs = live_hostdevs(b, MOVER)
    mine = [h for h in devs if h.source == on_b["address"]]
    assert len(mine) == 1 and mine[0].alias == alias, \
        f"hostb: {MOVER}'s live XML should have {on_b['address']} under alias {alias}: {devs}"
    assert mine[0].guest_address == on_b["guest_address"], (mine, on_b)
    # hostb's QEMU created this console file when the migration came in: all of it is after the migration.
    line = wait_serial(b, MOVER, VF_SEEN, timeout=30)
    print(f"    hostb: claim {on_b['id']} {on_b['address']} attached to {MOVER} at {on_b['guest_address']}; "
          f"its kernel: {line.strip()}")
    assert not claims_of(a, MOVER), f"hosta still has claims for {MOVER}: {claims_of(a, MOVER)}"
    assert sorted(findable(a)) == [vf1, vf2], f"hosta offers {findable(a)} after the migration, not {[vf1, vf2]}"

    # The same-sized domain without a device, with virsh; stayer boots meanwhile.
    define_os_domain(a, STAYER, hostdevs=(vf1,))
    wait_os_ready(a, PLAIN)
    tb.note("virsh migrate --live, same domain without a device", migrate(a, b, PLAIN))
    print(f"    hostb, {PLAIN}'s migration: {job_summary(b, PLAIN)}")

    # ---- B.5: no free VF on hostb --------------------------------------------------------------------
    b.run(f"virsh destroy {MOVER}")
    b.wait_for(f"{MOVER}'s claim on hostb to end", lambda: not claims_of(b, MOVER), 10, 0.5)
    for _ in range(2):
        b.run(f"vfioctl claim --vf --id 1b36:0010 --vm {BLOCKER}")
    assert not findable(b), f"hostb still offers {findable(b)}"
    stayer = wait_attached(a, STAYER, timeout=10)
    wait_os_ready(a, STAYER)
    t = time.monotonic()
    res = a.run(f"vfioctl migrate {STAYER} {uri} --migrate-uri tcp://{b.link.address} --wait", check=False,
                timeout=300)
    tb.note("vfioctl migrate refused by hostb (detach, refusal, attach again)", time.monotonic() - t)
    assert res.rc != 0, f"{STAYER} migrated although hostb has no free VF:\n{res.describe()}"
    assert re.search(rf"{STAYER} cannot come here: no free nvme vf", res.out + res.err), \
        f"the failed migration does not say that hostb has no free VF:\n{res.describe()}"
    print(f"    refused: {[line for line in res.out.splitlines() if 'error' in line]}")
    assert domain_state(a, STAYER) == "running", f"{STAYER} is {domain_state(a, STAYER)} on hosta"
    assert domain_state(b, STAYER) == "absent", f"{STAYER} is {domain_state(b, STAYER)} on hostb"
    again = wait_attached(a, STAYER, timeout=20)
    assert again["id"] == stayer["id"] and again["address"] == vf1, (stayer, again)
    devs = live_hostdevs(a, STAYER)
    assert [h.source for h in devs] == [vf1], f"{STAYER}'s live XML after the refused migration: {devs}"
    assert not claims_of(b, STAYER), f"hostb has claims for {STAYER}: {claims_of(b, STAYER)}"
    assert len(claims_of(b, BLOCKER)) == 2

    # ---- the journals --------------------------------------------------------------------------------
    check_journal(a, [
        (r"^lost the connection to libvirt", "libvirtd restarted once the hook was installed"),
        (rf"^hook prepare begin - of {INTRUDER}: vfiod: domain {INTRUDER} cannot start: {vf1} is claimed by VM "
         rf"{HOOKED} \(claim {held_by}\)$", "A.2: the VF is held by another domain"),
        (rf"^(reconcile|released by the reconcile): {HOOKED} no longer runs: the libvirt hook claimed it for that "
         rf"run", "A.3: the claim of the domain destroyed while vfiod was stopped"),
        (r"^task failed; (rolling back|its rollback settled it)$", "B.5: the migrate task of stayer fails"),
    ])
    check_journal(b, [
        (r"^lost the connection to libvirt", "libvirtd restarted once the hook was installed"),
        (rf"^hook migrate begin - of {STAYER}: vfiod: domain {STAYER} cannot come here: no free nvme vf",
         "B.5: no free VF for the incoming domain"),
    ])
    for g, name in ((a, STAYER), (b, PLAIN)):
        g.run(f"virsh destroy {name}")
