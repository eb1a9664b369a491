"""The bottom of cpbench: the only FLOP formula, the timing statistics and the units.

Imports nothing else of cpbench, so strategies (declaring their steps' FLOPs), the bench
(timing), results (deriving figures) and the simulator all read the same numbers.

FLOPs (flash-attention's benchmark convention): forward attention is two matmuls of
2·Sq·Sk·D each per head: 4·B·Sq·Sk·H·D, halved when causal (only the lower triangle is
computed); backward is 2.5 × forward (five matmuls, counting dQ, dK, dV, dP and the
recomputed S). H is the number of query heads.

Timing statistics (Megatron's timers, nccl-tests): per iteration the step time is the
slowest rank's (a CP step ends when its last rank finishes); the reported figure is the
median over iterations, so one descheduled iteration does not move it.
"""

from __future__ import annotations

import statistics
from typing import Sequence

BWD_FACTOR = 2.5
MB = 2 ** 20  # the seeds' "MB" is MiB: 40 heads × 128 × 4096 tokens × 2 bytes = 40.00 MB
GIB = 2 ** 30


# -- FLOPs --------------------------------------------------------------------------------------

def attention_flops(*, batch: int, seqlen_q: int, seqlen_k: int, heads: int, head_dim: int,
                    causal: bool, mode: str = "fwd") -> float:
    """FLOPs of one attention call. mode: "fwd", "bwd" or "fwd_bwd"."""
    fwd = 4.0 * batch * seqlen_q * seqlen_k * heads * head_dim
    if causal:
        fwd /= 2
    factor = {"fwd": 1.0, "bwd": BWD_FACTOR, "fwd_bwd": 1.0 + BWD_FACTOR}[mode]
    return fwd * factor


def tflops_per_gpu(flops: float, world_size: int, seconds: float) -> float:
    """Achieved TFLOP/s per rank: total model FLOPs shared by all ranks over the wall time."""
    return flops / world_size / seconds / 1e12


# -- timing statistics ----------------------------------------------------------------------

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


# -- units ----------------------------------------------------------------------------------

def gib(nbytes: float) -> str:
    """Bytes as the messages print them: ``1.5 GiB``."""
    return f"{nbytes / GIB:.1f} GiB"


# -- intervals -------------------------------------------------------------------------------

def bootstrap_ratio(num: Sequence[float], den: Sequence[float], *, scale: float = 1.0,
                    n_boot: int = 2000, level: float = 0.95, seed: int = 0
                    ) -> tuple[float, float]:
    """Percentile bootstrap interval of ``scale * median(num) / median(den)``, each sample
    resampled with replacement on its own (seeded: the same records give the same interval).
    The efficiency and the comparison ratios are such ratios of per-iteration times."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    ma = np.median(a[rng.integers(0, len(a), (n_boot, len(a)))], axis=1)
    mb = np.median(b[rng.integers(0, len(b), (n_boot, len(b)))], axis=1)
    ratios = scale * ma / mb
    tail = (1 - level) / 2
    return float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1 - tail))
