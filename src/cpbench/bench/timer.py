"""Timing the distributed way (Megatron's timers, nccl-tests): warm up by count, line the ranks
up with a barrier before every timed iteration, time each iteration on each rank, and gather
every rank's samples. What is reported from them (the median over iterations of the slowest
rank) is ``cpbench.metrics.step_time``.

The timer knows nothing about what it times: strategies hand it zero-argument closures.
"""

from __future__ import annotations

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
