"""The estimate as the run goes: the command's start-up, its total, and after each case what
is left, re-estimated from what the cases so far took.

Start-up: the interpreter and its imports (torch's above all), read as this process's age
when it plans (``process_age_s``: /proc's clock, or a test's), and, with ``--nproc``, the
forkserver's own import of torch before the ranks fork from it, about as long again.

Re-estimate: before each case, its planned estimate (``bench.estimate``) times what the cases
so far took over what they were planned to take (``Tally``); the case's line says the
re-estimate, and its record keeps the plan, the re-estimate and what it took.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from cpbench.bench import estimate, load, refusal
from cpbench.bench.estimate import Estimate, Machine, Problem
from cpbench.config import RunConfig
from cpbench.metrics import duration


def planned(problems: Sequence[Problem], run: RunConfig, machine: Machine, launcher: str, *,
            meter: Callable[[], Any] | None = None, age_s: float | None = None,
            comm: Any = None) -> tuple[Estimate, ...]:
    """Each case's estimate on the machine as others leave it (``estimate.under_load``; a
    test gives its ``meter``), the command's start-up, what the meter saw and, on a GPU, the
    preset that priced what is beyond the kernel (``comm``'s, or "none") on the first;
    UsageError for a case over ``--max-minutes``."""
    if meter is None:
        meter = (lambda: load.Meter(period=1.0)) if load.Meter.available() else _NoMeter
    machine = estimate.under_load(problems, run, machine, meter)
    ests = estimate.estimates(problems, run, machine)
    refusal.refuse_over(problems, ests, run, machine)
    if not ests:
        return ests
    start = startup_s(process_age_s() if age_s is None else age_s, launcher)
    return (dataclasses.replace(ests[0], start_s=start, busy=machine.busy_text(),
                                comm_from=getattr(comm, "name", "none" if machine.device == "cuda"
                                                  else "")), *ests[1:])


class _NoMeter:
    """No /proc: no reading (the estimate then counts no others)."""

    load = None

    def __enter__(self) -> _NoMeter:
        return self

    def __exit__(self, *exc) -> None:
        return None


def process_age_s(now: Callable[[], float] | None = None,
                  started: Callable[[], float] | None = None) -> float | None:
    """Seconds since this process started (``started``: its start, ``now``: the clock, both
    in seconds since boot; /proc's by default); None where there is no /proc."""
    try:
        return max(0.0, (now or _uptime)() - (started or _started)())
    except (OSError, ValueError, IndexError):
        return None


def _uptime() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


def _started() -> float:
    with open("/proc/self/stat") as f:
        text = f.read()
    # the 22nd field, counted after the name (which may hold spaces): 20th after it
    return int(text[text.rindex(")") + 2:].split()[19]) / os.sysconf("SC_CLK_TCK")


def startup_s(age_s: float | None, launcher: str) -> float:
    """The command's start-up: this process's so far, and with --nproc the forkserver's
    import of torch, about as long again (ranks as threads, or torchrun's: none more)."""
    if age_s is None:
        return 0.0
    return age_s * (2.0 if launcher == "self" else 1.0)


def total_line(ests: Sequence[Estimate]) -> str:
    """``estimated 12 s in all (3.1 s of start-up; <probe>; others keep 1.6 of 2 cores busy:
    estimated on what they leave)``."""
    start_s, busy = ests[0].start_s, ests[0].busy
    total = start_s + sum(e.case_s for e in ests)
    parts = [f"{duration(start_s)} of start-up"] if start_s else []
    parts.append(ests[0].rate.text())
    if ests[0].comm_from:  # GPUs: what the simulator's preset says a step adds to its kernel
        parts.append("beyond the kernel: not counted, no simulator preset for this GPU"
                     if ests[0].comm_from == "none" else
                     f"beyond the kernel: the simulator's {ests[0].comm_from} preset")
    if busy:
        parts.append(f"{busy}: estimated on what they leave")
    return f"estimated {duration(total)} in all ({'; '.join(parts)})"


@dataclass
class Tally:
    """Each case's estimate before it runs, re-estimated from what the cases so far took;
    the record's ``estimate`` section after it."""

    planned: Sequence[Estimate]
    took: list[float] = field(default_factory=list)

    def scale(self) -> float:
        """What the cases so far took over their plan (1 before any)."""
        done = sum(e.case_s for e in self.planned[:len(self.took)])
        return sum(self.took) / done if self.took and done > 0 else 1.0

    def before(self, i: int) -> Estimate | None:
        """Case ``i``'s (0-based) estimate, re-estimated; None without estimates."""
        if not self.planned:
            return None
        est, k = self.planned[i], self.scale()
        return dataclasses.replace(est, step_s=est.step_s * k, case_s=est.case_s * k)

    def left_s(self, i: int) -> float:
        """What cases ``i`` (0-based) on are re-estimated to take."""
        return sum(e.case_s for e in self.planned[i:]) * self.scale()

    def done(self, i: int, record: dict[str, Any], seconds: float) -> float:
        """Case ``i`` took ``seconds``: its record's ``estimate`` becomes ``after``'s."""
        record["estimate"] = self.after(i, seconds)
        return seconds

    def after(self, i: int, seconds: float) -> dict[str, Any] | None:
        """The record's ``estimate`` once case ``i`` took ``seconds``: the plan's figures,
        ``revised_s`` (what its line said before it ran) and ``took_s``."""
        revised = self.before(i)
        self.took.append(seconds)
        if revised is None:
            return None
        return {**self.planned[i].to_dict(), "revised_s": revised.case_s, "took_s": seconds,
                "scale": revised.case_s / self.planned[i].case_s
                if self.planned[i].case_s else 1.0}
