"""The bottom of cpbench: the only FLOP formula, the timing statistics and the units.

Imports nothing else of cpbench, so strategies (declaring their steps' FLOPs), the bench
(timing), results (deriving figures) and the simulator all read the same numbers.

FLOPs (flash-attention's benchmark convention): forward attention is two matmuls of
2·Sq·Sk·D each per head: 4·B·Sq·Sk·H·D, halved when causal (only the lower triangle is
computed); backward is 2.5 × forward (five matmuls, counting dQ, dK, dV, dP and the
recomputed S). H is the number of query heads.

Under packed documents or a sliding window the forward is 4·B·H·D × the attended (query, key)
pairs, counted exactly (``attended_pairs``), as MagiAttention counts its mask area; a plain
causal or full sequence keeps the formula above (S²/2 causal: the seeds' convention, 1/S off
the exact S(S+1)/2), so TFLOP/s compare across masks and with the seeds.

Attention sinks (--sinks) add no matmul FLOPs: one more score per row with no value is an
element-wise rescale of each query's out and lse (and a row sum for its gradient), counted
nowhere, as the kernels' softmax is not.

Timing statistics (Megatron's timers, nccl-tests): per iteration the step time is the
slowest rank's (a CP step ends when its last rank finishes); the reported figure is the
median over iterations, so one descheduled iteration does not move it.
"""

from __future__ import annotations

import statistics
from typing import Sequence

BWD_FACTOR = 2.5  # bwd / fwd FLOPs at equal head dims (``pair_flops``)
MB = 2 ** 20  # the seeds' "MB" is MiB: 40 heads × 128 × 4096 tokens × 2 bytes = 40.00 MB
GIB = 2 ** 30


# -- FLOPs --------------------------------------------------------------------------------------

def pair_flops(head_dim: int, v_head_dim: int | None = None, mode: str = "fwd") -> float:
    """FLOPs of one attended (query, key) pair of one head, 2 per multiply-add. Forward:
    QKᵀ on the Q/K width D, PV on V's width DV. Backward, five products: QKᵀ recomputed (D),
    dV = PᵀdO (DV), dP = dO Vᵀ (DV), dQ = dS K (D), dK = dSᵀQ (D). At DV = D: 4D and 10D, the
    seeds' bwd = 2.5 × fwd."""
    d = head_dim
    dv = d if v_head_dim is None else v_head_dim
    fwd, bwd = 2.0 * (d + dv), 2.0 * (3 * d + 2 * dv)
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[mode]


def attention_flops(*, batch: int, seqlen_q: int, seqlen_k: int, heads: int, head_dim: int,
                    causal: bool, mode: str = "fwd", v_head_dim: int | None = None) -> float:
    """FLOPs of one attention call. mode: "fwd", "bwd" or "fwd_bwd"."""
    pairs = float(seqlen_q * seqlen_k)
    if causal:
        pairs /= 2
    return pairs_flops(pairs, batch=batch, heads=heads, head_dim=head_dim, mode=mode,
                       v_head_dim=v_head_dim)


def _abs_sum(a: int, b: int) -> int:
    """sum of |d| for d in [a, b] (a <= b)."""
    def tri(n: int) -> int:  # 0 + 1 + ... + n
        return n * (n + 1) // 2

    if a >= 0:
        return tri(b) - tri(a - 1)
    if b <= 0:
        return tri(-a) - tri(-b - 1)
    return tri(-a) + tri(b)


def document_pairs(length: int, *, causal: bool, window: tuple[int, int] | None) -> int:
    """Attended pairs inside one document: query i sees key j when j - i lies in
    [-left, right] (right = 0 when causal; -1 is unbounded), both in [0, length)."""
    left, right = window if window is not None else (-1, -1)
    lo = -(length - 1) if left < 0 else max(-left, -(length - 1))
    hi = length - 1 if right < 0 else min(right, length - 1)
    if causal:
        hi = min(hi, 0)
    if lo > hi:
        return 0
    return (hi - lo + 1) * length - _abs_sum(lo, hi)


def attended_pairs(*, seqlen: int, causal: bool, documents: Sequence[int] | None = None,
                   window: tuple[int, int] | None = None) -> int:
    """Exact (query, key) pairs a mask attends (documents: lengths summing to seqlen)."""
    return sum(document_pairs(n, causal=causal, window=window)
               for n in (documents or (seqlen,)))


def problem_flops(*, batch: int, seqlen: int, heads: int, head_dim: int, causal: bool,
                  documents: Sequence[int] | None = None,
                  window: tuple[int, int] | None = None,
                  mode: str = "fwd", v_head_dim: int | None = None) -> tuple[float, str]:
    """(FLOPs of the whole problem in ``mode``, how they were counted): "formula" for a
    plain causal or full sequence (the seeds' S²/2 and S²), "exact pairs" under a mask."""
    if documents is None and window is None:
        return attention_flops(batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, heads=heads,
                               head_dim=head_dim, causal=causal, mode=mode,
                               v_head_dim=v_head_dim), "formula"
    pairs = attended_pairs(seqlen=seqlen, causal=causal, documents=documents, window=window)
    return pairs_flops(pairs, batch=batch, heads=heads, head_dim=head_dim,
                       mode=mode, v_head_dim=v_head_dim), "exact pairs"


def pairs_flops(pairs: float, *, batch: int, heads: int, head_dim: int, mode: str = "fwd",
                v_head_dim: int | None = None) -> float:
    """FLOPs of ``pairs`` attended (query, key) pairs (every query head)."""
    return batch * heads * pairs * pair_flops(head_dim, v_head_dim, mode)


def fwd_bwd_rate(fwd: float, bwd: float) -> float:
    """FWD+BWD TFLOP/s of one problem from its FWD and BWD rates (BWD_FACTOR x the FLOPs):
    the FLOPs over the two times, (1 + 2.5) / (1 / fwd + 2.5 / bwd)."""
    return (1 + BWD_FACTOR) / (1 / fwd + BWD_FACTOR / bwd)


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


def duration(seconds: float) -> str:
    """A duration as the estimates print it: ``12 ms``, ``3.4 s``, ``5.6 min``, ``7.8 h``,
    ``9.1 d``."""
    for unit, scale, limit in (("ms", 1e-3, 1.0), ("s", 1.0, 120.0), ("min", 60.0, 7200.0),
                               ("h", 3600.0, 172800.0)):
        if seconds < limit:
            value = seconds / scale
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.2g} {unit}"
    return f"{seconds / 86400:.2g} d"


# -- intervals -------------------------------------------------------------------------------

# a printed interval needs a spread to resample: one iteration, or a model's one prediction,
# has none, and two give an interval of two points. The one rule every report's interval obeys.
MIN_SAMPLES = 3


def ratio_interval(num: Sequence[float] | None, den: Sequence[float] | None, *,
                   scale: float = 1.0) -> tuple[float, float] | None:
    """The interval a report prints beside ``scale * median(num) / median(den)``:
    ``bootstrap_ratio``'s, or None unless each side has at least ``MIN_SAMPLES`` samples."""
    if not (isinstance(num, Sequence) and isinstance(den, Sequence)):
        return None  # none recorded (pandas leaves NaN)
    if min(len(num), len(den)) < MIN_SAMPLES:
        return None
    return bootstrap_ratio(num, den, scale=scale)


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
