"""The Debian package (`make deb`, packaging/deb) on a fresh guest: no `make install`, only dpkg."""

from __future__ import annotations

import subprocess

from testbed import vfiod
from testbed.guest import Guest
from testbed.runner import Testbed, scenario


def prop(g: Guest, unit: str, name: str) -> str:
    return g.run(f"systemctl show -P {name} {unit}", quiet=True).out.strip()


def lspci_addresses(g: Guest) -> set[str]:
    return {line.split()[0] for line in g.run("lspci -D -n", quiet=True).out.splitlines() if line.strip()}


@scenario()
def package(tb: Testbed) -> None:
    """dpkg -i of `make deb` on a fresh guest: vfiod enabled and running, vfioctl list agrees with lspci,
    the hook installed and libvirtd restarted to read it; dpkg --purge leaves no file of the package"""
    built = subprocess.run(["make", "-C", str(tb.repo), "--no-print-directory", "deb"],
                           capture_output=True, text=True)
    assert built.returncode == 0, f"make deb failed:\n{built.stdout}\n{built.stderr}"
    deb = built.stdout.strip().splitlines()[-1]
    assert deb.endswith(".deb") and (tb.repo / deb).is_file(), f"make deb printed no package: {built.stdout}"
    # The package's files (not its directories, which it may share with others), from the archive.
    listing = subprocess.run(["dpkg-deb", "-c", str(tb.repo / deb)], capture_output=True, text=True, check=True)
    # A symlink's line ends "NAME -> TARGET": its name is the file.
    files = [line.split(None, 5)[5].split(" -> ")[0].lstrip(".")
             for line in listing.stdout.splitlines() if not line.startswith("d")]
    assert {"/usr/sbin/vfiod", "/usr/libexec/vfiod-qemu-hook", "/usr/libexec/vfiod-libvirt",
            "/etc/libvirt/hooks/qemu.d/vfiod"} <= set(files), files
    pages = {"/usr/share/man/man1/vfioctl.1.gz", "/usr/share/man/man1/vfiod-pool.1.gz",
             "/usr/share/man/man5/vfiod.toml.5.gz", "/usr/share/man/man8/vfiod.8.gz"}
    assert pages <= set(files), f"man pages missing from the package: {sorted(pages - set(files))}"

    g = tb.boot()
    repo = g.mount_repo()
    assert g.run("test -e /usr/sbin/vfiod || test -e /usr/local/sbin/vfiod", check=False).rc != 0, \
        "the guest has vfiod before the package is installed"
    libvirtd_before = prop(g, "libvirtd", "MainPID")
    g.run(f"dpkg -i {repo}/{deb}", timeout=180)

    # postinst: enabled, started (Type=dbus: its name is on the bus), D-Bus told of the policy.
    assert prop(g, "vfiod", "UnitFileState") == "enabled", "postinst did not enable vfiod.service"
    g.wait_for("vfiod to run", lambda: prop(g, "vfiod", "ActiveState") == "active", 60)
    listed = {d["address"] for d in vfiod.list_devices(g)}
    assert listed == lspci_addresses(g), \
        f"vfioctl list and lspci disagree: only vfioctl {sorted(listed - lspci_addresses(g))}, " \
        f"only lspci {sorted(lspci_addresses(g) - listed)}"
    # The hook is in libvirt's directory, and libvirtd restarted after it was (it reads the directory
    # when it starts), then works.
    g.run("test -x /etc/libvirt/hooks/qemu.d/vfiod && "
          "test \"$(readlink /etc/libvirt/hooks/qemu.d/vfiod)\" = /usr/libexec/vfiod-qemu-hook")
    libvirtd_after = prop(g, "libvirtd", "MainPID")
    assert libvirtd_after not in ("0", libvirtd_before), \
        f"libvirtd was not restarted to read the hook (MainPID {libvirtd_before} -> {libvirtd_after})"
    g.run("virsh list --all")
    problems = vfiod.journal_problems(g)
    assert not problems, "vfiod logged warnings or errors after dpkg -i:\n  " + "\n  ".join(problems)

    # remove, then purge (Debian policy: no prompt; configuration and state go).
    g.run("cat > /etc/vfiod/conf.d/mine.toml", input="poll_interval = 5\n")
    g.run("dpkg --remove vfiod", timeout=120)
    assert prop(g, "vfiod", "ActiveState") != "active", "vfiod still runs after dpkg --remove"
    assert g.run("test -f /etc/vfiod/vfiod.toml && test -f /etc/vfiod/conf.d/mine.toml", check=False).rc == 0, \
        "dpkg --remove took the configuration (only purge may)"
    g.run("dpkg --purge vfiod", timeout=120)
    quoted = " ".join(f"'{f}'" for f in files + ["/etc/vfiod", "/var/lib/vfiod"])
    left = g.run(f"for f in {quoted}; do [ -e \"$f\" ] && echo \"$f\"; done; true", quiet=True).out.split()
    assert not left, f"dpkg --purge left files of the package behind: {left}"
    assert g.run("dpkg -s vfiod", check=False).rc != 0, "dpkg still knows vfiod after --purge"
    # libvirt forgot the hook: a domain operation does not call a hook that is gone.
    g.run("virsh list --all")
