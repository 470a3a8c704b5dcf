"""A VM with a pooled (remote) accelerator carried through a live migration on a real kernel and two hosts,
by libvirt's qemu hook and domain events alone (plain `virsh migrate`): the reference pool service runs on
hosta's private address with TLS and client certificates; a domain on hosta leases one of its devices; the
stand-in user-mode driver, inside the domain, streams numbered items through the migrations; hostb's `migrate begin` hook
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
from datetime import datetime
from pathlib import Path

from testbed import vfiod
from testbed.guest import Guest, patient
from testbed import initramfs
from testbed.nested import define_os_domain, domain_state, migrate, serial_lines, serial_path, wait_serial
from testbed.runner import Testbed, scenario
from scenarios.hooks_migration import check_journal, on_both, save_journals

VM = "pooled"
POOL = "lab"
PORT = 8443
CERTS = "/etc/vfiod/pool"
HOOK = "/etc/libvirt/hooks/qemu.d/vfiod"
POOL_UNIT = "vfiod-pool"


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

# A second qemu hook on hostb that refuses `prepare` while /run/refuse-prepare exists: a destination that
# refuses the incoming domain after vfiod's `migrate begin` answered (libvirt runs qemu.d/* in name order).
REFUSER = "/etc/libvirt/hooks/qemu.d/zz-refuse-prepare"
REFUSER_SCRIPT = """#!/bin/sh
# tests/vm pool_migration: a destination that refuses at prepare.
if [ "$2" = prepare ] && [ -e /run/refuse-prepare ]; then
    echo "test: hostb refuses $1 at prepare" >&2
    exit 1
fi
exit 0
"""


def dropin(g: Guest, pool_url: str, quiesce_at: str) -> str:
    return vfiod.TEST_DROPIN + (
        f'host_name = "{g.name}"\n\n[[pool]]\nname = "{POOL}"\nurl = "{pool_url}"\n'
        f'ca_file = "{CERTS}/ca.pem"\ncert_file = "{CERTS}/{g.name}.pem"\nkey_file = "{CERTS}/{g.name}.key"\n'
        f'quiesce_at = "{quiesce_at}"\n')


def setup(g: Guest, pool_url: str, quiesce_at: str) -> None:
    """vfiod with `make install` (the hook, vfiod-pool) and the pool section; libvirtd restarted for the hooks."""
    vfiod.install(g, dropin=dropin(g, pool_url, quiesce_at))
    g.run(f"test -x {HOOK} && test -x /usr/local/bin/vfiod-pool")
    if g.name == "hostb":
        g.run(f"cat > {REFUSER} && chmod 0755 {REFUSER}", input=REFUSER_SCRIPT)
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


def steps_since(g: Guest, claim_id: int, since_ms: int) -> list[dict]:
    return [e for e in history(g, claim_id) if e["time_ms"] >= since_ms]


def has_step(events: list[dict], pattern: str, where: str) -> None:
    assert any(re.search(pattern, e["message"]) for e in events), \
        f"{where}: no step matches {pattern!r} in:\n  " + "\n  ".join(e["message"] for e in events)


def now_ms(g: Guest) -> int:
    return int(g.run("date +%s%3N", quiet=True).out.strip())


# The nested domain's init: the guest's initramfs carries it, the driver, its libraries, the NIC's modules and
# the test CA's files (testbed.initramfs); `rdinit=` runs it instead of initramfs-tools' /init. It brings up the
# NIC on QEMU's user-mode network (nested.USER_NET: 10.0.2.15, gateway 10.0.2.2), runs the driver, prints its
# report between marks on the console, and keeps the domain running. klibc's sh, insmod and ipconfig: the
# guest's initramfs has them.
NESTED_INIT = """#!/bin/sh
# The kernel starts init with no PATH.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mkdir -p /proc /sys /dev /tmp /run
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
. /vfiod/drive.env
for m in $MODULES; do insmod /vfiod/modules/$m || echo "vfiod-drive: insmod $m failed"; done
ipconfig -t 60 -d 10.0.2.15::10.0.2.2:255.255.255.0::eth0:none >/tmp/ipconfig.log 2>&1 ||
    { echo "vfiod-drive: no network"; cat /tmp/ipconfig.log; }
echo "vfiod-drive: streaming $ITEMS items to session $SESSION as $HOST"
/vfiod/vfiod-pool drive --url "$URL" --ca-file /vfiod/ca.pem --cert /vfiod/vm.pem --key /vfiod/vm.key \\
    --session "$SESSION" --host "$HOST" --items "$ITEMS" --give-up "$GIVE_UP" --progress 10 --json >/tmp/report.json
