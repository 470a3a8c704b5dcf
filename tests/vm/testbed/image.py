"""The guest image: Debian bookworm from Debian's archive, built with mmdebstrap, cached by recipe hash.

The recipe is everything under tests/vm/image/ (package list, files overlaid on the root file system,
the customize hook) plus BUILD below. The image lives outside the repository, in
$VFIOD_TESTBED_CACHE (default /var/cache/vfiod-testbed) under the first 16 hex digits of the recipe's
sha256, and is rebuilt only when that directory is missing or incomplete.

A built image directory holds:
  rootfs.img       raw ext4 file system (no partition table), only ever used as a read-only backing file
  vmlinuz, initrd  the image's kernel and initramfs
  vmlinux          the kernel uncompressed, which guests boot directly (also inside, NESTED_VMLINUX, for
                   nested domains)
  id_ed25519[.pub] the ssh key baked into the image (root's authorized key, and root's own key)
  recipe.txt       what was hashed, for humans
  complete         written last: a directory without it is a failed build
Beside the images, $VFIOD_TESTBED_CACHE/debs keeps the packages of the last build for the next one.
"""

from __future__ import annotations

import fcntl
import hashlib
import lzma
import os
import shutil
import subprocess
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from .log import log

RECIPE_DIR = Path(__file__).resolve().parent.parent / "image"
DEFAULT_CACHE = Path("/var/cache/vfiod-testbed")

# Everything about the build that is not a file in RECIPE_DIR. Part of the hash.
BUILD = {
    "suite": "bookworm",
    "mirrors": [
        "deb http://deb.debian.org/debian bookworm main",
        "deb http://deb.debian.org/debian bookworm-updates main",
        "deb http://deb.debian.org/debian-security bookworm-security main",
    ],
    "variant": "apt",
    "dpkgopt": [
        "path-exclude=/usr/share/man/*",
        "path-exclude=/usr/share/locale/*",
        "path-include=/usr/share/locale/locale.alias",
        "path-exclude=/usr/share/doc/*",
        "path-include=/usr/share/doc/*/copyright",
    ],
    # Free space left in the guest's root file system (the file is sparse: it costs nothing until used).
    "free_mib": 3072,
    # 3: the uncompressed kernel, for guests (vmlinux) and nested domains (NESTED_VMLINUX).
    "format": 3,
}

# The image's kernel uncompressed, an ELF file with Xen's PVH entry note (Debian's kernels have
# CONFIG_PVH), which QEMU boots directly: a nested domain under TCG inside a TCG guest spends about 55 s
# decompressing a bzImage (its initramfs prompt after 137 s from the bzImage, 83 s from this, measured
# 2026-12-07 on a quiet 2-core machine). `{release}` is `uname -r`.
NESTED_VMLINUX = "/var/lib/libvirt/images/vmlinux-{release}"


@dataclass(frozen=True)
class Image:
    dir: Path

    @property
    def rootfs(self) -> Path:
        return self.dir / "rootfs.img"

    @property
    def kernel(self) -> Path:
        """The kernel uncompressed (extract_vmlinux), booted by its PVH entry: a guest is ready about 10 s
        sooner than from the bzImage (24-26 s vs 36 s, 2026-12-07), which it no longer decompresses under
        TCG."""
        return self.dir / "vmlinux"

    @property
    def initrd(self) -> Path:
        return self.dir / "initrd"

    @property
    def ssh_key(self) -> Path:
        return self.dir / "id_ed25519"


