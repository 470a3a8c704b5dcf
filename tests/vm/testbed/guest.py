"""A guest: one QEMU virtual machine that plays a virtualization host (testbed.md has the measured recipe).

Layout of every guest, so that scenarios can rely on the addresses:
  00:01.0  intel-iommu is created first (the guest kernel runs with intel_iommu=on)
  00:02.0  virtio-blk root disk: a qcow2 overlay per boot over the cached read-only image
  00:03.0  virtio-net, user-mode with restrict=on; only ssh is forwarded, from 127.0.0.1:<port>
  00:04.0  virtio-net, the private guest<->guest link (a UDP socket pair on 127.0.0.1), when asked for
  00:05.0  virtio-9p, the repository, read-only, mounted by the scenarios at /mnt/vfiod
  00:10.0  pcie-root-port rp1 -> 01:00.0 QEMU NVMe (1b36:0010) with SR-IOV, 4 VFs at most (01:00.1-4)
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .image import Image
from .log import log

GUEST_REPO = "/mnt/vfiod"
PRIVATE_NET = "169.254.77"  # hosta = .1, hostb = .2 (also in the image's /etc/hosts)

# Every deadline in the test bed only ends a hung test; none is a performance bound (the timings go to
# the summary, not to an assertion). The figures written at each wait are about 2x what a quiet 2-core
# machine needs; stop 37's CI ran on a machine where every step took 1.8-2.1x as long as on the day they
# were measured, and a nested boot (120-130 s quiet) missed its 240 s. So each wait is multiplied by
# PATIENCE: 3 by default, VFIOD_TESTBED_PATIENCE to change it (1 gives the bare figures, to see how
# close a run comes to them). A passing run costs nothing more; a hung one is found a little later.
PATIENCE = float(os.environ.get("VFIOD_TESTBED_PATIENCE", "3"))


def patient(seconds: float) -> float:
    """`seconds`, a deadline measured on a quiet machine, scaled by PATIENCE."""
    return seconds * PATIENCE


def accelerator() -> str:
    """TCG where /dev/kvm is the kvm_pvm software hypervisor (a stock kernel never boots there), else KVM."""
    forced = os.environ.get("VFIOD_TESTBED_ACCEL")
    if forced:
        return forced
    if Path("/sys/module/kvm_pvm").exists() or not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg"
    return "kvm"


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    guest: str
    cmd: str
    rc: int
    out: str
    err: str
    seconds: float

    def describe(self) -> str:
        text = f"[{self.guest}] $ {self.cmd}\n  exit {self.rc} after {self.seconds:.1f} s"
        if self.out.strip():
            text += "\n  stdout:\n" + indent(self.out)
        if self.err.strip():
            text += "\n  stderr:\n" + indent(self.err)
        return text


class CommandFailed(Exception):
    def __init__(self, result: Result, why: str = ""):
        self.result = result
        super().__init__((why + "\n" if why else "") + result.describe())


class GuestError(Exception):
    pass


def indent(text: str, limit: int = 60) -> str:
    lines = text.rstrip("\n").splitlines()
    if len(lines) > limit:
        lines = [f"... ({len(lines) - limit} lines cut)"] + lines[-limit:]
    return "\n".join("    " + line for line in lines)


@dataclass
class Link:
    """This guest's end of a private link: where it sends, where it listens, its address on the link."""
    local_port: int
    remote_port: int
    address: str


