"""A case's timed steps, as the driver runs them on every rank (``bench.driver``, phase
"timing"): the closures a strategy's step is made of, the timer's warm-up rule and its
all-reduce, the load meter on rank 0, the record's ``samples_ms`` / ``timing`` / ``load``
sections, and the pace its progress line shows.

A step is the forward, keeping its graph, then the backward on it, each timed on its own
(``timer.measure_steps``); with --fwd-only the forward alone, its graph built and dropped as
in a step.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from cpbench.bench import timer
from cpbench.bench.estimate import Estimate
from cpbench.bench.load import Meter
from cpbench.config import RunConfig

Closure = Callable[[], None]


def closures(strat, x: dict) -> tuple[Closure, Closure, Closure]:
    """(FWD alone, FWD keeping its graph, BWD on that graph) as zero-argument closures."""
    q, k, v, dout, sinks = x["q"], x["k"], x["v"], x["dout"], x.get("sinks")
    held: dict = {}

    def fwd():
        strat.attend(q, k, v, sinks)

    def fwd_keep():
        held["out"] = strat.attend(q, k, v, sinks)[0]

    def bwd():
        held.pop("out").backward(dout)
        q.grad = k.grad = v.grad = None
        if sinks is not None:
            # their sum over the ranks is the data-parallel gradient reduction's, not timed
            sinks.grad = None

    return fwd, fwd_keep, bwd


def whole(fwd_keep: Closure, bwd: Closure) -> Closure:
    """One step as one closure (the memory step, the profiled steps)."""
    def step():
        fwd_keep()
        bwd()

    return step


def agree_max(device: str) -> Callable[[float], float]:
    """The largest of every rank's value (an all-reduce): the warm-up's end is decided on
    the slowest rank's step times, the same on every rank."""
    import torch.distributed as dist

    def agree(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    return agree


def meter(rank: int, launcher: str):
    """Rank 0: the load meter (``bench.load``) over the timing; ours is the tree of the
    process that started the ranks (torchrun's agent, the forkserver), or this process
    where the ranks are its threads. Other ranks: nothing."""
    if rank != 0 or not Meter.available():
        return contextlib.nullcontext()
    return Meter(period=1.0, root=os.getpid() if launcher == "threads" else os.getppid())


def load_section(m: Meter | None, local_ranks: int) -> dict | None:
    """The record's ``load``: the meter's reading and the cores our ranks kept busy."""
    if m is None or m.load is None:
        return None
    return {**m.load.to_dict(),
            "ranks_cores": min(m.load.cpus, local_ranks * torch.get_num_threads())}


def timing_section(got: timer.Timed, run: RunConfig, split: bool) -> dict:
    """The record's ``timing``: the warm-up steps run, whether they settled, the rule, how
    the step's parts were timed (``timer.STEP_TIMING``)."""
    assert run.warmup is not None and run.iters is not None, "a resolved RunConfig"
    return {"warmup": got.warmup, "settled": got.settled, "warmup_least": run.warmup,
            "warmup_most": timer.warmup_rule(run.warmup, run.iters).most, "split": split,
            "step": timer.STEP_TIMING}


def flat(got: timer.Timed) -> list[float]:
    """This rank's samples in one list to gather: each part's, then the steps' (split)."""
    return [v for part in got.parts for v in part] + (got.steps if len(got.parts) > 1 else [])


def samples_of(everyone: list[list[float]], iters: int) -> dict:
    """Every rank's gathered ``flat`` lists as the record's ``samples_ms``."""
    cut = [[r[i * iters:(i + 1) * iters] for r in everyone]
           for i in range(len(everyone[0]) // iters)]
    if len(cut) == 1:
        return {"fwd": cut[0], "fwd_bwd": None}
    return {"fwd": cut[0], "bwd": cut[1], "fwd_bwd": cut[2]}


# a case's parts, by the status text that begins each (``Pace.mark``): the record's
# ``estimate.parts_s``, what ``bench.eta`` re-prices the next cases from
PARTS = (("building", "build"), ("checking", "check"), ("drawing", "inputs"),
         ("timing FWD alone", "timed"), ("timing the ideal", "ideal"), ("timing", "warmup"),
         ("warm-up", "warmup"), ("timed", "timed"), ("one untimed", "timed"),
         ("measuring memory", "memory"), ("profiling", "profile"), ("writing", "record"))


def part_of(text: str) -> str:
    """The part a status text begins ("other" for none of ``PARTS``)."""
    return next((part for word, part in PARTS if text.startswith(word)), "other")


@dataclass
class Pace:
    """The progress line's words for the timer's steps and the case's time left: its
    estimate, scaled by the pace of the steps so far (none yet: as estimated), less the time
    it has run; and when each part of the case began (``mark``)."""

    estimate: Estimate | None
    t0: float = field(default_factory=time.monotonic)
    paces: list[float] = field(default_factory=list)  # seconds of each step so far
    last: float | None = None  # when the timer last began a step
    marks: list[tuple[float, str]] = field(default_factory=list)  # (when, part) it began

    def mark(self, text: str) -> str:
        """A status ``text`` as the case says it: the part it begins noted (its time)."""
        part = part_of(text)
        if not self.marks or self.marks[-1][1] != part:
            self.marks.append((time.monotonic(), part))
        return text

    def parts_s(self, end: float | None = None) -> dict[str, float]:
        """Seconds of each part until ``end`` (now): before the first mark and after the
        last one's part (the record, the gathers) are "other"."""
        end = time.monotonic() if end is None else end
        out: dict[str, float] = {}
        bounds = [(self.t0, "other"), *self.marks, (end, "")]
        for (t, part), (t_next, _) in zip(bounds, bounds[1:]):
            out[part] = out.get(part, 0.0) + max(0.0, t_next - t)
        return out

    def section(self) -> dict | None:
        """The record's ``estimate`` as the case ends: the plan's and the parts' seconds."""
        if self.estimate is None:
            return None
        return {**self.estimate.to_dict(), "parts_s": self.parts_s()}

    def step(self, what: str, index: int, most: int) -> str:
        """The timer's word before each step: the status text."""
        now = time.monotonic()
        if self.last is not None:
            self.paces.append(now - self.last)
        self.last = now
        return f"{what} step {index}" + (f"/{most}" if what == "timed" else
                                         f" (at most {most}, until the time settles)")

    def left(self) -> float | None:
        if self.estimate is None:
            return None
        scale = 1.0
        if self.paces and self.estimate.step_s > 0:
            scale = statistics.median(self.paces[-5:]) / self.estimate.step_s
        return max(0.0, self.estimate.case_s * scale - (time.monotonic() - self.t0))
