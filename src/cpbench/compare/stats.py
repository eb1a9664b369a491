"""The statistics of a two-run comparison, one (case, phase) test at a time.

- ``median_ratio_ci``: the ratio of medians B / A and its percentile bootstrap interval, each
  run resampled on its own (the runs are independent; iterations within a run are treated as
  exchangeable, which is what a median over iterations already assumes).
- ``mann_whitney``: scipy's two-sided Mann–Whitney U p-value. Rank-based, so it needs no
  normality: timings are right-skewed, with the odd descheduled iteration far out.
- ``holm``: Holm's step-down adjustment over every test of one comparison (a sweep compares
  dozens of cases; uncorrected, some would differ by chance).
- ``reachable``: whether a test can reach α at all, given its sample sizes and the correction.
- ``verdicts``: slower / faster only when the adjusted p is below α *and* the whole interval
  lies outside the practical-equivalence band 1 ± min_effect; same only when the whole interval
  lies inside that band (an equivalence test: the data rule out any change that matters);
  anything else is unclear. A non-significant test is no evidence of no change: a 20 %
  regression that noise hides must not read as "same".
- ``iterations_to_resolve``: for an unclear test, about how many iterations a side would put
  its interval wholly inside or wholly outside the band, from its observed spread.

Every function takes leading batch dimensions, so the tests check calibration, power and
coverage over thousands of synthetic pairs at once.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

LEVEL = 0.95
RESAMPLES = 10_000
SLOWER, FASTER, SAME, UNCLEAR, INSUFFICIENT = "slower", "faster", "same", "unclear", \
    "insufficient"
VERDICTS = (SLOWER, FASTER, SAME, UNCLEAR, INSUFFICIENT)
# bootstrap block size in array elements: memory stays bounded (~32 MiB per run) whatever the
# batch, the number of iterations or of resamples
_BLOCK = 2 ** 22


def _rows(x, batch: tuple) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    return np.broadcast_to(x, batch + x.shape[-1:]).reshape(-1, x.shape[-1])


def _resampled_medians(x: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """(k, n) samples → (k, resamples) medians of resamples drawn with replacement."""
    k, n = x.shape
    idx = rng.integers(0, n, size=(k, resamples, n))
    return np.median(np.take_along_axis(x[:, None, :], idx, axis=-1), axis=-1)


def median_ratio_ci(a, b, *, rng: np.random.Generator, resamples: int = RESAMPLES,
                    level: float = LEVEL) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """median(b) / median(a) and its percentile bootstrap interval at ``level``.

    ``a``: (..., n_a), ``b``: (..., n_b) with broadcastable leading dimensions; returns
    (ratio, low, high), each of the leading shape (0-d for one pair)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    batch = np.broadcast_shapes(a.shape[:-1], b.shape[:-1])
    a2, b2 = _rows(a, batch), _rows(b, batch)
    ratio = np.median(b2, axis=-1) / np.median(a2, axis=-1)
    tails = [(1 - level) / 2, (1 + level) / 2]
    per_block = max(1, _BLOCK // (resamples * max(a2.shape[1], b2.shape[1])))
    bounds = []
    for start in range(0, len(a2), per_block):
        block = slice(start, start + per_block)
        boot = (_resampled_medians(b2[block], resamples, rng)
                / _resampled_medians(a2[block], resamples, rng))
        bounds.append(np.quantile(boot, tails, axis=-1))
    low, high = np.concatenate(bounds, axis=1)
    return ratio.reshape(batch), low.reshape(batch), high.reshape(batch)


def mann_whitney(a, b) -> np.ndarray:
    """Two-sided Mann–Whitney U p-values along the last axis (scipy's: exact for small samples
    without ties, normal approximation with tie and continuity corrections otherwise)."""
    return np.asarray(stats.mannwhitneyu(b, a, alternative="two-sided", axis=-1).pvalue)


def min_p(n_a, n_b) -> np.ndarray:
    """The smallest two-sided p-value Mann–Whitney can give with these sample sizes: every B
    sample ranked above every A sample (or below), 2 / C(n_a + n_b, n_a)."""
    n_a, n_b = np.broadcast_arrays(np.asarray(n_a), np.asarray(n_b))
    out = [min(1.0, 2.0 / math.comb(int(x) + int(y), int(x))) for x, y in
           zip(n_a.ravel(), n_b.ravel())]
    return np.asarray(out).reshape(n_a.shape)


def holm(p_values) -> np.ndarray:
    """Holm's step-down adjusted p-values (same order as given): the i-th smallest p times
    (m − i + 1), made monotone, capped at 1. Rejecting where adjusted p < α keeps the chance of
    any false "changed" across the m tests at or below α, whatever their dependence."""
    p = np.asarray(p_values, dtype=float)
    m = p.size
    order = np.argsort(p, kind="stable")
    adjusted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adjusted
    return out


def reachable(n_a, n_b, alpha: float) -> np.ndarray:
    """Per test, whether it can reach α at all under Holm over these m tests: its own most
    extreme p must be below α, and the smallest p any test can give must be below α / m
    (Holm's first step; without it nothing is ever rejected)."""
    floor = min_p(n_a, n_b)
    if floor.size == 0:
        return floor.astype(bool)
    return (floor < alpha) & (floor.size * floor.min() < alpha)


def verdicts(p_adjusted, low, high, can_reach, *, alpha: float,
             min_effect: float) -> np.ndarray:
    """slower / faster / same / unclear / insufficient, elementwise (see the module
    docstring). "same" needs no significance: an interval inside the band is the equivalence
    test (two one-sided tests, each at (1 − level) / 2)."""
    p_adjusted, low, high = (np.asarray(x, dtype=float) for x in (p_adjusted, low, high))
    significant = p_adjusted < alpha
    return np.select(
        [~np.asarray(can_reach, dtype=bool), significant & (low > 1 + min_effect),
         significant & (high < 1 - min_effect),
         (low >= 1 - min_effect) & (high <= 1 + min_effect)],
        [INSUFFICIENT, SLOWER, FASTER, SAME], default=UNCLEAR)


def iterations_to_resolve(ratio, low, high, n, *, min_effect: float,
                          power: float = 0.8) -> np.ndarray:
    """Iterations a side that would make an unclear interval land wholly inside or wholly
    outside 1 ± min_effect with probability ``power``, assuming the same spread and ratio: an
    interval's half-width shrinks as 1 / sqrt(n); it must fit, with the ratio's own error at
    ``power`` added (the usual sample-size rule: (z_level + z_power) / z_level times the
    half-width), into the distance from the ratio to the nearer band edge (in log space, where
    a ratio's interval is about symmetric). Aiming the half-width at the edge alone would
    resolve only half the re-runs. A ratio on an edge can never be resolved: inf."""
    ratio, low, high, n = (np.asarray(x, dtype=float) for x in (ratio, low, high, n))
    with np.errstate(divide="ignore", invalid="ignore"):
        half = (np.log(high) - np.log(low)) / 2
        edges = np.abs(np.log(ratio)[..., None]
                       - np.log([1 - min_effect, 1 + min_effect]))
        room = edges.min(axis=-1)
        z_level = stats.norm.ppf((1 + LEVEL) / 2)
        widen = (z_level + stats.norm.ppf(power)) / z_level
        need = np.ceil(n * (widen * half / room) ** 2)
    return np.where(room > 0, need, np.inf)
