"""The README's real-host quickstart, run verbatim: the block between `<!-- quickstart -->` and
`<!-- /quickstart -->` is read from README.md on the outer machine, its first line (the operator's
variables) replaced by the guest's device and domain, and run as root in a guest where vfiod is installed
by `make install` and running. The block is run step by step (its `# N.` comment lines start the steps),
each in `bash -euo pipefail` with the variables the earlier steps set, and each step's effect is checked."""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass

from testbed import vfiod
from testbed.guest import Guest, Result
from testbed.nested import define_os_domain, domain_state, live_hostdevs, serial_mark, wait_os_ready, wait_serial
from testbed.runner import Testbed, scenario
from scenarios import claims as claims_scenario

MARKER = "quickstart"
# The guest's values for the block's first line: the emulated SR-IOV NVMe PF, which the guest's host does
# not use (its root disk is virtio), and a nested domain that runs an OS (it acknowledges hot-unplug).
DEV = "0000:01:00.0"
VM = "nested1"
VARIABLES = {"DEV": DEV, "VM": VM}
DROPIN = "/etc/vfiod/conf.d/50-quickstart.toml"
# What the nested kernel prints when it enumerates the hot-added NVMe function (drivers/pci/probe.c).
SEEN_IN_GUEST = r"\[1b36:0010\] type 00 class 0x010802"
ENV = "/root/quickstart.env"
ASSIGNMENT = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)=")
VARIABLES_LINE = re.compile(r"^((?:[A-Za-z_][A-Za-z0-9_]*=\S+\s*)+)(#.*)?$")


@dataclass
class Step:
    title: str   # the step's comment line, e.g. "# 1. Select the device ..."
    lines: list[str]


def readme_block(text: str) -> list[str]:
    """The block's lines, as `.ci/run` extracts the README's commands: between the markers, without the
    marker and fence lines."""
    m = re.search(rf"^<!-- {MARKER} -->\n(.*?)^<!-- /{MARKER} -->$", text, re.S | re.M)
    assert m, f"README.md has no <!-- {MARKER} --> ... <!-- /{MARKER} --> block"
    lines = [line for line in m.group(1).splitlines() if not line.startswith("```")]
    assert lines, f"README.md's {MARKER} block is empty"
    return lines


def parse(lines: list[str]) -> tuple[dict[str, str], list[Step]]:
    """The block's variables line (its first) and its steps, each from a `# N.` comment line to the next."""
    first = VARIABLES_LINE.match(lines[0])
    assert first, f"the quickstart's first line must set its variables (NAME=VALUE ...), is {lines[0]!r}"
    variables = dict(word.split("=", 1) for word in first.group(1).split())
    steps: list[Step] = []
    for line in lines[1:]:
        if re.match(r"^# \d+\. ", line):
            steps.append(Step(line, [line]))
        else:
            assert steps, f"the quickstart has a command before its first `# 1.` step: {line!r}"
            steps[-1].lines.append(line)
    return variables, steps


def run_step(g: Guest, variables_line: str, names: list[str], step: Step) -> Result:
    """One step of the block as a script of its own: the variables line, what the earlier steps set (from
    ENV), the step's lines verbatim, then its variables saved for the next step."""
    save = " ".join(names)
    script = "\n".join([variables_line, f"[ -e {ENV} ] && . {ENV}", *step.lines,
                        f"for v in {save}; do declare -p \"$v\" 2>/dev/null || true; done > {ENV}", ""])
    path = f"/root/quickstart-{step.title.split('.')[0].lstrip('# ')}.sh"
    g.run(f"cat > {path}", input=script, quiet=True)
    res = g.run(f"bash -euo pipefail {path}", check=False, timeout=180)
    print(f"    {step.title}\n" + "\n".join(f"      | {line}" for line in (res.out + res.err).splitlines()))
    assert res.rc == 0, f"quickstart step {step.title!r} failed (exit {res.rc}):\n{res.describe()}"
    return res


def saved(g: Guest, name: str) -> str:
    """A variable a step set, as the next step sees it."""
    return g.run(f". {ENV} && printf %s \"${name}\"", quiet=True).out


def drivers(g: Guest) -> dict[str, str]:
    """Every PCI function's driver ("" for none), from sysfs."""
    out = g.run("for d in /sys/bus/pci/devices/*; do printf '%s %s\\n' \"${d##*/}\" "
                "\"$(basename \"$(readlink \"$d/driver\")\" 2>/dev/null)\"; done", quiet=True).out
    return {a: (d if d != "." else "") for a, _, d in (line.partition(" ") for line in out.splitlines())}


def numvfs(g: Guest) -> str:
    return g.run(f"cat /sys/bus/pci/devices/{DEV}/sriov_numvfs", quiet=True).out.strip()


def claims(g: Guest) -> list[dict]:
    data = g.json("vfioctl claims --json", quiet=True)
    assert isinstance(data, list), f"`vfioctl claims --json` is not a JSON array: {data!r}"
    return data