rc=$?
echo "vfiod-drive: report"
cat /tmp/report.json
echo "vfiod-drive: exit $rc"
while :; do sleep 3600; done
"""
NESTED_INITRD = f"/var/lib/libvirt/images/{VM}-initrd.img"
NESTED_CMDLINE = "console=ttyS0 loglevel=5 rdinit=/vfiod/init"
NESTED_MAC = "52:54:00:76:66:01"
DRIVE_MARK = "vfiod-drive: "


def build_nested_initrd(a: Guest, certs: Path, pool_url: str, session: str, items: int) -> bytes:
    """The archive appended to the guest's initramfs for the nested domain: the driver from hosta's `make
    install`, the libraries `ldd` names for it there, virtio_pci and virtio_net with their dependencies, the
    VM's client certificate, and what to drive."""
    binary = "/usr/local/bin/vfiod-pool"
    cpio = initramfs.Newc()
    cpio.file("vfiod/init", NESTED_INIT.encode(), 0o755)
    cpio.file("vfiod/vfiod-pool", initramfs.fetch(a, binary), 0o755)
    for lib in initramfs.shared_libraries(a, binary):
        cpio.file(f"usr/lib/x86_64-linux-gnu/{Path(lib).name}", initramfs.fetch(a, lib), 0o755)
    modules = initramfs.module_closure(a, ["virtio_pci", "virtio_net"])
    for ko in modules:
        cpio.file(f"vfiod/modules/{Path(ko).name}", initramfs.fetch(a, ko))
    for f, name in (("ca.pem", "ca.pem"), ("vm.pem", "vm.pem"), ("vm.key", "vm.key")):
        cpio.file(f"vfiod/{name}", (certs / f).read_bytes(), 0o600 if f.endswith(".key") else 0o644)
    env = (f"URL={pool_url}\nSESSION={session}\nHOST=hosta\nITEMS={items}\nGIVE_UP=180\n"
           f"MODULES=\"{' '.join(Path(k).name for k in modules)}\"\n")
    cpio.file("vfiod/drive.env", env.encode())
    return cpio.finish()


class Driver:
    """The stand-in user-mode driver inside the nested domain, streaming to the session (its connection names
    the host the session is on, and follows it when it moves: another client connection). It reaches the pool
    by QEMU's user-mode network, from whichever host the domain runs on, and reports on the console."""

    def __init__(self, hosts: tuple[Guest, Guest], items: int):
        self.hosts, self.items = hosts, items
        # The console file is new on each host the domain lands on (libvirt truncates it when QEMU starts);
        # a reset of the nested kernel runs the init again in the same QEMU, and appends.
        self.host, self.starts_here = hosts[0], 1

    def start(self) -> None:
        a = self.hosts[0]
        line = wait_serial(a, VM, rf"^{DRIVE_MARK}(streaming|no network|insmod)", timeout=300)
        assert "streaming" in line, f"the nested domain's init failed: {line}\n" + "\n".join(serial_lines(a, VM)[-30:])
        # A few seconds of streaming before anything moves.
        time.sleep(5)
        assert self.active(), "the driver ended at once:\n" + "\n".join(serial_lines(a, VM)[-30:])

    def where(self) -> Guest:
        here = [g for g in self.hosts if domain_state(g, VM) == "running"]
        assert len(here) == 1, f"{VM} runs on {[g.name for g in here]}"
        return here[0]

    def console(self) -> list[str]:
        return serial_lines(self.where(), VM)

    def active(self) -> bool:
        where = self.where()
        if where is not self.host:
            self.host, self.starts_here = where, 0
        lines = serial_lines(where, VM)
        starts = [line for line in lines if line.startswith(f"{DRIVE_MARK}streaming")]
        assert len(starts) <= self.starts_here, \
            f"{VM}'s kernel was reset on {where.name}: its init ran again, the driver's state is gone:\n" + \
            "\n".join(lines[-30:])
        return not any(line.startswith(f"{DRIVE_MARK}exit") for line in lines)

    def report(self) -> dict:
        where = self.where()
        # Done when the driver says so; stuck when its console has said nothing new for a while (it
        # prints its progress every 10 items). No bound on the whole: how fast it streams depends on
        # the machine (20-200 items/s), and a stall, not slowness, is the failure to report, with
        # what the driver and the pool said last (stop 37's CI gave up after 900 s without either).
        seen = {"lines": -1, "at": time.monotonic()}

        def finished() -> bool:
            if not self.active():
                return True
            lines = self.console()
            if len(lines) != seen["lines"]:
                seen["lines"], seen["at"] = len(lines), time.monotonic()
            elif time.monotonic() - seen["at"] > patient(120):
                pool = self.hosts[0].run(f"journalctl -u {POOL_UNIT} --no-pager -o cat | tail -20", check=False,
                                         quiet=True).out
                raise AssertionError(f"the driver in {VM} on {where.name} printed nothing for "
                                     f"{patient(120):.0f} s; its console:\n" + "\n".join(lines[-30:])
                                     + f"\nthe pool's log (hosta):\n{pool}")
            return False

        where.wait_for("the driver in the nested domain to finish", finished, 1200, 3)
        lines = self.console()
        begin = max(i for i, line in enumerate(lines) if line == f"{DRIVE_MARK}report")
        end = next(i for i in range(begin, len(lines)) if lines[i].startswith(f"{DRIVE_MARK}exit"))
        rest = "\n".join(lines[max(0, begin - 30):begin])
        try:
            report = json.loads("\n".join(lines[begin + 1:end]))
        except json.JSONDecodeError as e:
            raise AssertionError(f"no report from the driver on {where.name}'s console of {VM} ({e}):\n"
                                 + "\n".join(lines[-40:])) from None
        print(f"    driver (in {VM}, on {where.name} now): {report}")
        assert report["lost"] == 0 and report["duplicated"] == 0 and report["wrong"] == 0, \
            f"the driver lost or duplicated items: {report}\n{rest}"
        assert report["received"] == self.items and report["submitted"] == self.items and report["complete"], \
            f"{report}\n{rest}"
        assert f"{DRIVE_MARK}exit 0" in lines, rest
        return report


