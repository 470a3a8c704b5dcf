"""Scenarios: registration, the test bed handed to each, and the summary table with timings."""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from .guest import CommandFailed, Guest, GuestError, private_pair
from .image import Image
from .log import log


@dataclass
class Scenario:
    name: str
    func: Callable[["Testbed"], None]
    default: bool
    doc: str


SCENARIOS: dict[str, Scenario] = {}


def scenario(default: bool = True):
    """Registers a scenario under its function's name; default=False keeps it out of a plain run."""
    def register(func):
        doc = " ".join((func.__doc__ or "").split())
        SCENARIOS[func.__name__] = Scenario(func.__name__, func, default, doc)
        return func
    return register


def load_scenarios() -> dict[str, Scenario]:
    package = importlib.import_module("scenarios")
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"scenarios.{info.name}")
    return SCENARIOS


@dataclass
class Testbed:
    """What a scenario gets: the image, the repository, a run directory, guests and timings."""
    image: Image
    repo: Path
    rundir: Path
    timings: list[tuple[str, float]] = field(default_factory=list)
    guests: list[Guest] = field(default_factory=list)
    _next_index: int = 1

    @contextlib.contextmanager
    def timed(self, what: str) -> Iterator[None]:
        start = time.monotonic()
        yield
        self.timings.append((what, time.monotonic() - start))

    def note(self, what: str, seconds: float) -> None:
        self.timings.append((what, seconds))

    def _new_guest(self, name: str, **kwargs) -> Guest:
        guest = Guest(name=name, index=self._next_index, image=self.image, rundir=self.rundir / name,
                      repo=self.repo, **kwargs)
        self._next_index += 1
        self.guests.append(guest)
        return guest

    def boot(self, name: str = "hosta", **kwargs) -> Guest:
        """Boots one guest and waits until it is ready."""
        guest = self._new_guest(name, **kwargs)
        guest.start()
        self.note(f"boot {name}", guest.wait_ready())
        return guest

    def boot_pair(self, **kwargs) -> tuple[Guest, Guest]:
        """Boots host A and host B joined by the private link (both at once: the cores are shared)."""
        link_a, link_b = private_pair()
        a = self._new_guest("hosta", link=link_a, **kwargs)
        b = self._new_guest("hostb", link=link_b, **kwargs)
        start = time.monotonic()
        a.start()
        b.start()
        a.wait_ready()
        b.wait_ready()
        self.note("boot hosta+hostb", time.monotonic() - start)
        return a, b

    def stop_all(self) -> None:
        for guest in self.guests:
            guest.stop()


@dataclass
class Outcome:
    name: str
    passed: bool
    seconds: float
    timings: list[tuple[str, float]]
    error: str = ""
    # Why the scenario was run a second time (a guest kernel stalled in the first run), if it was.
    retried: str = ""


# What a guest kernel prints when it stops answering or dies: a TCG guest running its own KVM guests
# (nested SVM) hung in kvm_destroy_vm on an IPI that never came, and another panicked in a `CPU 0/KVM`
# thread ("corrupted stack end detected inside scheduler"). Nested domains now run under TCG
# (testbed.nested.DOMAIN_TYPE); should the emulator still fail the guest's kernel, that is not vfiod's:
# nothing vfiod does runs in the kernel, and a second failure is reported as it is.
STALL = re.compile(r"rcu: INFO: rcu_\w+ detected stalls|watchdog: BUG: soft lockup|"
                   r"INFO: task \S+ blocked for more than|Kernel panic - not syncing")


def kernel_stall(serial: str) -> str:
    """The first line of `serial` (a guest's console) that says its kernel stalled, or ""."""
    for line in serial.splitlines():
        if STALL.search(line):
            return line.strip()
    return ""


def run_scenario(sc: Scenario, image: Image, repo: Path, rundir: Path) -> Outcome:
    """Runs `sc`; once more if it failed while a guest's kernel stalled (see STALL), and says so.

    Only a stall earns the second run: any other failure is the scenario's (or vfiod's) own."""
    first = run_once(sc, image, repo, rundir)
    if first.passed or not first.retried:
        return first
    log(f"=== {sc.name}: failed while a guest kernel stalled ({first.retried}); running it once more")
    second = run_once(sc, image, repo, rundir / "retry")
    second.retried = first.retried
    second.seconds += first.seconds
    return second


def run_once(sc: Scenario, image: Image, repo: Path, rundir: Path) -> Outcome:
    tb = Testbed(image=image, repo=repo, rundir=rundir / sc.name)
    log(f"=== {sc.name}: {sc.doc}")
    start = time.monotonic()
    try:
        sc.func(tb)
        passed, error = True, ""
    except (AssertionError, CommandFailed, GuestError, TimeoutError) as e:
        passed, error = False, f"{type(e).__name__}: {e}"
    except Exception:  # a bug in the scenario itself: show where
        passed, error = False, traceback.format_exc()
    stalled = ""
    if not passed:
        report_failure(sc.name, error, tb.guests)
        stalled = next((f"{g.name}: {line}" for g in tb.guests
                        if (line := kernel_stall(g.serial_tail(lines=100_000)))), "")
    tb.stop_all()
    seconds = time.monotonic() - start
    log(f"=== {sc.name}: {'PASS' if passed else 'FAIL'} ({seconds:.0f} s)")
    return Outcome(sc.name, passed, seconds, tb.timings, error, retried=stalled)


def report_failure(name: str, error: str, guests: list[Guest]) -> None:
    print(f"\n----- FAILED: {name} -----\n{error}", flush=True)
    for guest in guests:
        print(f"\n----- {guest.name}: last lines of the serial log {guest.serial_log} -----", flush=True)
        print(guest.serial_tail(), flush=True)
    print("-----\n", flush=True)


def summary(outcomes: list[Outcome], image_seconds: float | None, image_built: bool) -> str:
    rows = [("image", "built" if image_built else "cached", f"{image_seconds:.1f}" if image_seconds else "-", "")]
    for o in outcomes:
        details = ", ".join(f"{what} {sec:.1f}s" for what, sec in o.timings)
        result = ("PASS" if o.passed else "FAIL") + ("*" if o.retried else "")
        rows.append((o.name, result, f"{o.seconds:.1f}", details))
    widths = [max(len(r[i]) for r in rows + [("scenario", "result", "seconds", "")]) for i in range(3)]
    lines = ["", f"{'scenario':<{widths[0]}}  {'result':<{widths[1]}}  {'seconds':>{widths[2]}}  timings"]
    for r in rows:
        lines.append(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}")
    passed = sum(o.passed for o in outcomes)
    for o in outcomes:
        if o.retried:
            lines.append(f"* {o.name} ran twice: the first run failed while a guest kernel stalled "
                         f"({o.retried}); its seconds are both runs'")
    # The cause again, last: CI shows the tail of a long output, and stop 37's showed the failures'
    # serial logs but not the assertions printed before them.
    for o in outcomes:
        if not o.passed:
            why = o.error.strip().splitlines()
            lines.append(f"{o.name} failed: " + "\n    ".join(why[:12] + (["..."] if len(why) > 12 else [])))
    lines.append("")
    lines.append(f"vm: {passed} passed, {len(outcomes) - passed} failed")
    return "\n".join(lines)