def managed(g: Guest) -> list[str]:
    return sorted(d["address"] for d in vfiod.list_devices(g) if d.get("managed"))


def others_unchanged(before: dict[str, str], now: dict[str, str], when: str) -> None:
    """No function but DEV changed driver, and none appeared or went (no VF was made)."""
    changed = {a: (before.get(a), now.get(a)) for a in set(before) | set(now)
               if a != DEV and before.get(a) != now.get(a)}
    assert not changed, f"{when}: functions other than {DEV} changed (address: (driver before, now)): {changed}"


@scenario()
def quickstart(tb: Testbed) -> None:
    """the README's real-host quickstart verbatim (only its variables line replaced), then the claims
    scenario's steps in the same guest and nested domain: a drop-in selecting
    the NVMe PF, check-config, reload, plan, claim, attach to a running domain (live XML, vfio-pci, seen by
    the nested kernel), detach, claim and release; nothing else touched, a clean journal"""
    lines = readme_block((tb.repo / "README.md").read_text())
    variables, steps = parse(lines)
    assert sorted(variables) == sorted(VARIABLES), \
        f"the quickstart's variables are {sorted(variables)}, this scenario sets {sorted(VARIABLES)}"
    # Only the first line is for the operator to change: no other line may name a device or a domain.
    literal = [line for line in lines[1:] if re.search(r"\b[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]\b", line)]
    assert not literal, f"quickstart lines after the first name a PCI address instead of $DEV: {literal}"
    numbers = [int(re.match(r"# (\d+)\.", s.title).group(1)) for s in steps]
    assert numbers == list(range(1, len(CHECKS) + 1)), \
        f"the quickstart's steps are numbered {numbers}; this scenario checks steps 1..{len(CHECKS)}"
    variables_line = " ".join(f"{k}={shlex.quote(v)}" for k, v in VARIABLES.items())
    names = sorted(set(VARIABLES) | {m.group(1) for line in lines for m in [ASSIGNMENT.match(line)] if m})

    g = tb.boot()
    # The nested domain boots while vfiod installs (both take tens of seconds).
    t0 = time.monotonic()
    define_os_domain(g, VM)
    tb.note("make install + enable --now", vfiod.install(g))
    wait_os_ready(g, VM)
    tb.note(f"{VM} start to kernel up", time.monotonic() - t0)

    # Before: nothing selected, so vfiod refuses to claim the device.
    before = drivers(g)
    assert before.get(DEV) == "nvme", f"{DEV} is on {before.get(DEV)!r} before the quickstart, expected nvme"
    assert numvfs(g) == "0", f"{DEV} has {numvfs(g)} VFs before the quickstart"
    assert managed(g) == [], f"vfiod manages {managed(g)} before any drop-in selects a device"
    refused = g.run(f"vfioctl claim --address {DEV} --vm {VM}", check=False)
    # Exit 7 (refused by policy, NotManaged), as README's exit-code table says; not 6.
    assert refused.rc == 7 and "is not selected by the configuration" in refused.err, \
        f"an unselected {DEV} should be refused, saying it is not selected:\n{refused.describe()}"
    print(f"    unselected: exit {refused.rc}: {refused.err.strip()}")

    t_all = time.monotonic()
    results: dict[int, Result] = {}
    for n, step in enumerate(steps, 1):
        mark = serial_mark(g, VM)
        t = time.monotonic()
        results[n] = run_step(g, variables_line, names, step)
        tb.note(f"step {n}", time.monotonic() - t)
        CHECKS[n](g, results[n], before, mark)
    tb.note("the whole quickstart", time.monotonic() - t_all)

    # After: no claim, only DEV managed, no other function touched, the domain still runs, no warning.
    assert claims(g) == [], f"claims left after the quickstart: {claims(g)}"
    assert managed(g) == [DEV], f"vfiod manages {managed(g)} after the quickstart, only {DEV} was selected"
    after = drivers(g)
    others_unchanged(before, after, "after the quickstart")
    print(f"    {DEV} ends on {after.get(DEV)!r} (it was on {before.get(DEV)!r})")
    assert numvfs(g) == "0", f"{DEV} has {numvfs(g)} VFs after the quickstart (private scenario: none)"
    assert domain_state(g, VM) == "running", f"{VM} is {domain_state(g, VM)!r} after the quickstart"
    problems = vfiod.journal_problems(g)
    assert not problems, "vfiod logged warnings or errors during the quickstart:\n  " + "\n  ".join(problems)
    # Then the claims scenario's steps, in this guest with this nested domain (see scenarios.claims).
    claims_scenario.after_quickstart(tb, g, DROPIN)


# ---- what each step must have done --------------------------------------------------------------------

def after_select(g: Guest, res: Result, before: dict[str, str], mark: int) -> None:
    text = g.run(f"cat {DROPIN}", quiet=True).out
    assert re.search(rf'^address = "{re.escape(DEV)}"$', text, re.M) and text.count("[[select]]") == 1, \
        f"{DROPIN} should select {DEV} alone:\n{text}"
    assert managed(g) == [], f"vfiod manages {managed(g)} before it was told to read the drop-in"


