"""An initramfs of our own for a nested domain: the guest's initrd with a second archive appended (the kernel
unpacks concatenated archives in order, later files over earlier ones), written here in the kernel's `newc`
cpio format because neither this machine nor the guest image has `cpio`."""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path

from .guest import Guest


class Newc:
    """An uncompressed `newc` cpio archive, built in memory (the kernel's initramfs format: `070701` headers,
    names and data padded to 4 bytes, parent directories before their files, `TRAILER!!!` last)."""

    def __init__(self) -> None:
        self._out = bytearray()
        self._ino = 1
        self._dirs: set[str] = set()

    def _entry(self, name: str, mode: int, data: bytes = b"") -> None:
        encoded = name.encode() + b"\0"
        fields = [self._ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0]
        self._ino += 1
        self._out += b"070701" + "".join(f"{v:08x}" for v in fields).encode() + encoded
        self._out += b"\0" * (-len(self._out) % 4)
        self._out += data
        self._out += b"\0" * (-len(self._out) % 4)

    def directory(self, path: str) -> None:
        """`path` and its parents (the kernel creates no missing parent for a file)."""
        parts = path.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d not in self._dirs:
                self._dirs.add(d)
                self._entry(d, 0o040755)

    def file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        path = path.strip("/")
        if "/" in path:
            self.directory(path.rsplit("/", 1)[0])
        self._entry(path, 0o100000 | mode, data)

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        self._out += b"\0" * (-len(self._out) % 512)
        return bytes(self._out)


def fetch(guest: Guest, remote: str) -> bytes:
    """A guest file's content (symbolic links followed)."""
    with tempfile.TemporaryDirectory(prefix="vfiod-initramfs-") as d:
        local = Path(d) / "f"
        guest.copy_from(remote, local)
        return local.read_bytes()


def module_closure(guest: Guest, modules: list[str]) -> list[str]:
    """The `.ko` files that load `modules` with their dependencies, in load order (`modprobe --show-depends`
    on the guest: the nested domain boots the guest's own kernel). Built-in ones need nothing."""
    out: list[str] = []
    for m in modules:
        res = guest.run(f"modprobe --show-depends {shlex.quote(m)}", quiet=True)
        for line in res.out.splitlines():
            words = line.split()
            if words[:1] == ["insmod"] and words[1] not in out:
                out.append(words[1])
    return out


def shared_libraries(guest: Guest, binary: str) -> list[str]:
    """The shared libraries `binary` loads on the guest (`ldd`), by their resolved paths."""
    out = []
    for line in guest.run(f"ldd {shlex.quote(binary)}", quiet=True).out.splitlines():
        words = line.split()
        if "=>" in words and len(words) >= 3 and words[2].startswith("/"):
            out.append(words[2])
        elif words and words[0].startswith("/"):
            out.append(words[0])
    return out


def install_appended(guest: Guest, archive: bytes, dest: str) -> None:
    """Writes the guest's own initrd with `archive` appended to `dest` on the guest. The appended archive starts
    at a 512-byte boundary: the kernel skips the zeros between two archives and wants a `newc` header
    4-byte aligned."""
    with tempfile.TemporaryDirectory(prefix="vfiod-initramfs-") as d:
        local = Path(d) / "extra.cpio"
        local.write_bytes(archive)
        guest.copy_to(local, "/tmp/vfiod-extra.cpio")
    guest.run(f"set -e; base=/boot/initrd.img-$(uname -r); size=$(stat -c %s $base); "
              f"{{ cat $base; head -c $(( (512 - size % 512) % 512 )) /dev/zero; cat /tmp/vfiod-extra.cpio; }} "
              f"> {shlex.quote(dest)}.new && mv {shlex.quote(dest)}.new {shlex.quote(dest)} && "
              f"rm -f /tmp/vfiod-extra.cpio")
