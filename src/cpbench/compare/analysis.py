"""One comparison of run A with run B: match the cases, test every (case, phase), correct the
p-values across all of them, judge each, and compare the profiles where both runs have one.
A case either side of which is flagged or does not measure CP (the guards' one rule,
``guards.withhold``) is not tested: "not comparable", with the reason."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

from cpbench import guards, metrics, rounds
from cpbench.compare import match, stats
from cpbench.compare.profile import PartChange, compare_parts, ranked
from cpbench.errors import UsageError
from cpbench.report.tables import case_text
from cpbench.results import OK, STEP_SYNCED, derive

PHASES = {"fwd": "FWD", "fwd_bwd": "FWD+BWD"}  # record key → the name the tables print


@dataclass(frozen=True)
class _Timed:
    """One (case, phase) timed in both runs: per-iteration step times (slowest rank, ms)."""
    case: str
    key: str
    phase: str
    samples_a: tuple[float, ...]
    samples_b: tuple[float, ...]

    @property
    def median_a(self) -> float:
        return float(np.median(self.samples_a))

    @property
    def median_b(self) -> float:
        return float(np.median(self.samples_b))


@dataclass(frozen=True)
class PhaseTest(_Timed):
    """A compared (case, phase): the ratio of medians B / A with its bootstrap interval, the
    Mann–Whitney p before and after Holm, and the verdict."""
    ratio: float
    ci_low: float
    ci_high: float
    p_value: float
    p_adjusted: float
    verdict: str
    # unclear only: about how many iterations a side would resolve it (inf: never)
    iters_to_resolve: float | None = None


NOT_COMPARABLE = "not comparable"


@dataclass(frozen=True)
class Uncompared(_Timed):
    """A (case, phase) whose either side is flagged or does not measure CP
    (``guards.withheld_reason``): its times are shown, no ratio, test or verdict."""
    reason: str


@dataclass(frozen=True)
class Comparison:
    """Everything a report of the comparison prints."""
    tests: list[PhaseTest]
    only_a: list[str]
    only_b: list[str]
    environment: list[tuple[str, str, str]]  # (what, A, B), changed or not
    parts: list[PartChange]  # ranked, most suspicious first
    notes: list[str]
    alpha: float
    min_effect: float
    level: float = stats.LEVEL
    counts: dict = field(default_factory=dict)  # records and cases per run
    uncompared: list[Uncompared] = field(default_factory=list)  # no verdict, and why

    def changed_environment(self) -> list[tuple[str, str, str]]:
        return [row for row in self.environment if row[1] != row[2]]

    def verdict_counts(self) -> dict[str, int]:
        return {v: sum(t.verdict == v for t in self.tests) for v in stats.VERDICTS}


def samples(record: dict, phase: str) -> list[float]:
    """The per-iteration step times of one phase: the slowest rank's, as the tables use."""
    by_rank = (record.get("samples_ms") or {}).get(phase)
    return metrics.slowest_per_iter(by_rank) if by_rank else []


def _pending(cases: list[match.Case], notes: list[str]) -> list[tuple]:
    """(case, phase, A's samples, B's samples) for every phase both runs timed."""
    out = []
    for case in cases:
        sa, sb = case.a["status"], case.b["status"]
        if sa != OK or sb != OK:
            notes.append(f"{case.label}: status {sa} in A, {sb} in B")
        for phase, name in PHASES.items():
            a, b = samples(case.a, phase), samples(case.b, phase)
            if a and b:
                out.append((case, phase, a, b))
            elif a or b:
                notes.append(f"{case.label}: {name} timed only in {'A' if a else 'B'}")
    return out


def why_not(case: match.Case) -> str | None:
    """Why a case gets no verdict: a side flagged or not measuring CP (the guards' one rule,
    ``guards.withhold``: its timings do not say what the strategy costs), or one side's step
    timed with the harness's sync inside it and the other's not; else None."""
    sides = (("A", derive(case.a)), ("B", derive(case.b)))
    reasons = [f"{side}: {why}" for side, d in sides if (why := guards.withheld_reason(d))]
    # an older record's FWD+BWD held the harness's sync between FWD and BWD: against one
    # timed back to back, a difference would be the harness's, not the strategy's
    synced = [side for side, d in sides if d.get("step_synced")]
    if len(synced) == 1:
        reasons.append(f"{synced[0]}: {STEP_SYNCED}, the other's not")
    return "; ".join(reasons) or None


