"""vfiod in a guest: installed with `make install` from the repository share and run by systemd."""

from __future__ import annotations

import re
import time

from .guest import Guest

# Test drop-in: vfiod notices changes within seconds. Selects nothing, so vfiod changes no device.
TEST_DROPIN = """# Written by tests/vm: rescan often so that hand-made changes are seen quickly.
poll_interval = 2
"""

BINARIES = ("vfiod", "vfioctl")


def check_binaries(g: Guest) -> None:
    """The host-built release binaries must exist (the guests have no Rust toolchain)."""
    missing = [b for b in BINARIES if not (g.repo / "target" / "release" / b).exists()]
    if missing:
        raise AssertionError(f"target/release/{', '.join(missing)} missing on the outer machine: "
                             f"run `cargo build --release` first")


def install(g: Guest, dropin: str = TEST_DROPIN, start: bool = True) -> float:
    """`make install` from the read-only repository share, the test drop-in, then `enable --now`.

    Returns the seconds until the unit is active (Type=dbus: the name is on the bus).
    """
    check_binaries(g)
    repo = g.mount_repo()
    g.run(f"make -C {repo} install")
    # dbus-daemon notices a new policy file by itself, but asynchronously: without an explicit
    # reload a vfiod started right away may be refused its name (as packages do on install).
    g.run("systemctl reload dbus")
    missing = g.run("ldd /usr/local/sbin/vfiod /usr/local/bin/vfioctl | grep 'not found' || true").out.strip()
    assert not missing, f"libraries missing in the guest image:\n{missing}"
    g.run("cat > /etc/vfiod/conf.d/test.toml", input=dropin)
    # dbus-daemon notices the new bus policy through inotify, a moment later: under load vfiod was once
    # faster and was refused its bus name (AccessDenied). ReloadConfig answers once the policy is read.
    g.run("busctl call org.freedesktop.DBus /org/freedesktop/DBus org.freedesktop.DBus ReloadConfig")
    g.run("systemctl daemon-reload")
    if not start:
        return 0.0
    t0 = time.monotonic()
    res = g.run("systemctl enable --now vfiod.service", check=False, timeout=120)
    seconds = time.monotonic() - t0
    if res.rc != 0:
        status = g.run("systemctl status --no-pager -l vfiod; journalctl -u vfiod -b --no-pager | tail -40",
                       check=False)
        raise AssertionError(f"vfiod did not start\n{res.describe()}\n{status.describe()}")
    return seconds


def list_devices(g: Guest, user: str | None = None) -> list[dict]:
    cmd = "vfioctl list --json"
    data = g.json(f"runuser -u {user} -- {cmd}" if user else cmd, quiet=True)
    assert isinstance(data, list), f"`vfioctl list --json` is not a JSON array: {data!r}"
    return data


def journal_problems(g: Guest, unit: str = "vfiod") -> list[str]:
    """Warnings and errors of the unit in this boot: by journal priority, and by the log line's own level
    (vfiod logs to stderr, which the journal records at priority info whatever the line says)."""
    by_priority = g.run(f"journalctl -u {unit} -b -p warning -q --no-pager -o cat", quiet=True).out
    text = g.run(f"journalctl -u {unit} -b -q --no-pager -o cat", quiet=True).out
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    by_level = [line for line in text.splitlines() if re.search(r"\b(WARN|ERROR)\b", line)]
    return [line for line in by_priority.splitlines() if line.strip()] + by_level
