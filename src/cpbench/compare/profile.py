"""Where the time went: each profiled part's share of the step (β) in run A and run B.

Reads a record's ``profile`` as ``cpbench run --profile`` writes it, and nothing else of it:
``per_iteration`` (per profiled iteration, {part: % of the step}), ``per_iteration_ms`` (each
profiled iteration's wall time) and ``wall_pct`` ({part: % of the step}, the aggregate).
Kept in this one module so a change of that format touches it alone.

With per-iteration shares on both sides, per part: β_A, β_B (mean share over iterations), Δβ
in percentage points, Z(β) and its p-value (Welch's t over iterations, scipy), the Mann–Whitney
p of the shares, the part's time μ = β × the step time (per profiled iteration where the
profile has its times, else the timed median of the slowest rank, FWD+BWD where timed), Z(log μ)
likewise, and seed 004's suspicion score
|Δβ|·(|Z(β)| + |Z(log μ)|). These p-values rank findings; they are not corrected and give no
verdict. With only the aggregate on a side, Δβ alone, untested.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
from scipy import stats

from cpbench import metrics

PER_ITERATION, AGGREGATE = "per_iteration", "wall_pct"
ITERATION_MS = "per_iteration_ms"


@dataclass(frozen=True)
class PartChange:
    """One part of one case: shares in % of the step, times in ms; the test fields are None
    when a side has no per-iteration shares (``tested`` False)."""
    case: str
    part: str
    beta_a: float
    beta_b: float
    delta_pp: float
    tested: bool
    z_beta: float | None = None
    p_beta: float | None = None
    u_p_beta: float | None = None
    mu_a: float | None = None
    mu_b: float | None = None
    z_log_mu: float | None = None
    score: float | None = None


def _step_ms(record: dict) -> float | None:
    samples = record.get("samples_ms") or {}
    phase = samples.get("fwd_bwd") or samples.get("fwd")
    return metrics.step_time(phase) if phase else None


def _shares(profile: dict, parts: list[str]) -> np.ndarray:
    """(iterations, parts) shares in %, a part missing from an iteration counting as 0."""
    return np.array([[float(it.get(p, 0.0)) for p in parts] for it in profile[PER_ITERATION]])


def _welch(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(t, p) of Welch's t-test of b against a; (0, 1) where neither side varies nor differs,
    (±inf, 0) where neither varies but they differ (t divides by a zero spread)."""
    if len(a) < 2 or len(b) < 2:
        return 0.0, 1.0
    if np.ptp(a) == 0 and np.ptp(b) == 0:
        diff = float(b.mean() - a.mean())
        return (0.0, 1.0) if diff == 0 else (math.copysign(math.inf, diff), 0.0)
    with warnings.catch_warnings():  # one side constant: scipy warns, the figure stands
        warnings.simplefilter("ignore", RuntimeWarning)
        res = stats.ttest_ind(b, a, equal_var=False)
    return float(res.statistic), float(res.pvalue)


def _iteration_ms(record: dict, step_ms: float) -> np.ndarray:
    """Each profiled iteration's step time: its own where recorded, else the timed median."""
    profile = record["profile"]
    own = profile.get(ITERATION_MS) or []
    if len(own) == len(profile[PER_ITERATION]):
        return np.asarray(own, dtype=float)
    return np.full(len(profile[PER_ITERATION]), step_ms)


def _log_mu(shares: np.ndarray, step_ms: np.ndarray) -> np.ndarray:
    # iterations where the part did not run have no time to take the log of: left out
    kept = shares > 0
    return np.log(shares[kept] / 100.0 * step_ms[kept])


def _tested(case: str, a: dict, b: dict) -> list[PartChange]:
    parts = list(dict.fromkeys(p for r in (a, b) for it in r["profile"][PER_ITERATION]
                               for p in it))
    sa, sb = _shares(a["profile"], parts), _shares(b["profile"], parts)
    step_a, step_b = _step_ms(a), _step_ms(b)
    out = []
    for j, part in enumerate(parts):
        beta_a, beta_b = float(sa[:, j].mean()), float(sb[:, j].mean())
        z_beta, p_beta = _welch(sa[:, j], sb[:, j])
        u_p = (float(stats.mannwhitneyu(sb[:, j], sa[:, j]).pvalue)
               if np.ptp(np.concatenate([sa[:, j], sb[:, j]])) > 0 else 1.0)
        mu_a = mu_b = z_mu = None
        if step_a and step_b:
            mu_a, mu_b = beta_a / 100 * step_a, beta_b / 100 * step_b
            z_mu, _ = _welch(_log_mu(sa[:, j], _iteration_ms(a, step_a)),
                             _log_mu(sb[:, j], _iteration_ms(b, step_b)))
        delta = beta_b - beta_a
        # no change in share scores 0, even where a constant share gives an infinite Z
        score = abs(delta) * (abs(z_beta) + abs(z_mu or 0.0)) if delta else 0.0
        out.append(PartChange(case, part, beta_a, beta_b, delta, True, z_beta, p_beta, u_p,
                              mu_a, mu_b, z_mu, score))
    return out


def _aggregate(profile: dict) -> dict | None:
    if profile.get(AGGREGATE):
        return {p: float(v) for p, v in profile[AGGREGATE].items()}
    rows = profile.get(PER_ITERATION) or []
    if not rows:
        return None
    parts = list(dict.fromkeys(p for it in rows for p in it))
    return dict(zip(parts, _shares(profile, parts).mean(axis=0).tolist()))


def compare_parts(case: str, a: dict, b: dict) -> tuple[list[PartChange], str | None]:
    """The part changes of one case, and a note when its profiles cannot be compared as fully
    as the module docstring says (None when they can, or when neither run has a profile)."""
    pa, pb = a.get("profile") or {}, b.get("profile") or {}
    if not pa and not pb:
        return [], None
    if not pa or not pb:
        return [], f"{case}: only {'A' if pa else 'B'} has a profile; parts not compared"
    if len(pa.get(PER_ITERATION) or ()) >= 2 and len(pb.get(PER_ITERATION) or ()) >= 2:
        return _tested(case, a, b), None
    agg_a, agg_b = _aggregate(pa), _aggregate(pb)
    if agg_a is None or agg_b is None:
        return [], f"{case}: a profile without part shares; parts not compared"
    parts = list(dict.fromkeys([*agg_a, *agg_b]))
    changes = [PartChange(case, p, agg_a.get(p, 0.0), agg_b.get(p, 0.0),
                          agg_b.get(p, 0.0) - agg_a.get(p, 0.0), False) for p in parts]
    return changes, (f"{case}: no per-iteration shares on both sides; Δβ shown without a "
                     f"test")


def ranked(changes: list[PartChange]) -> list[PartChange]:
    """Tested parts by suspicion score, then untested ones by |Δβ|, largest first."""
    return sorted(changes, key=lambda c: (not c.tested,
                                          -(c.score if c.tested and c.score is not None
                                            else abs(c.delta_pp))))
