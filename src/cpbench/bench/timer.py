"""Timing the distributed way (Megatron's timers, nccl-tests): warm up by count, line the ranks
up with a barrier before every timed iteration, time each iteration on each rank, gather
every rank's samples, and report the median over iterations of the slowest rank.

The timer knows nothing about what it times: strategies hand it zero-argument closures.
Why the slowest rank: a CP step ends when its last rank finishes (the next layer needs every
shard), so per iteration the step time is the maximum over ranks. Why the median: one
descheduled iteration (a shared CPU, a GC pause) must not move the reported figure.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch


def _noop() -> None:
    pass


class Timer:
    """Times closures on this rank. ``device``: "cuda" (CUDA events) or "cpu" (perf_counter).
    ``barrier``: called before every timed iteration (a process-group barrier)."""

    def __init__(self, device: str, barrier: Callable[[], None] = _noop):
        self.device = device
        self.barrier = barrier

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def measure(self, fn: Callable[[], object], *, warmup: int, iters: int) -> list[float]:
        """Milliseconds of each of ``iters`` timed calls of ``fn`` on this rank."""
        for _ in range(warmup):
            fn()
        self._sync()
        samples = []
        for _ in range(iters):
            self._sync()
            self.barrier()  # every rank starts the iteration together
            if self.device == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return samples


def gather_samples(samples: Sequence[float], device: str = "cpu") -> list[list[float]]:
    """Every rank's samples, rank order (a collective; one list when not distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [list(samples)]
    t = torch.tensor(list(samples), dtype=torch.float64, device=device)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [p.cpu().tolist() for p in parts]


def slowest_per_iter(samples_by_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per iteration, the time of the slowest rank."""
    return [max(column) for column in zip(*samples_by_rank)]


def step_time(samples_by_rank: Sequence[Sequence[float]]) -> float:
    """The reported time: the median over iterations of the slowest rank."""
    return statistics.median(slowest_per_iter(samples_by_rank))


def slowest_rank(samples_by_rank: Sequence[Sequence[float]]) -> int:
    """The rank that was slowest in the most iterations (lowest rank on ties)."""
    wins = [0] * len(samples_by_rank)
    for column in zip(*samples_by_rank):
        wins[max(range(len(column)), key=lambda r: (column[r], -r))] += 1
    return max(range(len(wins)), key=lambda r: (wins[r], -r))
