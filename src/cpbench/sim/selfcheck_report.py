"""The self-check's table and verdict: each row's error against the median (what ``cpbench run``
reports) and the fastest iteration, with the interval the noise allows; then, over the rows
scored out of sample, per strategy, per length and overall (in-sample rows apart), or why it
refuses to score."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from cpbench.errors import UsageError
from cpbench.sim.hardware import Hardware
from cpbench.sim.provenance import HELD_OUT, IN_SAMPLE
from cpbench.sim.selfcheck import DEFAULT_LIMITS, Limits, Measured, Row

WITHIN = 0.15


def _scores(rows: Sequence[Row], fastest: bool = False) -> tuple[float, int, float]:
    """(median |error|, rows within WITHIN, worst |error|), against the median or the
    fastest iteration."""
    errors = sorted(abs(r.error_fastest if fastest else r.error) for r in rows)
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
             f"{'median ms':>9}  {'fastest ms':>10}  {'rounds':>6}  {'error':>8}  "
             f"{'vs fastest':>10}  {'noise allows':>16}  scored"]
    for r in rows:
        low, high = r.interval
        lines.append(f"{r.label:<{width}}  {r.seqlen:>7}  {r.phase:<7}  "
                     f"{r.predicted_ms:>12.2f}  {r.median_ms:>9.2f}  {r.fastest_ms:>10.2f}  "
                     f"{len(r.rounds_ms):>6}  {r.error * 100:>+7.1f}%  "
                     f"{r.error_fastest * 100:>+9.1f}%  {low * 100:>+6.1f}..{high * 100:+.1f} %"
                     f"  {'no' if r.excluded else r.sample}")
    return lines


def refusal(measured: Measured | None, hw: Hardware, limits: Limits) -> str | None:
    """Why the check must not score: a load reading missing or over the limit, for any
    length measured or for the preset's calibration."""
    if hw.probe is not None:  # a preset cpbench calibrate measured on this kind of machine
        if hw.calibration_load is None:
            return ("not scored: the preset carries no load reading (written before "
                    "cpbench calibrate kept one); calibrate again on an idle machine")
        if hw.calibration_load > limits.load:
            return (f"not scored: other processes used {hw.calibration_load * 100:.0f} % of "
                    f"the cores while the preset was calibrated (limit "
                    f"{limits.load * 100:.0f} %, --load-limit); calibrate again on an idle "
                    "machine")
    if measured is None:
        return None
    unknown = sorted({s for s, share in measured.length_loads if share is None})
    if unknown or (not measured.saved and measured.load is None):
        what = "these records carry" if measured.saved else "the load meter took"
        return (f"not scored: {what} no load reading for {', '.join(map(str, unknown)) or 'the'}"
                " length(s) (the meter needs Linux's /proc; records from before the reading "
                "was kept have none): other processes' CPU unknown")
    loaded = [(s, share) for s, share in measured.length_loads
              if share is not None and share > limits.load]
    total = measured.load.share if measured.load is not None else 0.0
    if loaded or total > limits.load:
        seqlen, share = max(loaded, key=lambda x: x[1]) if loaded else ("all", total)
        return (f"not scored: other processes used {share * 100:.0f} % of the cores while "
                f"{seqlen} was measured (limit {limits.load * 100:.0f} %, --load-limit); run "
                "it again on an idle machine")
    return None


def _verdict(rows: Sequence[Row]) -> list[str]:
    """Out of sample first (the headline), in-sample apart: against the median and the
    fastest iteration."""
    lines = []
    for label, meaning in ((HELD_OUT, "no block at a side the preset's curve measured"),
                           (IN_SAMPLE, "a block at a side the preset's curve measured")):
        group = [r for r in rows if r.sample == label]
        if not group:
            continue
        median, within, _ = _scores(group)
        f_median, f_within, _ = _scores(group, fastest=True)
        lines += [f"{label} ({len(group)} rows: {meaning}):",
                  f"  median |error| {median * 100:.1f} %, {within} of {len(group)} within "
                  f"{WITHIN * 100:.0f} % (against the median, as cpbench run reports)",
                  f"  median |error| {f_median * 100:.1f} %, {f_within} of {len(group)} within "
                  f"{WITHIN * 100:.0f} % (against the fastest iteration, calibrate's "
                  "statistic)"]
    return lines


def render(rows: list[Row], hw: Hardware, nproc: int, skipped: Sequence[str] = (),
           measured: Measured | None = None, limits: Limits = DEFAULT_LIMITS) -> tuple[str, bool]:
    """(the text, whether it scored). ``measured``: the probes and load readings, this run's
    or those saved records carry (``selfcheck.from_records``)."""
    if not rows:
        raise UsageError("no case ran to completion: nothing to compare")
    lines = [f"Simulator self-check: {hw.name} predicted vs measured by cpbench run --nproc "
             f"{nproc} on this machine (median: over the rounds' iterations, each the slowest "
             "rank's, as cpbench run reports; fastest: the fastest iteration, the statistic "
             "cpbench calibrate takes; noise allows: the error against the slowest and the "
             "fastest round's median; scored: held out / in-sample (a block at a side the "
             "preset's curve measured) / no)", "", *_table(rows)]
    out = [r for r in rows if r.excluded]
    if out:
        lines += ["", "not scored:", *sorted({f"  {r.label}: {r.excluded}" for r in out})]
    if skipped:
        lines += ["", "not predicted:", *(f"  {why}" for why in skipped)]
    if measured is not None:
        lines += ["", "machine probes (a forward with every rank busy / with one alone):",
                  *(f"  {p}" for p in measured.probes)]
        lines += [f"  dropped {d}" for d in measured.dropped]
        if measured.load is not None:
            lines.append(f"  load: other processes used {measured.load.share * 100:.1f} % of "
                         f"the cores over {measured.load.wall_s:.0f} s")
    if hw.calibration_load is not None:
        lines.append(f"  preset: calibrated while other processes used "
                     f"{hw.calibration_load * 100:.1f} % of the cores")
    why = refusal(measured, hw, limits)
    scored = [r for r in rows if not r.excluded]
    if not scored:
        raise UsageError("every case ran is left out of the score (no CP, or a schedule "
                         "counted once): add strategies")
    headline = [r for r in scored if r.sample == HELD_OUT] or scored
    lines += ["", f"per strategy ({headline[0].sample}, against the median):",
              *_grouped(headline, lambda r: r.strategy),
              "per length:", *_grouped(headline, lambda r: r.seqlen), ""]
    lines += [why] if why else _verdict(scored)
    worst = max(headline, key=lambda r: abs(r.error))
    lines.append(f"worst |error| {abs(worst.error) * 100:.1f} % ({worst.label}, {worst.seqlen}, "
                 f"{worst.phase}, {worst.sample})")
    return "\n".join(lines) + "\n", why is None
