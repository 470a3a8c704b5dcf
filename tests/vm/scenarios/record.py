"""A host recorded by `vfioctl record` on a real kernel (the NVMe split by vfiod, VFs on vfio-pci), replayed on
this machine by `vfiod --simulate --replay`: the replay's `vfioctl list --json` equals the guest's own, field by
field, except what a replay cannot know."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import time

from testbed import vfiod
from testbed.runner import Testbed, scenario
from scenarios.modes import check_split, vfs

PF = "0000:01:00.0"
DROPIN = vfiod.TEST_DROPIN + 'scenario = "public"\n[[select]]\nid = "1b36:0010"\nnum_vfs = 2\n'
# The daemon's own history and claims: vfiod's state database, which a recording leaves out (the split the
# guest's vfiod made at start-up is its task; the replay starts with none).
NOT_IN_A_RECORDING = {"task_state", "current_task", "last_result", "claim", "vm"}


def differences(host: list[dict], replay: list[dict]) -> list[str]:
    want = {d["address"]: d for d in host}
    got = {d["address"]: d for d in replay}
    problems = [f"{a}: only on the host" for a in sorted(set(want) - set(got))]
    problems += [f"{a}: only in the replay" for a in sorted(set(got) - set(want))]
    for a in sorted(set(want) & set(got)):
        for key, value in want[a].items():
            if key not in NOT_IN_A_RECORDING and got[a].get(key) != value:
                problems.append(f"{a} {key}: host {value!r}, replay {got[a].get(key)!r}")
    return problems


def check_tarball(path) -> dict:
    """What the recording must not hold (BARs, ROMs, config space past 256 bytes, processes), and its manifest."""
    with tarfile.open(path, "r:gz") as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        assert names[0] == "manifest.json", f"the manifest is not the first member: {names[:3]}"
        for m in members:
            last = m.name.rsplit("/", 1)[-1]
            assert not last.startswith("resource") and last != "rom", f"{m.name}: a BAR or ROM was recorded"
            assert not (m.name.startswith("proc/") and m.name.split("/")[1].isdigit()), f"{m.name}: a process"
            if last == "config":
                assert m.size <= 256, f"{m.name}: {m.size} bytes of config space"
            if m.issym():
                assert not m.linkname.startswith("/"), f"{m.name} -> {m.linkname}: an absolute link"
        return json.load(tar.extractfile("manifest.json"))


@scenario()
def record(tb: Testbed) -> None:
    """vfioctl record in a guest with the NVMe split into VFs, replayed here by vfiod --simulate --replay:
    vfioctl list --json equals the guest's field by field (but the daemon's tasks and claims)"""
    vfiod_here = tb.repo / "target" / "release" / "vfiod"
    assert vfiod_here.exists(), f"{vfiod_here} missing: run `cargo build --release` first"
    g = tb.boot()
    tb.note("install+enable (split at start)", vfiod.install(g, dropin=DROPIN))
    g.wait_for("the split at start-up", lambda: len(vfs(g)) == 2, 60)
    check_split(g)
    g.wait_for("vfiod to list the VFs on vfio-pci",
               lambda: sum(1 for d in vfiod.list_devices(g)
                           if d.get("parent_pf") == PF and d.get("driver") == "vfio-pci") == 2, 30)

    t0 = time.monotonic()
    res = g.run("vfioctl record -o /root/host.tar.gz")
    tb.note("vfioctl record in the guest", time.monotonic() - t0)
    assert "recorded" in res.err and "it leaves out" in res.err, f"vfioctl record said:\n{res.describe()}"
    host = vfiod.list_devices(g)
    # Recorded between two lists that agree: nothing changed on the host meanwhile.
    again = vfiod.list_devices(g)
    assert not differences(host, again), "the guest's inventory changed while it was recorded"

    local = tb.rundir / "host.tar.gz"
    g.copy_from("/root/host.tar.gz", local)
    manifest = check_tarball(local)
    release = g.run("uname -r", quiet=True).out.strip()
    assert manifest["kernel_release"] == release, f"manifest kernel {manifest['kernel_release']!r}, guest {release!r}"
    assert "host_name" not in manifest, f"the host name was recorded without --with-hostname: {manifest}"
    assert manifest["counts"]["functions"] == len(host), f"{manifest['counts']} for {len(host)} functions"
    assert not manifest["unreadable"], f"reads failed in the guest: {manifest['unreadable']}"
    # vfiod runs in systemd's sandbox, a mount namespace of its own: its mount table is the one recorded.
    main_pid = g.run("systemctl show -p MainPID --value vfiod", quiet=True).out.strip()
    assert f"pid {main_pid}" in manifest["mount_table"], f"mount table {manifest['mount_table']!r}, vfiod is {main_pid}"
    print(f"    recording: {local.stat().st_size} bytes, {manifest['counts']}")

    config = tb.rundir / "replay.toml"
    config.write_text(DROPIN)
    env = dict(os.environ, VFIOD_LOG="warn", PATH=f"{vfiod_here.parent}:{os.environ.get('PATH', '')}")
    t0 = time.monotonic()
    out = subprocess.run([str(vfiod_here), "--simulate", "--replay", str(local), "--config", str(config),
                          "--", "vfioctl", "list", "--json"], env=env, capture_output=True, text=True, timeout=120)
    tb.note("replay here (vfiod --simulate --replay -- vfioctl list --json)", time.monotonic() - t0)
    assert out.returncode == 0, f"the replay failed (exit {out.returncode}):\n{out.stderr}"
    replay = json.loads(out.stdout)
    problems = differences(host, replay)
    assert not problems, ("the replay's vfioctl list --json differs from the guest's:\n  " + "\n  ".join(problems))
    print(f"    {len(host)} functions equal field by field; not compared (vfiod's own state): "
          f"{', '.join(sorted(NOT_IN_A_RECORDING))}")
    pf = {d["address"]: d for d in replay}[PF]
    assert pf["num_vfs"] == 2 and pf["mode"] == "vf", f"the replayed PF: {pf}"
