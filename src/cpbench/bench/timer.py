"""Timing the distributed way (Megatron's timers, nccl-tests): warm up, line the ranks up with
a barrier before every timed iteration, time each iteration on each rank, and gather every
rank's samples. What is reported from them (the median over iterations of the slowest rank)
is ``cpbench.metrics.step_time``.

``measure``: one closure, a fixed warm-up (the ideal block alone, calibration).
``measure_steps``: a step made of parts (the driver's forward, then backward) timed as a
training step runs it, as the seeds' scripts (BurstEngine's, ring-flash-attn's benchmarks)
time it: sync, barrier, then the parts back to back with no sync or barrier between them, a
mark at each part's end (a CUDA event on the stream, the host's clock on CPU), one sync at
the step's end (``STEP_TIMING``). Each part's time is its own sample, from the previous
mark to its own, so the backward is measured, never derived by subtracting two medians of
separately timed loops (where a cold first loop once printed a negative backward); the
step's time is the iteration from its first part's start to its last part's end on each
rank. Until records said ``timing.step``, the harness put a sync and a barrier between the
parts, inside FWD+BWD (0.2-2.6 % of a CPU step, ~1-3 % of a GPU step of a few ms). Its
warm-up runs until the step time settles (``Settle``), every rank deciding on the same
slowest-rank times, so every rank runs the same number of steps.

The timer knows nothing about what it times: strategies hand it zero-argument closures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

# how a step's parts are timed: the record's ``timing.step`` (records without it: "synced",
# a sync and a barrier before every part, inside FWD+BWD)
STEP_TIMING = "back-to-back"

# progress("warm-up" or "timed", the step about to run (1-based), steps at most)
Progress = Callable[[str, int, int], None]


def _noop() -> None:
    pass


@dataclass(frozen=True)
class Settle:
    """When warm-up stops: after at least ``least`` steps, once the last ``window`` steps'
    times (slowest rank) lie within ``tolerance`` of their fastest; at most ``most`` steps
    whatever they do. ``least == most``: a fixed count."""

    least: int
    most: int
    window: int = 3
    tolerance: float = 0.10

    def done(self, times: Sequence[float]) -> bool:
        """Whether warm-up may stop after ``times`` (each warm-up step's time so far)."""
        n = len(times)
        if n < self.least:
            return False
        return n >= self.most or settled(times, self.window, self.tolerance)


def settled(times: Sequence[float], window: int = 3, tolerance: float = 0.10) -> bool:
    """Whether the last ``window`` times lie within ``tolerance`` of their fastest."""
    last = list(times)[-window:]
    if len(last) < window or min(last) <= 0:
        return False
    return (max(last) - min(last)) / min(last) <= tolerance


def warmup_rule(warmup: int, iters: int) -> Settle:
    """A run's warm-up: ``warmup`` (0: none) at least, and while the step time still moves,
    up to ``iters`` more (at most doubling the case's steps)."""
    return Settle(least=warmup, most=warmup if warmup == 0 else warmup + iters)


@dataclass(frozen=True)
class Timed:
    """``measure_steps``' result on this rank: per part, each timed iteration's ms; each
    iteration's whole step in ms; the warm-up steps run and whether their times settled."""

    parts: list[list[float]]
    steps: list[float]
    warmup: int
    settled: bool


class Timer:
    """Times closures on this rank. ``device``: "cuda" (CUDA events) or "cpu" (perf_counter).
    ``barrier``: called before every timed iteration (a process-group barrier). ``agree``:
    the slowest rank's value of a float (an all-reduce max), so that every rank decides the
    warm-up's end on the same figures. ``clock``: seconds on the CPU path (injected by tests,
    whose steps then take what they say whatever else the host runs)."""

    def __init__(self, device: str, barrier: Callable[[], None] = _noop,
                 agree: Callable[[float], float] = float,
                 clock: Callable[[], float] = time.perf_counter):
        self.device = device
        self.barrier = barrier
        self.agree = agree
        self.clock = clock

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def measure(self, fn: Callable[[], object], *, warmup: int, iters: int) -> list[float]:
        """Milliseconds of each of ``iters`` timed calls of ``fn`` on this rank."""
        for _ in range(warmup):
            fn()
        self._sync()
        return [self._timed([fn])[0][0] for _ in range(iters)]

    def measure_steps(self, parts: Sequence[Callable[[], object]], *, settle: Settle,
                      iters: int, progress: Progress | None = None) -> Timed:
        """Warm up until ``settle`` says so, then time ``iters`` steps, each part of each
        step on its own (see the module docstring). ``progress("warm-up" | "timed", step,
        at most)`` before every step."""
        say = progress or (lambda what, step, most: None)
        times: list[float] = []
        while not settle.done(times):
            say("warm-up", len(times) + 1, settle.most)
            _, step = self._timed(parts, barrier=False)
            times.append(self.agree(step))
        self._sync()
        per_part: list[list[float]] = [[] for _ in parts]
        steps = []
        for i in range(iters):
            say("timed", i + 1, iters)
            each, step = self._timed(parts)
            for samples, ms in zip(per_part, each):
                samples.append(ms)
            steps.append(step)
        return Timed(per_part, steps, len(times),
                     settled(times, settle.window, settle.tolerance))

    def _timed(self, parts: Sequence[Callable[[], object]], barrier: bool = True
               ) -> tuple[list[float], float]:
        """(each part's ms, the step's ms from the first part's start to the last's end).
        The ranks sync and line up (``barrier``; warm-up steps need not) before the first
        part only: the parts run back to back, as a training step runs them."""
        self._sync()
        if barrier:
            self.barrier()  # every rank starts the step together
        if self.device == "cuda":
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(parts) + 1)]
            marks[0].record()
            for fn, mark in zip(parts, marks[1:]):
                fn()
                mark.record()  # on the stream: no host sync between parts
            marks[-1].synchronize()
            each = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
            return each, marks[0].elapsed_time(marks[-1])
        clock = [self.clock()]
        for fn in parts:
            fn()
            clock.append(self.clock())
        return [(b - a) * 1e3 for a, b in zip(clock, clock[1:])], (clock[-1] - clock[0]) * 1e3


def gather_samples(samples: Sequence[float], device: str = "cpu") -> list[list[float]]:
    """Every rank's samples, rank order (a collective; one list when not distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [list(samples)]
    t = torch.tensor(list(samples), dtype=torch.float64, device=device)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [p.cpu().tolist() for p in parts]