def pool_window_ms(a: Guest, session: str, since: str) -> float:
    """Quiesce to the next resume as the pool saw it (its log on hosta: one clock for both)."""
    log = a.run(f"journalctl -u {POOL_UNIT} --since '{since}' --no-pager -o cat", quiet=True).out
    log = re.sub(r"\x1b\[[0-9;]*m", "", log)
    t_quiesce = t_resume = None
    for line in log.splitlines():
        m = re.match(r"(\S+Z)\s", line)
        if not m or f"session={session}" not in line and f'session="{session}"' not in line:
            continue
        t = datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp() * 1000
        if re.search(r"\bquiesced\b", line) and "state=" not in line:
            t_quiesce = t
        elif t_quiesce is not None and "session changed" in line and "state=running" in line:
            t_resume = t
            break
    assert t_quiesce is not None and t_resume is not None, f"no quiesce and resume of {session} in the pool's log:\n{log}"
    return t_resume - t_quiesce


def downtime_ms(g: Guest, name: str) -> float:
    """The VM's own downtime in its completed incoming migration, as libvirt measured it."""
    out = g.run(f"virsh domjobinfo {name} --completed", quiet=True).out
    m = re.search(r"^Total downtime:\s+(\d+)\s+ms", out, re.M)
    assert m, f"no downtime in `virsh domjobinfo {name} --completed` on {g.name}:\n{out}"
    return float(m.group(1))


def guest_clock(g: Guest) -> str:
    return g.run("date -u '+%Y-%m-%d %H:%M:%S'", quiet=True).out.strip()


# ---- the scenario ---------------------------------------------------------------------------------------

@scenario()
def pool_migration(tb: Testbed) -> None:
    """a domain leasing a pooled device, the driver's items streaming: hostb refuses it at prepare after
    quiescing at migrate begin (resumed on hosta); live-migrates hosta -> hostb (quiesce at begin) and back
    (quiesce at the switchover) by plain virsh, the hooks and events doing the pool's part; quiesce window
    vs the VM's downtime; 0 lost / 0 duplicated; with the pool down the way out is refused by the hook"""
    a, b = tb.boot_pair()
    boots = {g.name: g.boot_id() for g in (a, b)}
    try:
        run(tb, a, b)
    finally:
        for g in (a, b):
            res = g.run(f"journalctl -u '{POOL_UNIT}*' --no-pager -o short-precise", check=False, quiet=True,
                        timeout=60)
            (g.rundir / "journal-pool.txt").write_text(res.out + res.err)
            for name, path in ((f"console-{VM}.txt", serial_path(VM)), (f"qemu-{VM}.log", f"/var/log/libvirt/qemu/{VM}.log")):
                res = g.run(f"cat {path}", check=False, quiet=True, timeout=60)
                (g.rundir / name).write_text(res.out + res.err)
        save_journals([a, b], boots)