def _die_with_parent() -> None:
    # QEMU must not outlive the harness (a killed CI job must not leave guests running).
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Guest:
    name: str
    index: int
    image: Image
    rundir: Path
    repo: Path
    link: Link | None = None
    memory_mib: int = 2048
    cpus: int = 2
    machine_uuid: str = field(default_factory=lambda: str(uuid.uuid4()))
    proc: subprocess.Popen | None = None
    ssh_port: int = 0

    # ---- life cycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self.rundir.mkdir(parents=True, exist_ok=True)
        overlay = self.rundir / "root.qcow2"
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(self.image.rootfs),
                        str(overlay)], check=True)
        nvme_backing = self.rundir / "nvme0.img"
        with open(nvme_backing, "wb") as f:
            f.truncate(256 << 20)
        self.ssh_port = free_port()
        accel = accelerator()
        # no_timer_check: under TCG on a busy machine the kernel's early check that the timer interrupt
        # arrives through the (interrupt-remapped) IO-APIC can miss its window and panic ("timer doesn't
        # work through Interrupt-remapped IO-APIC"); seen with both guests of a pair at load 5.
        cmdline = [
            "root=/dev/vda", "rw", "console=ttyS0", "intel_iommu=on", "no_timer_check",
            f"systemd.hostname={self.name}", f"systemd.machine_id={uuid.UUID(self.machine_uuid).hex}",
        ]
        if self.link:
            cmdline.append(f"testbed.addr={self.link.address}/24")
        args = [
            "qemu-system-x86_64",
            "-name", self.name, "-uuid", self.machine_uuid,
            "-machine", f"q35,accel={accel},kernel-irqchip=split", "-cpu", "max",
            "-m", str(self.memory_mib), "-smp", str(self.cpus),
            "-nodefaults", "-no-user-config", "-display", "none", "-vga", "none",
            # The IOMMU must be the first device.
            "-device", "intel-iommu,intremap=on,caching-mode=on",
            "-kernel", str(self.image.kernel), "-initrd", str(self.image.initrd), "-append", " ".join(cmdline),
            "-drive", f"file={overlay},if=none,id=root,format=qcow2,discard=unmap",
            "-device", "virtio-blk-pci,drive=root,bus=pcie.0,addr=0x2",
            "-netdev", f"user,id=user0,restrict=on,hostfwd=tcp:127.0.0.1:{self.ssh_port}-:22",
            "-device", f"virtio-net-pci,netdev=user0,bus=pcie.0,addr=0x3,mac=52:54:00:00:01:{self.index:02x}",
        ]
        if self.link:
            args += [
                "-netdev", f"socket,id=link0,udp=127.0.0.1:{self.link.remote_port},"
                           f"localaddr=127.0.0.1:{self.link.local_port}",
                "-device", f"virtio-net-pci,netdev=link0,bus=pcie.0,addr=0x4,mac=52:54:00:00:02:{self.index:02x}",
            ]
        args += [
            "-fsdev", f"local,id=repo,path={self.repo},security_model=none,readonly=on",
            "-device", "virtio-9p-pci,fsdev=repo,mount_tag=vfiod,bus=pcie.0,addr=0x5",
            "-device", "pcie-root-port,id=rp1,chassis=1,slot=1,bus=pcie.0,addr=0x10",
            "-device", "nvme-subsys,id=ss0,nqn=vfiod-testbed",
            "-device", "nvme,id=nvme0,serial=vfiod0,subsys=ss0,bus=rp1,"
                       "sriov_max_vfs=4,sriov_vq_flexible=8,sriov_vi_flexible=4",
            "-drive", f"file={nvme_backing},if=none,id=nvm0,format=raw",
            "-device", "nvme-ns,drive=nvm0,nsid=1",
            "-chardev", f"file,id=serial0,path={self.serial_log}", "-serial", "chardev:serial0",
            "-qmp", f"unix:{self.rundir / 'qmp.sock'},server=on,wait=off",
        ]
        (self.rundir / "qemu.cmdline").write_text(shlex.join(args) + "\n")
        log(f"{self.name}: starting QEMU ({accel}, ssh on 127.0.0.1:{self.ssh_port}, run dir {self.rundir})")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=open(self.rundir / "qemu.log", "w"),
                                     stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)

    def wait_ready(self, timeout: float = 480) -> float:
        """Waits for ssh, then for `systemctl is-system-running --wait`; returns the seconds it took."""
        start = time.monotonic()
        deadline = start + patient(timeout)
        self._wait_ssh(deadline)
        self._wait_system_running(deadline)
        seconds = time.monotonic() - start
        log(f"{self.name}: ready ({seconds:.0f} s)")
        return seconds

    def _wait_ssh(self, deadline: float) -> None:
        while True:
            self._check_alive()
            res = self.run("true", check=False, timeout=20, quiet=True)
            if res.rc == 0:
                return
            if time.monotonic() > deadline:
                raise GuestError(f"{self.name}: no ssh after waiting; last attempt:\n{res.describe()}")
            time.sleep(2)

    def _wait_system_running(self, deadline: float) -> None:
        # run() scales its timeout; the deadline is scaled already.
        res = self.run("systemctl is-system-running --wait", check=False,
                       timeout=max(10.0, deadline - time.monotonic()) / PATIENCE)
        state = res.out.strip()
        if state != "running":
            failed = self.run("systemctl --failed --no-legend; journalctl -b -p warning --no-pager | tail -40",
                              check=False)
            raise GuestError(f"{self.name}: system state is {state!r}, not 'running'\n{res.describe()}\n"
                             f"{failed.describe()}")

    def boot_id(self) -> str:
        return self.run("cat /proc/sys/kernel/random/boot_id", quiet=True).out.strip()

    def reboot(self, timeout: float = 480) -> float:
        """Reboots the guest (same overlay, same QEMU); returns the seconds until it is ready again."""
        before = self.boot_id()
        start = time.monotonic()
        self.run("systemctl reboot", check=False, timeout=30)
        self._close_ssh()
        deadline = start + patient(timeout)
        while True:
            self._check_alive()
            res = self.run("cat /proc/sys/kernel/random/boot_id", check=False, timeout=20, quiet=True)
            if res.rc == 0 and res.out.strip() and res.out.strip() != before:
                break
            if time.monotonic() > deadline:
                raise GuestError(f"{self.name}: did not come back from reboot\n{res.describe()}")
            time.sleep(2)
        self._wait_system_running(deadline)
        seconds = time.monotonic() - start
        log(f"{self.name}: rebooted ({seconds:.0f} s)")
        return seconds

    def stop(self) -> None:
        """Ends the guest at once (nothing in it needs to survive) and deletes its disks; logs stay."""
        self._close_ssh()
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for disk in ("root.qcow2", "nvme0.img"):
            (self.rundir / disk).unlink(missing_ok=True)

    def _check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            qemu_log = (self.rundir / "qemu.log").read_text(errors="replace") if self.proc else ""
            raise GuestError(f"{self.name}: QEMU is not running (exit {self.proc and self.proc.returncode})\n"
                             f"qemu.log:\n{indent(qemu_log)}")

    # ---- commands ---------------------------------------------------------------------------------

    def _ssh_options(self) -> list[str]:
        return [
            "-i", str(self.image.ssh_key),
            "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5",
            # One connection per guest: a key exchange costs about a second under TCG.
            "-o", "ControlMaster=auto", "-o", f"ControlPath={self.rundir / 'ssh.ctl'}", "-o", "ControlPersist=600",
        ]

    def _ssh_base(self) -> list[str]:
        return ["ssh", *self._ssh_options(), "-p", str(self.ssh_port)]

    def _close_ssh(self) -> None:
        if self.ssh_port:
            subprocess.run(self._ssh_base() + ["-O", "exit", "root@127.0.0.1"], capture_output=True)

    def run(self, cmd: str, check: bool = True, timeout: float = 300, input: str | None = None,
            quiet: bool = False) -> Result:
        """Runs a shell command as root in the guest. With check, a non-zero exit raises CommandFailed."""
        if not quiet:
            log(f"{self.name}$ {cmd if len(cmd) < 200 else cmd[:200] + ' ...'}")
        start = time.monotonic()
        timeout = patient(timeout)
        try:
            proc = subprocess.run(self._ssh_base() + ["root@127.0.0.1", "--", cmd], input=input,
                                  capture_output=True, text=True, timeout=timeout)
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc = -1
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""))
            err += f"\n(timed out after {timeout:.0f} s)"
        result = Result(self.name, cmd, rc, out, err, time.monotonic() - start)
        if check and rc != 0:
            raise CommandFailed(result)
        return result

    def run_as(self, user: str, cmd: str, **kwargs) -> Result:
        """Runs cmd as an unprivileged user (no login session: polkit sees an inactive subject)."""
        return self.run(f"runuser -u {shlex.quote(user)} -- sh -c {shlex.quote(cmd)}", **kwargs)

    def json(self, cmd: str, **kwargs):
        res = self.run(cmd, **kwargs)
        try:
            return json.loads(res.out)
        except json.JSONDecodeError as e:
            raise CommandFailed(res, f"output is not JSON: {e}") from None

    def copy_to(self, local: Path, remote: str) -> None:
        subprocess.run(["scp", "-q", *self._ssh_options(), "-P", str(self.ssh_port), str(local),
                        f"root@127.0.0.1:{remote}"], check=True, capture_output=True)

    def copy_from(self, remote: str, local: Path) -> None:
        """Copies a guest file to this machine (symbolic links followed: the file's content)."""
        subprocess.run(["scp", "-q", *self._ssh_options(), "-P", str(self.ssh_port), f"root@127.0.0.1:{remote}",
                        str(local)], check=True, capture_output=True)

    def wait_for(self, what: str, probe, timeout: float = 60, interval: float = 1.0):
        """Calls probe() until it returns something true; returns that, or raises after patient(timeout)
        seconds."""
        timeout = patient(timeout)
        deadline = time.monotonic() + timeout
        while True:
            value = probe()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: gave up after {timeout:.0f} s waiting for {what}")
            time.sleep(interval)

    def mount_repo(self) -> str:
        """Mounts the repository (read-only 9p) at GUEST_REPO; returns that path."""
        self.run(f"mountpoint -q {GUEST_REPO} || {{ mkdir -p {GUEST_REPO} && "
                 f"mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,ro vfiod {GUEST_REPO}; }}")
        return GUEST_REPO

    # ---- diagnostics ------------------------------------------------------------------------------

    @property
    def serial_log(self) -> Path:
        return self.rundir / "serial.log"

    def serial_tail(self, lines: int = 40) -> str:
        try:
            text = self.serial_log.read_text(errors="replace")
        except FileNotFoundError:
            return "(no serial log)"
        # The console is full of colour codes and carriage returns: keep only the text.
        text = re.sub(r"\x1b(\[[0-9;?]*[A-Za-z]|[^\[])", "", text)
        kept = [line.rstrip() for line in text.splitlines() if line.strip()]
        return "\n".join(kept[-lines:])

    def qmp(self, command: str, **arguments):
        """One QMP command on the guest's monitor socket; returns its 'return' value."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(30)
            s.connect(str(self.rundir / "qmp.sock"))
            f = s.makefile("rw")
            json.loads(f.readline())  # greeting
            for msg in ({"execute": "qmp_capabilities"}, {"execute": command, "arguments": arguments}):
                f.write(json.dumps(msg) + "\n")
                f.flush()
                while True:
                    reply = json.loads(f.readline())
                    if "event" not in reply:
                        break
                if "error" in reply:
                    raise GuestError(f"{self.name}: QMP {command}: {reply['error']}")
            return reply.get("return")


def private_pair() -> tuple[Link, Link]:
    """The two ends of a private link between host A (.1) and host B (.2): UDP on 127.0.0.1 only."""
    port_a, port_b = free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_DGRAM)
    return (Link(port_a, port_b, f"{PRIVATE_NET}.1"), Link(port_b, port_a, f"{PRIVATE_NET}.2"))
