"""The estimate as the run goes: the command's start-up, its total, and after each case what
is left, re-estimated from what the cases so far took.

Start-up: the interpreter and its imports (torch's above all), read as this process's age
when it plans (``process_age_s``: /proc's clock, or a test's), and, with ``--nproc``, the
forkserver's own import of torch before the ranks fork from it, about as long again.

Re-estimate: before each case, each part of its planned estimate (``bench.estimate``)
re-priced at the load the done cases met, times what that part took in them over what the
plan says at the loads they met (``Tally``); the case's line says the re-estimate, and its
record keeps the plan, the re-estimate, what it took and where that went.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
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


# the record's measured parts (``steps.PARTS``) each planned part is held against
MEASURED = {"setup": ("build", "inputs", "other", "memory", "profile", "record"),
            "steps": ("warmup", "timed"), "check": ("check",), "ideal": ("ideal",)}


@dataclass
class Tally:
    """Each case's estimate before it runs, re-estimated from the load and from what the
    cases so far took; the record's ``estimate`` section after it.

    Two causes move a case off its plan, and each is read where it shows: others' load,
    which the load meter reads over each case's timed steps (the record's ``load``), so
    the next case is priced at the load the done ones met (loads persist more than they
    jump); and the model's own error, read part by part (``Estimate.parts`` against the
    record's ``parts_s``): each part of a later case is scaled by what that part took in
    the done cases over its plan at the loads they met (the set-up by the cases after the
    first, whose first calls are its own), the warm-up counted as the done cases ran it. A
    part mis-priced in one case so corrects that part of the rest, not the whole of them.
    A case without parts (an estimate or a record without them) counts as one part."""

    planned: Sequence[Estimate]
    took: list[float] = field(default_factory=list)
    seen: list[Machine | None] = field(default_factory=list)  # each done case's load
    measured: list[dict[str, float] | None] = field(default_factory=list)  # by MEASURED
    warmups: list[int | None] = field(default_factory=list)  # the warm-up steps each ran

    def _load(self, i: int, machine: Machine | None) -> float:
        """Case ``i``'s plan at ``machine``'s load over its plan: each of its parts is CPU
        work of the ranks' threads, slowed as their share of a core shrinks."""
        est = self.planned[i]
        if est.machine is None or machine is None:
            return 1.0
        return est.machine.thread_share() / machine.thread_share()

    def _at(self, i: int, machine: Machine | None) -> float:
        """Case ``i``'s plan at ``machine``'s load."""
        return self.planned[i].case_s * self._load(i, machine)

    def _parts(self, i: int, warmup: float | None = None) -> dict[str, float]:
        """Case ``i``'s planned parts, its steps at ``warmup`` warm-up steps (None: as
        planned); one part, "whole", without any."""
        est = self.planned[i]
        parts = dict(est.parts) or {"whole": est.case_s}
        counted = sum(est.counts)
        if warmup is not None and counted and "steps" in parts:
            parts["steps"] *= (warmup + est.counts[1]) / counted
        return parts

    def _now(self) -> Machine | None:
        """The machine as the next case is expected to find it: the cores others keep busy,
        the median of what the done cases met beside their ranks (the plan's reading, beside
        one thread, until one is done). Not the last case's alone: here
        one case met a burst of others' work (1.6 cores against 0.9 before and 1.1 after)
        and the next, priced at it, took 0.43 of its estimate; a lasting change moves the
        median in a case or two."""
        plan = self.planned[0].machine if self.planned else None
        seen = [m for m in self.seen if m is not None]
        if plan is None or not seen:
            return plan
        return dataclasses.replace(seen[-1], others=statistics.median(m.others for m in seen))

    def scale(self) -> float:
        """The model's error in all: what the cases so far took over their plan at the
        loads they met (1 before any)."""
        done = sum(self._at(k, m) for k, m in enumerate(self.seen))
        return sum(self.took) / done if self.took and done > 0 else 1.0

    def ratio(self, part: str, i: int | None = None) -> float:
        """``part``'s error: what it took in the done cases over its plan at their loads
        and warm-ups; a case without measured parts counts its whole ratio for each; the
        set-up leaves out the first case once another is done; the steps of case ``i``
        those of the done cases with as many ranks per problem where there are any (a
        step without communication, one rank a problem, pays none of what the model
        leaves out of one with it); ``scale`` where no done case planned the part."""
        done = list(range(1 if part == "setup" and len(self.took) > 1 else 0,
                          len(self.took)))
        if part == "steps" and i is not None:
            done = [k for k in done if self.planned[k].ranks == self.planned[i].ranks] or done
        got = plan = 0.0
        for k in done:
            machine, took = self.seen[k], self.took[k]
            measured, est = self.measured[k], self.planned[k]
            planned = self._parts(k, self.warmups[k]).get(part, 0.0) * self._load(k, machine)
            if measured is None or part not in measured:  # its whole ratio
                measured = {part: took * planned / self._at(k, machine)
                            if self._at(k, machine) > 0 else 0.0}
            if planned > 0 and est.case_s > 0:
                got, plan = got + measured[part], plan + planned
        return got / plan if plan > 0 else self.scale()

    def _warmup(self) -> float | None:
        """The warm-up steps a case is expected to run: the mean of the plan's count and
        what the done cases ran (the settle rule stops where the machine lets it: here
        anywhere from its least to its most, 3 to 7, busy or not, so one or two cases
        alone say little); None (as planned) before any."""
        ran = [w for w in self.warmups if w is not None]
        if not ran or not self.planned[0].counts[1]:
            return None
        return (self.planned[0].counts[0] + sum(ran)) / (1 + len(ran))

    def price(self, i: int, machine: Machine | None) -> tuple[float, float]:
        """(case ``i``'s step, its case) re-estimated at ``machine``'s load, each part
        scaled by its ratio so far."""
        load = self._load(i, machine)
        parts = self._parts(i, self._warmup())
        case = sum(s * load * self.ratio(p, i) for p, s in parts.items())
        return self.planned[i].step_s * load * self.ratio(
            "steps" if "steps" in parts else next(iter(parts)), i), case

    def before(self, i: int) -> Estimate | None:
        """Case ``i``'s (0-based) estimate, re-estimated; None without estimates."""
        if not self.planned:
            return None
        if not self.took:
            return self.planned[i]
        step, case = self.price(i, self._now())
        return dataclasses.replace(self.planned[i], step_s=step, case_s=case)

    def left_s(self, i: int) -> float:
        """What cases ``i`` (0-based) on are re-estimated to take."""
        now = self._now()
        return sum(self.price(j, now)[1] for j in range(i, len(self.planned)))

    def done(self, i: int, record: dict[str, Any], seconds: float) -> float:
        """Case ``i`` took ``seconds``: its record's ``estimate`` becomes ``after``'s."""
        parts = dict((record.get("estimate") or {}).get("parts_s") or {})
        if parts:  # what the marks did not see: "other"
            parts["other"] = parts.get("other", 0.0) + max(0.0, seconds - sum(parts.values()))
        record["estimate"] = self.after(i, seconds, record.get("load"), parts or None,
                                        (record.get("timing") or {}).get("warmup"))
        return seconds

    def after(self, i: int, seconds: float, load: dict[str, Any] | None = None,
              parts: dict[str, float] | None = None, warmup: int | None = None
              ) -> dict[str, Any] | None:
        """The record's ``estimate`` once case ``i`` took ``seconds`` with ``load`` (the
        record's section, None: unread), ``parts`` (the record's ``parts_s``) and ``warmup``
        steps run: the plan's figures, ``revised_s`` (what its line said before it ran),
        ``took_s``, the ``scale`` between the first two, ``at_load_s``, what the re-estimate
        would have said had it known the load the case met (the model alone, without the
        forecast of the load), and ``parts_s``."""
        if not self.planned:  # no estimates (the threads launcher's): nothing to keep
            return None
        revised, seen = self.before(i), self._seen(load)
        at_load = self.price(i, seen)[1] if self.took else self._at(i, seen)
        self.took.append(seconds)
        self.seen.append(seen)
        self.measured.append(None if parts is None else {
            p: sum(parts.get(w, 0.0) for w in words) for p, words in MEASURED.items()})
        self.warmups.append(warmup)
        if revised is None:
            return None
        out = {**self.planned[i].to_dict(), "revised_s": revised.case_s, "took_s": seconds,
               "scale": revised.case_s / self.planned[i].case_s
               if self.planned[i].case_s else 1.0, "at_load_s": at_load}
        return {**out, "parts_s": parts} if parts else out

    def _seen(self, load: dict[str, Any] | None) -> Machine | None:
        """The machine as a case with this ``load`` section found it: the cores others kept
        busy beside its ranks (``estimate.loaded``); None without a reading (then its plan
        stands for it)."""
        plan = self.planned[0].machine if self.planned else None
        if plan is None or not load or not load.get("wall_s"):
            return None
        return estimate.loaded(plan, load["foreign_cpu_s"] / load["wall_s"],
                               beside=plan.local_ranks * plan.threads_per_rank)
