"""A VM with a pooled (remote) accelerator carried through a live migration on a real kernel and two hosts,
by libvirt's qemu hook and domain events alone (plain `virsh migrate`): the reference pool service runs on
hosta's private address with TLS and client certificates; a domain on hosta leases one of its devices; the
stand-in user-mode driver streams numbered items through the migration; hostb's `migrate begin` hook
prepares the move, hosta quiesces the session at the switchover, hostb resumes it at the new epoch, hosta
forgets it; the driver counts 0 lost and 0 duplicated. Then a migration back while the pool is down is
refused by hosta's hook before any memory moves, the domain keeps running on hostb, and the pool, started
again, still has the session at its epoch."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

from testbed import vfiod
from testbed.guest import Guest
from testbed.nested import define_os_domain, domain_state, migrate, wait_os_ready
from testbed.runner import Testbed, scenario
from scenarios.hooks_migration import check_journal, on_both, save_journals

VM = "pooled"
POOL = "lab"
PORT = 8443
CERTS = "/etc/vfiod/pool"
HOOK = "/etc/libvirt/hooks/qemu.d/vfiod"
POOL_UNIT = "vfiod-pool"
DRIVE_UNIT = "vfiod-drive"
DRIVE_OUT = "/var/tmp/drive.json"


# ---- certificates (made on the outer machine with openssl, copied in) -------------------------------------

def openssl(*args: str, cwd: Path) -> None:
    res = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise AssertionError(f"openssl {' '.join(args)} failed:\n{res.stderr}")


def make_certificates(pool_ip: str, hosts: list[str]) -> Path:
    """A CA, the pool's server certificate for its private address, and one client certificate per host."""
    d = Path(tempfile.mkdtemp(prefix="vfiod-pool-certs-"))
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=vfiod test pool CA", cwd=d)

    def leaf(name: str, ext: str) -> None:
        (d / f"{name}.ext").write_text(ext)
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)

    leaf("pool", f"subjectAltName=IP:{pool_ip}\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n")
    for h in hosts:
        leaf(h, f"subjectAltName=DNS:{h}\nextendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n")
    return d


def install_certificates(g: Guest, certs: Path, files: list[str]) -> None:
    g.run(f"install -d -m 0700 {CERTS}")
    for f in files:
        g.copy_to(certs / f, f"{CERTS}/{f}")
    g.run(f"chmod 0600 {CERTS}/*.key")


# ---- helpers --------------------------------------------------------------------------------------------

def dropin(g: Guest, pool_url: str) -> str:
    return vfiod.TEST_DROPIN + (
        f'host_name = "{g.name}"\n\n[[pool]]\nname = "{POOL}"\nurl = "{pool_url}"\n'
        f'ca_file = "{CERTS}/ca.pem"\ncert_file = "{CERTS}/{g.name}.pem"\nkey_file = "{CERTS}/{g.name}.key"\n')


def setup(g: Guest, pool_url: str) -> None:
    """vfiod with `make install` (the hook, vfiod-pool) and the pool section; libvirtd restarted for the hook."""
    vfiod.install(g, dropin=dropin(g, pool_url))
    g.run(f"test -x {HOOK} && test -x /usr/local/bin/vfiod-pool")
    g.run("systemctl restart libvirtd")
    g.wait_for("libvirtd back", lambda: g.run("virsh list", check=False, quiet=True).rc == 0, 60)


def start_pool(a: Guest) -> None:
    a.run(f"systemd-run --unit {POOL_UNIT} --collect /usr/local/bin/vfiod-pool --listen {a.link.address}:{PORT} "
          f"--state-dir /var/lib/vfiod-pool --tls-cert {CERTS}/pool.pem --tls-key {CERTS}/pool.key "
          f"--client-ca {CERTS}/ca.pem --hosts hosta,hostb --item-time-ms 2")
    # vfiod's own view of the pool, over TLS with hosta's client certificate.
    a.wait_for("vfiod-pool to answer", lambda: a.run(f"vfioctl pool devices {POOL} --json", check=False,
                                                     quiet=True).rc == 0, 30, 0.5)


def pooled(g: Guest, vm: str) -> list[dict]:
    return [c for c in g.json("vfioctl pool list --json", quiet=True) if c.get("vm_name") == vm]


def history(g: Guest, claim_id: int) -> list[dict]:
    return g.json(f"vfioctl pool show {claim_id} --json", quiet=True)["events"]


