"""``--format markdown``: seed 004's report — what else changed, 1. a high-level summary, 2. the
step-time distributions side by side, 3. overview, key findings and the detailed table of
profiled parts sorted by suspicion score, 4. a legend defining every symbol."""

from __future__ import annotations

import math

from cpbench.compare import cells, stats
from cpbench.compare.analysis import PHASES, Comparison, PhaseTest
from cpbench.compare.render import environment_lines, unmatched_lines
from cpbench.report.tables import render


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _summary(cmp: Comparison) -> list[str]:
    c = cmp.counts
    rows = [{"Metric": "Records", "A": str(c["records_a"]), "B": str(c["records_b"]),
             "Δ (B - A)": str(c["records_b"] - c["records_a"]), "Change (%)": "-"},
            {"Metric": "Cases", "A": str(c["cases_a"]), "B": str(c["cases_b"]),
             "Δ (B - A)": str(c["cases_b"] - c["cases_a"]), "Change (%)": "-"},
            {"Metric": "Cases in both", "A": str(c["matched"]), "B": str(c["matched"]),
             "Δ (B - A)": "-", "Change (%)": "-"}]
    for phase, name in PHASES.items():
        tests = [t for t in cmp.tests if t.phase == phase]
        if not tests:
            continue
        a, b = _geomean([t.median_a for t in tests]), _geomean([t.median_b for t in tests])
        rows.append({"Metric": f"{name} median step time, geometric mean (ms)",
                     "A": cells.ms(a), "B": cells.ms(b), "Δ (B - A)": cells.signed(b - a),
                     "Change (%)": f"{(b / a - 1) * 100:+.2f}%"})
    out = ["## 1. High-Level Performance Summary", ""] + render(None, rows, "markdown")
    out += ["", cells.verdict_line(cmp), ""]
    out += render(None, cells.rows(cmp), "markdown")
    unmatched = unmatched_lines(cmp)
    out += [""] + [f"- {line}" for line in unmatched] if unmatched else []
    out += [""] + [f"- Note: {n}" for n in cmp.notes] if cmp.notes else []
    return out


def _distribution(t: PhaseTest) -> list[str]:
    """Seed 004's rank table: each run's iterations, slowest first, side by side."""
    a, b = sorted(t.samples_a, reverse=True), sorted(t.samples_b, reverse=True)
    rows = []
    for i in range(max(len(a), len(b))):
        x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
        rows.append({"Time Rank": str(i + 1), "A Time (ms)": cells.ms(x),
                     "B Time (ms)": cells.ms(y),
                     "Δ (ms)": cells.signed(y - x) if x is not None and y is not None else "-",
                     "Δ (%)": (f"{(y / x - 1) * 100:+.2f}%" if x is not None and y is not None
                               else "-")})
    return [f"### {t.case} — {PHASES[t.phase]} ({t.verdict})", ""] + \
        render(None, rows, "markdown") + [""]


def _overview(cmp: Comparison) -> str:
    changed = [t for t in cmp.tests if t.verdict in (stats.SLOWER, stats.FASTER)]
    if changed:
        top = max(changed, key=lambda t: abs(math.log(t.ratio)))
        text = (f"{len(changed)} of {len(cmp.tests)} (case, phase) tests changed beyond noise "
                f"and the ±{cells.percent(cmp.min_effect)} band; the largest is **{top.case}**, "
                f"{PHASES[top.phase]}: **{top.verdict}** by ×{top.ratio:.3f}.")
    else:
        text = (f"None of the {len(cmp.tests)} (case, phase) tests shows a change beyond noise "
                f"and the ±{cells.percent(cmp.min_effect)} band.")
    if cmp.uncompared:
        text += (f" {len(cmp.uncompared)} (case, phase)s are not comparable (a side flagged or "
                 f"not measuring CP): no verdict, the reason in the table.")
    unclear = sum(t.verdict == stats.UNCLEAR for t in cmp.tests)
    if unclear:  # "no change shown" is not "shown unchanged"
        text += (f" {unclear} of them are unclear: their data neither show a change nor rule "
                 f"one out.")
    if cmp.parts:
        top_part = cmp.parts[0]
        text += (f" Among the profiled parts, the largest suspicion is **`{top_part.part}`** in "
                 f"{top_part.case} ({cells.signed(top_part.delta_pp)} ppt of the step).")
    return text