def after_apply(g: Guest, res: Result, before: dict[str, str], mark: int) -> None:
    assert DROPIN in res.out and re.search(rf"^select: 1 rule\(s\)\n  .*{re.escape(DEV)}", res.out, re.M), \
        f"vfiod --check-config does not show {DROPIN} and one select rule for {DEV}:\n{res.out}"
    # Twice: `vfioctl plan --config /etc/vfiod` before the reload (the preview: the drop-in selects it),
    # then `vfioctl plan` after it; both leave it whole (private scenario).
    said = re.findall(rf"^{re.escape(DEV)}: (.*)$", res.out, re.M)
    assert len(said) == 2 and all("not selected" not in s for s in said), \
        f"vfioctl plan --config and vfioctl plan should each plan {DEV}:\n{res.out}"
    assert managed(g) == [DEV], f"after the reload vfiod manages {managed(g)}, expected [{DEV}]"
    # The private scenario keeps a selected PF whole on its driver: the reload wrote nothing.
    others_unchanged(before, drivers(g), "after the reload")
    assert drivers(g).get(DEV) == "nvme", f"the reload moved {DEV} to {drivers(g).get(DEV)!r}"
    assert numvfs(g) == "0", f"the reload split {DEV} ({numvfs(g)} VFs)"


def after_claim(g: Guest, res: Result, before: dict[str, str], mark: int) -> None:
    cid = saved(g, "CLAIM")
    assert cid.isdigit(), f"the claim step left CLAIM={cid!r}, not a claim number:\n{res.describe()}"
    now = claims(g)
    assert len(now) == 1, f"one claim expected after `vfioctl claim`, `vfioctl claims --json` has {now}"
    c = now[0]
    expected = {"id": int(cid), "address": DEV, "functions": [DEV], "vm_name": VM, "state": "claimed"}
    wrong = {k: (c.get(k), v) for k, v in expected.items() if c.get(k) != v}
    assert not wrong, f"the claim after step 3 (field: (is, expected)): {wrong}\n{c}"
    assert drivers(g).get(DEV) == "nvme", f"the claim alone moved {DEV} to {drivers(g).get(DEV)!r}"


def after_attach(g: Guest, res: Result, before: dict[str, str], mark: int) -> None:
    cid = int(saved(g, "CLAIM"))
    c = {x["id"]: x for x in claims(g)}.get(cid)
    assert c and c["state"] == "attached" and c["guest_address"], f"claim {cid} after the attach: {c}"
    mine = [h for h in live_hostdevs(g, VM) if h.source == DEV]
    assert len(mine) == 1 and mine[0].alias == f"ua-vfiod-{cid}-0", \
        f"{VM}'s live XML should have {DEV} once, alias ua-vfiod-{cid}-0: {live_hostdevs(g, VM)}"
    assert mine[0].guest_address == c["guest_address"], \
        f"claim {cid} says guest address {c['guest_address']}, the live XML {mine[0].guest_address}"
    assert drivers(g).get(DEV) == "vfio-pci", f"{DEV} is on {drivers(g).get(DEV)!r} while attached"
    assert "<hostdev" in res.out and "vfio-pci" in res.out, \
        f"the quickstart's own checks (dumpxml, lspci -k) do not show the hostdev and vfio-pci:\n{res.out}"
    others_unchanged(before, drivers(g), "after the attach")
    # Inside the nested domain: its kernel enumerated the hot-added function.
    line = wait_serial(g, VM, SEEN_IN_GUEST, after=mark, timeout=30)
    print(f"    {VM}'s kernel: {line.strip()}")


def after_detach(g: Guest, res: Result, before: dict[str, str], mark: int) -> None:
    assert claims(g) == [], f"a claim is left after the detach: {claims(g)}"
    left = [h for h in live_hostdevs(g, VM) if h.source == DEV]
    assert not left, f"{DEV} is still in {VM}'s live XML after the detach: {left}"
    inactive = g.run(f"virsh dumpxml --inactive {VM}", quiet=True).out
    assert "<hostdev" not in inactive, f"{VM}'s configuration keeps a hostdev after the detach:\n{inactive}"
    # Held for its clean (a reset and a health check), then offered again.
    def offered():
        found = g.run(f"vfioctl find --address {DEV}", check=False, quiet=True)
        return found.rc == 0 and found.out.strip() == DEV
    g.wait_for(f"{DEV} to be cleaned and offered again after the detach", offered, 30, 0.3)
    others_unchanged(before, drivers(g), "after the detach")


def after_release(g: Guest, res: Result, before: dict[str, str], mark: int) -> None:
    assert claims(g) == [], f"a claim is left after the release: {claims(g)}"
    assert re.search(r"^claim \d+ released$", res.out, re.M), f"vfioctl release said:\n{res.out}"
    others_unchanged(before, drivers(g), "after the release")


CHECKS = {1: after_select, 2: after_apply, 3: after_claim, 4: after_attach, 5: after_detach, 6: after_release}