def packages() -> list[str]:
    lines = (RECIPE_DIR / "packages").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def recipe_hash() -> tuple[str, str]:
    """Returns (sha256 hex, the text that was hashed)."""
    parts = [f"build {sorted(BUILD.items())!r}"]
    for path in sorted(p for p in RECIPE_DIR.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(RECIPE_DIR)
        if path.is_symlink():
            parts.append(f"link {rel} -> {os.readlink(path)}")
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        parts.append(f"file {rel} {path.stat().st_mode & 0o777:o} {digest}")
    text = "\n".join(parts) + "\n"
    return hashlib.sha256(text.encode()).hexdigest(), text


def cache_root() -> Path:
    return Path(os.environ.get("VFIOD_TESTBED_CACHE", DEFAULT_CACHE))


def ensure_image(rebuild: bool = False) -> tuple[Image, float | None]:
    """Returns the cached image, building it first if needed, and the build time (None if it was cached)."""
    sha, text = recipe_hash()
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / sha[:16]
    with open(root / ".lock", "w") as lock:
        # Two harness runs at once must not build the same image twice.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if rebuild and final.exists():
            shutil.rmtree(final)
        if (final / "complete").exists():
            log(f"image: cached {final}")
            return Image(final), None
        if final.exists():
            shutil.rmtree(final)
        start = time.monotonic()
        build(final, text)
        elapsed = time.monotonic() - start
        log(f"image: built {final} in {elapsed:.0f} s")
        others = sorted(p.name for p in root.iterdir()
                        if p.is_dir() and p != final and len(p.name) == 16 and "." not in p.name)
        if others:
            log(f"image: older images in {root} (delete them to free space): {', '.join(others)}")
        return Image(final), elapsed


def build(final: Path, recipe_text: str) -> None:
    work = final.with_name(final.name + f".tmp-{os.getpid()}")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    rootdir = work / "rootdir"
    try:
        debs, new_debs = final.parent / "debs", work / "debs"
        new_debs.mkdir()
        key = work / "id_ed25519"
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "vfiod-testbed", "-f", str(key)])
        cmd = [
            "mmdebstrap",
            "--mode=root",
            f"--variant={BUILD['variant']}",
            # The outer machine's /sys stays out of the chroot: nothing in the build may touch it.
            "--skip=chroot/mount/sys",
            "--include=" + ",".join(packages()),
            *[f"--dpkgopt={opt}" for opt in BUILD["dpkgopt"]],
            f"--customize-hook={RECIPE_DIR / 'customize.sh'} \"$1\"",
            # Reuse the packages of the previous build (apt checks their hashes): a changed recipe costs
            # the install time, not another 400 MB download.
            "--skip=essential/unlink",
            f"--setup-hook=mkdir -p \"$1/var/cache/apt/archives\" {debs}",
            f"--setup-hook=sync-in {debs} /var/cache/apt/archives/",
            f"--customize-hook=sync-out /var/cache/apt/archives {new_debs}",
            BUILD["suite"],
            str(rootdir),
            *BUILD["mirrors"],
        ]
        log("image: " + " ".join(cmd[:4]) + " ... (about 400 MB of packages)")
        run(cmd, env={**os.environ, "TESTBED_SSH_KEY": str(key)}, log_to=work / "mmdebstrap.log")
        boot = rootdir / "boot"
        kernels = sorted(boot.glob("vmlinuz-*"))
        initrds = sorted(boot.glob("initrd.img-*"))
        if len(kernels) != 1 or len(initrds) != 1:
            raise RuntimeError(f"expected one kernel and one initrd in {boot}, found {kernels} {initrds}")
        shutil.copy(kernels[0], work / "vmlinuz")
        shutil.copy(initrds[0], work / "initrd")
        release = kernels[0].name.removeprefix("vmlinuz-")
        vmlinux = rootdir / NESTED_VMLINUX.format(release=release).lstrip("/")
        vmlinux.parent.mkdir(parents=True, exist_ok=True)
        vmlinux.write_bytes(extract_vmlinux(kernels[0].read_bytes()))
        shutil.copy(vmlinux, work / "vmlinux")
        used_mib = int(subprocess.run(["du", "-sm", str(rootdir)], check=True, capture_output=True,
                                      text=True).stdout.split()[0])
        size_mib = used_mib + BUILD["free_mib"]
        run(["mkfs.ext4", "-q", "-F", "-L", "testbed-root", "-d", str(rootdir), str(work / "rootfs.img"),
             f"{size_mib}M"], log_to=work / "mkfs.log")
        shutil.rmtree(rootdir)
        shutil.rmtree(debs, ignore_errors=True)
        new_debs.rename(debs)
        (work / "recipe.txt").write_text(recipe_text)
        (work / "complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
        work.rename(final)
    except BaseException:
        log(f"image: build failed; work directory kept for inspection: {work}")
        if rootdir.exists():
            shutil.rmtree(rootdir, ignore_errors=True)
        raise


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The uncompressed kernel inside a bzImage, as the kernel's scripts/extract-vmlinux finds it: the first
    payload at a compressor's magic number that decompresses to an ELF file (xz and gzip here with Python's
    own modules, zstd with the zstd program where there is one)."""
    def xz(data: bytes) -> bytes:
        return lzma.LZMADecompressor().decompress(data)

    def gz(data: bytes) -> bytes:
        return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)

    def zst(data: bytes) -> bytes:
        if shutil.which("zstd") is None:
            return b""
        # The payload is followed by the rest of the bzImage: zstd complains, its output is whole.
        return subprocess.run(["zstd", "-dc"], input=data, capture_output=True).stdout

    for magic, decompress in ((b"\xfd7zXZ\x00", xz), (b"\x1f\x8b\x08", gz), (b"\x28\xb5\x2f\xfd", zst)):
        at = bzimage.find(magic)
        while at >= 0:
            try:
                out = decompress(bzimage[at:])
            except (lzma.LZMAError, zlib.error, EOFError):
                out = b""
            if out[:4] == b"\x7fELF":
                return out
            at = bzimage.find(magic, at + 1)
    raise RuntimeError("no ELF kernel found inside the bzImage (xz, gzip or zstd payload)")


def run(cmd: list[str], env: dict[str, str] | None = None, log_to: Path | None = None) -> None:
    if log_to is None:
        subprocess.run(cmd, check=True, env=env)
        return
    with open(log_to, "w") as out:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log_to.read_text(errors="replace").splitlines()[-40:]
        raise RuntimeError(f"{cmd[0]} failed (exit {proc.returncode}); last lines of {log_to}:\n"
                           + "\n".join(tail))