def step_time(events: list[dict], pattern: str, where: str) -> int:
    found = [e for e in events if re.search(pattern, e["message"])]
    assert found, f"{where}: no step matches {pattern!r} in:\n  " + "\n  ".join(e["message"] for e in events)
    return found[-1]["time_ms"]


# ---- the scenario ---------------------------------------------------------------------------------------

@scenario()
def pool_migration(tb: Testbed) -> None:
    """a domain leasing a pooled device live-migrates hosta -> hostb by plain virsh: prepare-move at the
    destination's migrate hook, quiesce at the source's switchover, resume at the destination, the driver's
    items 0 lost / 0 duplicated; the way back with the pool down is refused by the hook and nothing moves"""
    a, b = tb.boot_pair()
    boots = {g.name: g.boot_id() for g in (a, b)}
    try:
        run(tb, a, b)
    finally:
        for g in (a, b):
            res = g.run(f"journalctl -u {POOL_UNIT} -u {DRIVE_UNIT} --no-pager -o short-precise", check=False,
                        quiet=True, timeout=60)
            (g.rundir / "journal-pool.txt").write_text(res.out + res.err)
        save_journals([a, b], boots)


def run(tb: Testbed, a: Guest, b: Guest) -> None:
    pool_url = f"https://{a.link.address}:{PORT}"
    certs = make_certificates(a.link.address, [a.name, b.name])
    install_certificates(a, certs, ["ca.pem", "pool.pem", "pool.key", "hosta.pem", "hosta.key"])
    install_certificates(b, certs, ["ca.pem", "hostb.pem", "hostb.key"])
    t0 = time.monotonic()
    on_both(a, b, lambda g: setup(g, pool_url))
    tb.note("install vfiod + hook + pool section, restart libvirtd (both hosts)", time.monotonic() - t0)
    start_pool(a)

    # Both hosts reach the pool over TLS with their client certificates.
    for g in (a, b):
        devices = g.json(f"vfioctl pool devices {POOL} --json", quiet=True)
        assert [d["id"] for d in devices][:1] == ["dev0"] and not devices[0]["session"], \
            f"{g.name}: `vfioctl pool devices {POOL}` over TLS: {devices}"

    # ---- lease a pooled device to a running domain on hosta ------------------------------------------
    define_os_domain(a, VM)
    wait_os_ready(a, VM)
    lease = a.json(f"vfioctl pool lease {POOL} dev0 --vm {VM} --json")
    assert lease["state"] == "leased" and lease["epoch"] == 1 and lease["session"], lease
    session = lease["session"]
    print(f"    hosta: pooled claim {lease['id']}: {POOL}/dev0 leased to {VM}, session {session}, epoch 1")

    def metadata_epoch(g: Guest) -> str | None:
        xml = g.run(f"virsh dumpxml {VM}", quiet=True).out
        m = re.search(rf'<vfiod:pooled [^>]*session="{session}"[^>]*epoch="(\d+)"', xml) or \
            re.search(rf'<vfiod:pooled [^>]*epoch="(\d+)"[^>]*session="{session}"', xml)
        return m.group(1) if m else None

    a.wait_for(f"{VM}'s metadata to carry session {session}", lambda: metadata_epoch(a) == "1", 20, 0.5)

    # ---- the stand-in driver streams items through the migration -------------------------------------
    a.run(f"systemd-run --unit {DRIVE_UNIT} --collect -p StandardOutput=file:{DRIVE_OUT} "
          f"/usr/local/bin/vfiod-pool drive --url {pool_url} --ca-file {CERTS}/ca.pem --cert {CERTS}/hosta.pem "
          f"--key {CERTS}/hosta.key --session {session} --host hosta --items 20000 --give-up 120 --json")
    a.wait_for("the driver to stream", lambda: a.run(f"systemctl is-active {DRIVE_UNIT}", check=False,
                                                     quiet=True).out.strip() == "active", 20, 0.5)
    time.sleep(3)

    # ---- live migration hosta -> hostb by libvirt alone (hooks and events) --------------------------
    took = migrate(a, b, VM)
    tb.note("virsh migrate --live of a domain with a pooled device", took)
    # Otherwise the migration did not happen while the driver streamed, and proves nothing about it.
    assert a.run(f"systemctl is-active {DRIVE_UNIT}", check=False, quiet=True).out.strip() == "active", \
        f"the driver ended before the migration did: {a.run(f'cat {DRIVE_OUT}', check=False, quiet=True).out}"

    def resumed_on_b():
        mine = pooled(b, VM)
        return mine[0] if len(mine) == 1 and mine[0]["state"] == "leased" and mine[0]["epoch"] == 2 else None

    try:
        on_b = b.wait_for("hostb to resume the session at epoch 2", resumed_on_b, 30, 0.5)
    except AssertionError as e:
        raise AssertionError(f"{e}; hostb: {pooled(b, VM)}; hosta: {a.json('vfioctl pool list --all --json')}") \
            from None
    assert on_b["session"] == session, on_b
    assert not pooled(a, VM), f"hosta still holds {VM}'s session: {pooled(a, VM)}"
    b.wait_for(f"hostb: {VM}'s metadata at epoch 2", lambda: metadata_epoch(b) == "2", 20, 0.5)
    devices = b.json(f"vfioctl pool devices {POOL} --json", quiet=True)
    assert devices[0]["session"] == session, f"the pool lost session {session}: {devices}"

    # The steps, each with its time on the host that took it.
    ended = [c for c in a.json("vfioctl pool list --all --json", quiet=True) if c["id"] == lease["id"]]
    assert ended and ended[0]["state"] == "forgotten", f"hosta's claim after the migration: {ended}"
    src = history(a, lease["id"])
    dst = history(b, on_b["id"])
    quiesced = step_time(src, r"quiesced", "hosta")
    step_time(src, r"forgotten, no pool call", "hosta")
    step_time(dst, r"prepare|moving|move", "hostb")
    resumed = step_time(dst, rf"resumed on hostb at epoch 2", "hostb")
    for name, steps in (("hosta", src), ("hostb", dst)):
        for e in steps:
            print(f"    {name} {e['time_ms']}: {e['message']}")
    # The two guests' clocks differ by up to a second (each set from the outer machine at boot, then
    # TCG time): the pause is measured by the driver, on one clock.
    print(f"    quiesce on hosta to resume on hostb by the guests' own clocks: {resumed - quiesced} ms")

    # The driver finishes on hostb's connection with every item once.
    a.wait_for("the driver to finish", lambda: a.run(f"systemctl is-active {DRIVE_UNIT}", check=False,
                                                     quiet=True).out.strip() != "active", 400, 2)
    report = json.loads(a.run(f"cat {DRIVE_OUT}", quiet=True).out)
    print(f"    driver: {report}")
    assert report.get("lost") == 0 and report.get("duplicated") == 0 and report.get("wrong", 0) == 0, \
        f"the driver lost or duplicated items through the migration: {report}"
    assert report["received"] == 20000 and report["submitted"] == 20000, report
    assert report["host"] == "hostb" and len(report["moves"]) >= 1, \
        f"the driver did not follow the session to hostb: {report}"
    tb.note("driver's longest gap without results (the pause)", report["longest_gap_ms"] / 1000)

    # ---- the way back with the pool down: refused by hosta's migrate hook -----------------------------
    a.run(f"systemctl stop {POOL_UNIT}")
    t = time.monotonic()
    res = b.run(f"virsh -k 10 -K 12 migrate --live --persistent --undefinesource {VM} qemu+ssh://hosta/system "
                f"--migrateuri tcp://{a.link.address}", check=False, timeout=300)
    tb.note("virsh migrate refused by the destination's hook (pool down)", time.monotonic() - t)
    assert res.rc != 0, f"{VM} migrated back to hosta although the pool is down:\n{res.describe()}"
    assert re.search(rf"vfiod.*{session}|vfiod.*{POOL}", res.err), \
        f"the refusal does not name the pool or session:\n{res.describe()}"
    print(f"    refused: {res.err.strip().splitlines()[-1]}")
    assert domain_state(b, VM) == "running" and domain_state(a, VM) == "absent"
    still = pooled(b, VM)
    assert len(still) == 1 and still[0]["state"] == "leased" and still[0]["epoch"] == 2, still
    assert not pooled(a, VM), f"hosta holds {VM}'s session after the refused migration: {pooled(a, VM)}"

    # The pool comes back with the session where it was (its own store).
    start_pool(a)
    devices = b.json(f"vfioctl pool devices {POOL} --json", quiet=True)
    assert devices[0]["session"] == session, f"the restarted pool lost session {session}: {devices}"

    check_journal(a, [(r"^lost the connection to libvirt", "libvirtd restarted once the hook was installed"),
                      (r"hook migrate begin - of pooled: vfiod: ", "the refused migration back (pool down)"),
                      (r"pool lab", "the refused migration back (pool down)")])
    check_journal(b, [(r"^lost the connection to libvirt", "libvirtd restarted once the hook was installed")])
    b.run(f"virsh destroy {VM}")