def _in_depth(cmp: Comparison) -> list[str]:
    out = ["## 3. In-depth Comparison", "", "### Overview", "", _overview(cmp), "",
           "### Key Findings:"]
    findings = cells.timing_findings(cmp) + cells.part_findings(cmp)
    out += findings or ["- No (case, phase) changed beyond noise, and no profiles to compare."]
    out += ["", "**Recommendation:** start with the finding with the largest change or the "
                "highest **Suspicion Score**; check the environment differences at the top "
                "first, since a changed library or host explains many changes at once.",
            "", "### Detailed comparison table", ""]
    if cmp.parts:
        out += ["This table lists each profiled (case, part) of both runs, sorted by "
                "**Suspicion Score** in descending order (untested parts last, by |Δβ|).", ""]
        out += render(None, [cells.part_row(c) for c in cmp.parts], "markdown")
    else:
        out.append("No case has a profile in both runs (`cpbench run --profile DIR` records "
                   "one): the parts of the step are not compared.")
    return out


def _legend(cmp: Comparison) -> list[str]:
    level = cells.percent(cmp.level)
    return [
        "## 4. Legend",
        "- **A, B**: the two runs compared (the files at the top); a case is the same strategy, "
        "resolved options, problem, topology and kernel in both; a file holding a case twice "
        "counts its last record.",
        "- **FWD, FWD+BWD**: the timed phases. **Time**: per iteration, the step time of the "
        "slowest rank (ms), as cpbench's tables use; **median**: over iterations; **n**: "
        "timed iterations.",
        f"- **B/A**: median of B over median of A (> 1: B is slower). **{level} CI**: percentile "
        "bootstrap interval of B/A (each run's iterations resampled on their own, seeded).",
        "- **p**: two-sided Mann–Whitney U p-value (scipy) of B's iterations against A's. "
        f"**p (Holm)**: corrected by Holm over all {len(cmp.tests)} tests of this comparison.",
        f"- **Verdict**: *slower* / *faster* when p (Holm) < α = {cmp.alpha:g} **and** the "
        f"whole {level} interval lies above 1 + {cmp.min_effect:g} / below 1 − "
        f"{cmp.min_effect:g} (the practical-equivalence band, `--min-effect`); *same* "
        "only when the whole interval lies inside that band (an equivalence test: any change "
        "is too small to matter); *unclear* otherwise (neither a change nor its absence "
        "shown), with about how many iterations a side would resolve it at the observed "
        "spread; *insufficient* when the "
        "iteration counts cannot give p < α after Holm even with every B iteration ranked "
        "beyond every A iteration (smallest p = 2 / C(n_A + n_B, n_A)); *not comparable* "
        "when a side's row is flagged or does not measure CP (cpbench's guards): no test, no "
        "ratio, the reason given.",
        "- **Time Rank**: iterations sorted slowest first; **Δ**: B − A at the same rank.",
        "- **β**: a profiled part's share of the step time (%, mean over profiled iterations). "
        "**Δβ (ppt)**: β_B − β_A in percentage points.",
        "- **μ**: the part's time, β × the run's median step time (FWD+BWD where timed), ms.",
        "- **Z-Score(β)**, **Z-Score(log_μ)**: Welch's t statistic of B's per-iteration β "
        "(log μ) against A's; **p-value(β)**: its two-sided p; **U-test p(β)**: Mann–Whitney "
        "p of the shares. Not corrected: they rank parts, they give no verdict.",
        "- **Suspicion Score**: |Δβ| · (|Z-Score(β)| + |Z-Score(log_μ)|), seed 004's ranking. "
        "**Focus on the parts with the highest score first.**",
    ]


def markdown(cmp: Comparison, files_a: list[str], files_b: list[str]) -> str:
    out = [f"# Two-run comparison: A ({', '.join(files_a)}) vs B ({', '.join(files_b)})", "",
           "**What else changed:**", ""]
    out += environment_lines(cmp, bullet="- ") + [""]
    out += _summary(cmp) + ["", "## 2. Step Time Distribution Comparison", ""]
    for t in cmp.tests:
        out += _distribution(t)
    out += _in_depth(cmp) + [""] + _legend(cmp)
    return "\n".join(out) + "\n"