def _rng(seed: int, key: str, phase: str) -> np.random.Generator:
    # one stream per test, from the case itself: a test's interval does not depend on which
    # other cases the files hold or in which order
    return np.random.default_rng([seed, zlib.crc32(f"{key}\n{phase}".encode())])


def compare(a_records: list[dict], b_records: list[dict], *, alpha: float = 0.05,
            min_effect: float = 0.02, seed: int = 0,
            resamples: int = stats.RESAMPLES) -> Comparison:
    """Compare run A's records with run B's; UsageError when no case can be compared."""
    # --rounds K: a case's rounds are one case, their iterations pooled
    a_records, b_records = rounds.pool(a_records), rounds.pool(b_records)
    cases, only_a, only_b = match.match(a_records, b_records)
    if not cases:
        raise UsageError(f"no case is in both runs (A: {len(only_a)} cases, B: "
                         f"{len(only_b)}); compare runs of the same strategy, options, problem, "
                         f"topology and kernel")
    notes: list[str] = [f"{side}: {line.strip()}" for side, recs in (("A", a_records),
                                                                     ("B", b_records))
                        for line in rounds.drift_lines(recs, case_text)[1:]]
    timed = _pending(cases, notes)
    if not timed:
        raise UsageError(f"none of the {len(cases)} cases in both runs has a phase timed in "
                         f"both (failed or OOM); nothing to compare")
    why = {case.key: why_not(case) for case in cases}
    uncompared = [Uncompared(case.label, case.key, phase, tuple(a), tuple(b), reason)
                  for case, phase, a, b in timed if (reason := why[case.key])]
    pending = [t for t in timed if not why[t[0].key]]
    tests = _tests(pending, alpha, min_effect, seed, resamples) if pending else []
    parts: list[PartChange] = []
    for case in cases:
        changes, note = compare_parts(case.label, case.a, case.b)
        parts += changes
        notes += [note] if note else []
    counts = {"records_a": len(a_records), "records_b": len(b_records),
              "cases_a": len(cases) + len(only_a), "cases_b": len(cases) + len(only_b),
              "matched": len(cases)}
    # the environment of the records compared: a stale record of a re-run case does not count
    env = match.environment(list(match.latest(a_records).values()),
                            list(match.latest(b_records).values()))
    return Comparison(tests, only_a, only_b, env, ranked(parts), notes, alpha, min_effect,
                      counts=counts, uncompared=uncompared)


def _tests(pending: list[tuple], alpha: float, min_effect: float, seed: int,
           resamples: int) -> list[PhaseTest]:
    """Each comparable (case, phase): its interval, p-value, Holm's correction over all of
    them, and its verdict."""
    intervals = [stats.median_ratio_ci(a, b, rng=_rng(seed, case.key, phase),
                                       resamples=resamples)
                 for case, phase, a, b in pending]
    p = np.array([float(stats.mann_whitney(a, b)) for _, _, a, b in pending])
    p_adj = stats.holm(p)
    low = np.array([float(lo) for _, lo, _ in intervals])
    high = np.array([float(hi) for _, _, hi in intervals])
    can = stats.reachable([len(a) for _, _, a, _ in pending],
                          [len(b) for _, _, _, b in pending], alpha)
    judged = stats.verdicts(p_adj, low, high, can, alpha=alpha, min_effect=min_effect)
    need = stats.iterations_to_resolve(
        [float(r) for r, _, _ in intervals], low, high,
        [max(len(a), len(b)) for _, _, a, b in pending], min_effect=min_effect)
    return [PhaseTest(case.label, case.key, phase, tuple(a), tuple(b), float(ratio),
                      float(lo), float(hi), float(pv), float(pa), str(v),
                      float(k) if v == stats.UNCLEAR else None)
            for (case, phase, a, b), (ratio, lo, hi), pv, pa, v, k
            in zip(pending, intervals, p, p_adj, judged, need)]
