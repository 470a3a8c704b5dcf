"""`make install` / `make uninstall` into a DESTDIR on the outer machine (no guest needed)."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from testbed.runner import Testbed, scenario


def make(repo: Path, *args: str) -> str:
    proc = subprocess.run(["make", "-C", str(repo), *args], capture_output=True, text=True)
    assert proc.returncode == 0, f"make {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def files(root: Path) -> set[str]:
    return {"/" + str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir()}


@scenario()
def install_layout(tb: Testbed) -> None:
    """make install puts each file where systemd, dbus-daemon and polkitd look; uninstall removes them"""
    with tempfile.TemporaryDirectory() as tmp:
        # Stand-in binaries: this checks the Makefile, not the build.
        target = Path(tmp) / "target"
        (target / "release").mkdir(parents=True)
        for name in ("vfiod", "vfioctl", "vfiod-pool", "vfiod-qemu-hook", "vfiod-libvirt"):
            (target / "release" / name).write_text("#!/bin/sh\n")
            (target / "release" / name).chmod(0o755)

        interfaces = {p.name for p in (tb.repo / "dbus" / "interfaces").glob("org.vfiod.Vfiod1.*.xml")}
        assert interfaces, "no dbus/interfaces/*.xml to install"
        for prefix, expected in {
            "/usr/local": {
                "/usr/local/sbin/vfiod", "/usr/local/bin/vfioctl", "/usr/local/bin/vfiod-pool",
                "/usr/local/libexec/vfiod-qemu-hook", "/usr/local/libexec/vfiod-libvirt",
                "/usr/local/lib/systemd/system/vfiod.service", "/usr/local/lib/tmpfiles.d/vfiod.conf",
                "/etc/dbus-1/system.d/org.vfiod.Vfiod1.conf", "/usr/share/polkit-1/actions/org.vfiod.vfiod1.policy",
                "/etc/vfiod/vfiod.toml",
                "/usr/local/share/doc/vfiod/README.md", "/usr/local/share/doc/vfiod/polkit.md",
                "/usr/local/share/doc/vfiod/dbus.md",
                *(f"/usr/local/share/dbus-1/interfaces/{i}" for i in interfaces),
                "/usr/local/share/man/man1/vfioctl.1", "/usr/local/share/man/man1/vfiod-pool.1",
                "/usr/local/share/man/man5/vfiod.toml.5", "/usr/local/share/man/man8/vfiod.8",
                "/usr/local/share/bash-completion/completions/vfioctl",
                "/usr/local/share/zsh/vendor-completions/_vfioctl",
                "/usr/local/share/fish/vendor_completions.d/vfioctl.fish",
            },
            "/usr": {
                "/usr/sbin/vfiod", "/usr/bin/vfioctl", "/usr/bin/vfiod-pool", "/usr/libexec/vfiod-qemu-hook",
                "/usr/libexec/vfiod-libvirt",
                "/usr/lib/systemd/system/vfiod.service", "/usr/lib/tmpfiles.d/vfiod.conf",
                "/usr/share/dbus-1/system.d/org.vfiod.Vfiod1.conf",
                "/usr/share/polkit-1/actions/org.vfiod.vfiod1.policy", "/etc/vfiod/vfiod.toml",
                "/usr/share/doc/vfiod/README.md", "/usr/share/doc/vfiod/polkit.md",
                "/usr/share/doc/vfiod/dbus.md",
                *(f"/usr/share/dbus-1/interfaces/{i}" for i in interfaces),
                "/usr/share/man/man1/vfioctl.1", "/usr/share/man/man1/vfiod-pool.1",
                "/usr/share/man/man5/vfiod.toml.5", "/usr/share/man/man8/vfiod.8",
                "/usr/share/bash-completion/completions/vfioctl",
                "/usr/share/zsh/vendor-completions/_vfioctl",
                "/usr/share/fish/vendor_completions.d/vfioctl.fish",
            },
        }.items():
            dest = Path(tmp) / ("stage" + prefix.replace("/", "-"))
            args = [f"DESTDIR={dest}", f"PREFIX={prefix}", f"CARGO_TARGET_DIR={target}"]
            make(tb.repo, "install", *args)
            hooks = {"/etc/libvirt/hooks/qemu.d/vfiod"}
            got = files(dest)
            # libvirt's hook is a symlink to the hook binary (it runs without a shell).
            link = dest / "etc/libvirt/hooks/qemu.d/vfiod"
            assert link.is_symlink() and str(link.readlink()) == f"{prefix}/libexec/vfiod-qemu-hook", \
                f"PREFIX={prefix}: {link} is not a symlink to {prefix}/libexec/vfiod-qemu-hook"
            assert got == expected | hooks, (f"PREFIX={prefix}: unexpected layout: missing "
                                             f"{sorted(expected | hooks - got)}, extra {sorted(got - expected - hooks)}")
            assert (dest / "etc/vfiod/conf.d").is_dir(), "no empty /etc/vfiod/conf.d"
            unit = (dest / prefix.lstrip("/") / "lib/systemd/system/vfiod.service").read_text()
            assert f"ExecStart={prefix}/sbin/vfiod " in unit, f"ExecStart not rewritten for PREFIX={prefix}"
            assert f"Documentation=file:{prefix}/share/doc/vfiod/README.md " in unit, \
                f"Documentation= not rewritten for PREFIX={prefix}"

            # An administrator's configuration survives a reinstall.
            (dest / "etc/vfiod/vfiod.toml").write_text("# mine\n")
            out = make(tb.repo, "install", *args)
            assert (dest / "etc/vfiod/vfiod.toml").read_text() == "# mine\n", "make install overwrote vfiod.toml"
            assert "keeping existing" in out

            make(tb.repo, "uninstall", *args)
            assert files(dest) == {"/etc/vfiod/vfiod.toml"}, f"left after uninstall: {sorted(files(dest))}"

        # Without a build, install refuses with a clear message instead of installing half.
        proc = subprocess.run(["make", "-C", str(tb.repo), "install", f"DESTDIR={tmp}/none",
                               f"CARGO_TARGET_DIR={tmp}/empty"], capture_output=True, text=True)
        assert proc.returncode != 0 and "cargo build --release" in proc.stderr, proc.stderr
        assert not Path(tmp, "none").exists()
