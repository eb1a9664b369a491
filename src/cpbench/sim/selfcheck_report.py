"""The self-check's table and verdict: each row's error with the interval the noise allows,
then per strategy, per length and overall, or why it refuses to score."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from cpbench.errors import UsageError
from cpbench.sim.hardware import Hardware
from cpbench.sim.selfcheck import DEFAULT_LIMITS, Limits, Measured, Row

WITHIN = 0.15


def _scores(rows: Sequence[Row]) -> tuple[float, int, float]:
    """(median |error|, rows within WITHIN, worst |error|)."""
    errors = sorted(abs(r.error) for r in rows)
    return statistics.median(errors), sum(e <= WITHIN for e in errors), errors[-1]


def _summary(rows: Sequence[Row]) -> str:
    median, within, worst = _scores(rows)
    return (f"median {median * 100:5.1f} %, {within:>3} of {len(rows):>3} within "
            f"{WITHIN * 100:.0f} %, worst {worst * 100:5.1f} %")


def _grouped(rows: Sequence[Row], key: Callable[[Row], object]) -> list[str]:
    groups: dict[object, list[Row]] = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    width = max(len(str(k)) for k in groups)
    return [f"  {str(k):<{width}}  {_summary(g)}" for k, g in groups.items()]


def _table(rows: Sequence[Row]) -> list[str]:
    width = max(len(r.label) for r in rows)
    lines = [f"{'Strategy':<{width}}  {'Seq Len':>7}  {'phase':<7}  {'predicted ms':>12}  "
             f"{'measured ms':>11}  {'rounds':>6}  {'error':>8}  {'noise allows':>16}"]
    for r in rows:
        low, high = r.interval
        lines.append(f"{r.label:<{width}}  {r.seqlen:>7}  {r.phase:<7}  "
                     f"{r.predicted_ms:>12.2f}  {r.measured_ms:>11.2f}  {len(r.rounds_ms):>6}  "
                     f"{r.error * 100:>+7.1f}%  {low * 100:>+6.1f}..{high * 100:+.1f} %")
    return lines


def _refusal(measured: Measured | None, limits: Limits) -> str | None:
    if measured is None:
        return None
    if measured.load is None:
        return "not scored: the load meter needs Linux's /proc (other processes' CPU unknown)"
    if measured.load.share > limits.load:
        return (f"not scored: other processes used {measured.load.share * 100:.0f} % of the "
                f"cores while it measured (limit {limits.load * 100:.0f} %, --load-limit); "
                "run it again on an idle machine")
    return None


def render(rows: list[Row], hw: Hardware, nproc: int, skipped: Sequence[str] = (),
           measured: Measured | None = None, limits: Limits = DEFAULT_LIMITS) -> tuple[str, bool]:
    """(the text, whether it scored). ``measured``: this run's probes and load (None when
    re-predicting an earlier check's records)."""
    if not rows:
        raise UsageError("no case ran to completion: nothing to compare")
    lines = [f"Simulator self-check: {hw.name} predicted vs measured by cpbench run --nproc "
             f"{nproc} on this machine (measured: the fastest iteration of the slowest rank "
             "over the rounds; noise allows: the error against the slowest and the fastest "
             "round)", "", *_table(rows)]
    if skipped:
        lines += ["", "not predicted:", *(f"  {why}" for why in skipped)]
    if measured is not None:
        lines += ["", "machine probes (a forward with every rank busy / with one alone):",
                  *(f"  {p}" for p in measured.probes)]
        lines += [f"  dropped {d}" for d in measured.dropped]
        if measured.load is not None:
            lines.append(f"  load: other processes used {measured.load.share * 100:.1f} % of "
                         f"the cores over {measured.load.wall_s:.0f} s")
    refusal = _refusal(measured, limits)
    lines += ["", "per strategy:", *_grouped(rows, lambda r: r.strategy),
              "per length:", *_grouped(rows, lambda r: r.seqlen)]
    worst = max(rows, key=lambda r: abs(r.error))
    median, within, _ = _scores(rows)
    lines += ["", refusal or f"median |error| {median * 100:.1f} %, "
                             f"{within} of {len(rows)} within {WITHIN * 100:.0f} %",
              f"worst |error| {abs(worst.error) * 100:.1f} % ({worst.label}, {worst.seqlen}, "
              f"{worst.phase})"]
    return "\n".join(lines) + "\n", refusal is None