def run(tb: Testbed, a: Guest, b: Guest) -> None:
    pool_url = f"https://{a.link.address}:{PORT}"
    # hosta and hostb for vfiod, vm for the driver in the nested domain.
    certs = make_certificates(a.link.address, [a.name, b.name, "vm"])
    install_certificates(a, certs, ["ca.pem", "pool.pem", "pool.key", "hosta.pem", "hosta.key"])
    install_certificates(b, certs, ["ca.pem", "hostb.pem", "hostb.key"])
    t0 = time.monotonic()
    # The destination's quiesce_at decides: hostb quiesces at migrate begin, hosta at the switchover.
    on_both(a, b, lambda g: setup(g, pool_url, "switchover" if g is a else "begin"))
    tb.note("install vfiod + hooks + pool section, restart libvirtd (both hosts)", time.monotonic() - t0)
    start_pool(a)

    # Both hosts reach the pool over TLS with their client certificates.
    for g in (a, b):
        devices = g.json(f"vfioctl pool devices {POOL} --json", quiet=True)
        assert [d["id"] for d in devices][:1] == ["dev0"] and not devices[0]["session"], \
            f"{g.name}: `vfioctl pool devices {POOL}` over TLS: {devices}"

    # ---- lease a pooled device to a domain on hosta, which then starts with the driver inside ----------
    # Leased before the domain starts, as a cloud would: the session's id goes into the VM's initramfs.
    define_os_domain(a, VM, start=False, initrd=NESTED_INITRD, cmdline=NESTED_CMDLINE, user_net_mac=NESTED_MAC)
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

    # One driver for the whole scenario, as one application in the VM: a session numbers its items once.
    items = 6000
    t0 = time.monotonic()
    archive = build_nested_initrd(a, certs, pool_url, session, items)
    on_both(a, b, lambda g: initramfs.install_appended(g, archive, NESTED_INITRD))
    tb.note(f"the nested domain's initramfs: the guest's + {len(archive) >> 20} MiB (driver, libraries, NIC)",
            time.monotonic() - t0)
    a.run(f"rm -f {serial_path(VM)}")
    a.run(f"virsh start {VM}")
    t0 = time.monotonic()
    driver = Driver((a, b), items)
    driver.start()
    tb.note(f"{VM} boots and its driver streams", time.monotonic() - t0)

    def leased_at(g: Guest, epoch: int) -> dict | None:
        mine = pooled(g, VM)
        return mine[0] if len(mine) == 1 and mine[0]["state"] == "leased" and mine[0]["epoch"] == epoch else None

    # ---- 1. hostb refuses the domain at prepare, after quiescing at migrate begin: resumed on hosta -----
    b.run("touch /run/refuse-prepare")
    t_b = now_ms(b)
    res = a.run(f"virsh -k 10 -K 12 migrate --live --persistent --undefinesource {VM} qemu+ssh://hostb/system "
                f"--migrateuri tcp://{b.link.address}", check=False, timeout=300)
    assert res.rc != 0 and "refuses" in res.err, f"hostb's refusing prepare hook did not stop the migration:\n" \
                                                 f"{res.describe()}"
    b.run("rm -f /run/refuse-prepare")
    assert domain_state(a, VM) == "running" and domain_state(b, VM) == "absent"
    # hosta's own record is untouched (its VM never paused; it learns the pool's new epoch when it next
    # calls the pool, or the next destination does): the pool gave the session back to hosta at epoch 2.
    mine = pooled(a, VM)
    assert len(mine) == 1 and mine[0]["state"] == "leased", f"hosta's claim after the refused migration: {mine}"
    ended_b = [c for c in b.json("vfioctl pool list --all --json", quiet=True) if c.get("vm_name") == VM]
    assert ended_b, "hostb has no record of the refused incoming migration"
    steps_b = steps_since(b, ended_b[-1]["id"], t_b)
    for pattern in (r"prepare-move", r"quiesced", r"resumed on its source hosta"):
        has_step(steps_b, pattern, "hostb, the refused incoming migration")
    assert driver.active(), "the driver ended before the refused migration did: raise its items"
    print("    1. refused at prepare: resumed on hosta")

    # ---- 2. hosta -> hostb, quiesce at migrate begin (hostb's setting) ------------------------------
    since = guest_clock(a)
    t_a, t_b = now_ms(a), now_ms(b)
    tb.note("virsh migrate --live hosta -> hostb (quiesce at begin)", migrate(a, b, VM))
    assert driver.active(), "the driver ended before the migration did: it proves nothing about it"
    on_b = b.wait_for("hostb to resume the session at epoch 3", lambda: leased_at(b, 3), 30, 0.5)
    assert on_b["session"] == session, on_b
    assert not pooled(a, VM), f"hosta still holds {VM}'s session: {pooled(a, VM)}"
    b.wait_for(f"hostb: {VM}'s metadata at epoch 3", lambda: metadata_epoch(b) == "3", 20, 0.5)
    has_step(steps_since(a, lease["id"], t_a), r"quiesced at the migration's switchover|forgotten, no pool call",
             "hosta (source)")
    dst = steps_since(b, on_b["id"], t_b)
    for pattern in (r"prepare-move", r"quiesced", r"resumed on hostb at epoch 3"):
        has_step(dst, pattern, "hostb")
    window, down = pool_window_ms(a, session, since), downtime_ms(b, VM)
    tb.note("  quiesce at begin: quiesce window (pool's clock)", window / 1000)
    tb.note("  quiesce at begin: the VM's downtime (libvirt)", down / 1000)
    print(f"    2. quiesce at begin: window {window:.0f} ms, VM downtime {down:.0f} ms")

    # ---- 3. hostb -> hosta, quiesce at the switchover (hosta's setting) -------------------------------
    since = guest_clock(a)
    t_a, t_b = now_ms(a), now_ms(b)
    tb.note("virsh migrate --live hostb -> hosta (quiesce at switchover)", migrate(b, a, VM))
    assert driver.active(), "the driver ended before the migration did: it proves nothing about it"
    back = a.wait_for("hosta to resume the session at epoch 4", lambda: leased_at(a, 4), 30, 0.5)
    assert not pooled(b, VM), f"hostb still holds {VM}'s session: {pooled(b, VM)}"
    src = steps_since(b, on_b["id"], t_b)
    has_step(src, r"quiesced at the migration's switchover", "hostb (source)")
    has_step(src, r"forgotten, no pool call", "hostb (source)")
    dst = steps_since(a, back["id"], t_a)
    has_step(dst, r"prepare-move", "hosta (destination)")
    has_step(dst, r"resumed on hosta at epoch 4", "hosta (destination)")
    window, down = pool_window_ms(a, session, since), downtime_ms(a, VM)
    tb.note("  quiesce at switchover: quiesce window (pool's clock)", window / 1000)
    tb.note("  quiesce at switchover: the VM's downtime (libvirt)", down / 1000)
    print(f"    3. quiesce at switchover: window {window:.0f} ms, VM downtime {down:.0f} ms "
          f"(window - downtime: {window - down:+.0f} ms)")
    # Every item once, through the three phases; the driver followed the session there and back.
    report = driver.report()
    assert report["host"] == "hosta" and [(m["from"], m["to"]) for m in report["moves"]] == \
        [("hosta", "hostb"), ("hostb", "hosta")], f"the driver did not follow the session: {report}"
    tb.note("the driver's longest pause (three phases)", report["longest_gap_ms"] / 1000)
    for e in dst:
        print(f"    hosta {e['time_ms']}: {e['message']}")

    # ---- 4. the pool down: the migration is refused by the destination's hook ------------------------
    a.run(f"systemctl stop {POOL_UNIT}")
    t = time.monotonic()
    res = a.run(f"virsh -k 10 -K 12 migrate --live --persistent --undefinesource {VM} qemu+ssh://hostb/system "
                f"--migrateuri tcp://{b.link.address}", check=False, timeout=300)
    tb.note("virsh migrate refused by the destination's hook (pool down)", time.monotonic() - t)
    assert res.rc != 0, f"{VM} migrated to hostb although the pool is down:\n{res.describe()}"
    assert re.search(rf"vfiod.*({session}|{POOL})", res.err), \
        f"the refusal does not name the pool or session:\n{res.describe()}"
    print(f"    4. refused: {res.err.strip().splitlines()[-1]}")
    assert domain_state(a, VM) == "running" and domain_state(b, VM) == "absent"
    assert leased_at(a, 4), f"hosta's claim after the refused migration: {pooled(a, VM)}"
    assert not pooled(b, VM), f"hostb holds {VM}'s session after the refused migration: {pooled(b, VM)}"

    # The pool comes back with the session where it was (its own store).
    start_pool(a)
    devices = a.json(f"vfioctl pool devices {POOL} --json", quiet=True)
    assert devices[0]["session"] == session, f"the restarted pool lost session {session}: {devices}"

    check_journal(a, [(r"^lost the connection to libvirt", "libvirtd restarted once the hook was installed")])
    check_journal(b, [(r"^lost the connection to libvirt", "libvirtd restarted once the hooks were installed"),
                      (rf"^hook migrate begin - of {VM}: vfiod: domain {VM} cannot come here: pool {POOL}: refused to "
                       rf"move session {session} here: pool unreachable", "4. the refused migration (pool down)")])
    a.run(f"virsh destroy {VM}")
