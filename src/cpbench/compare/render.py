"""The comparison as the terminal prints it (``table``) and as ``--format json``."""

from __future__ import annotations

import json
import math
import textwrap

from cpbench.compare import cells
from cpbench.compare.analysis import NOT_COMPARABLE, Comparison
from cpbench.report.render import Fit, prose, render

WIDTH = 100
TOP_PARTS = 10  # the terminal shows the most suspicious parts; markdown shows them all
# narrow tables (report.render): the raw p-value goes before the Holm-corrected one that
# decides; the parts keep their shares and scores before the per-part times and z-scores
TESTS_FIT = Fit(drop=("p", "n A", "n B"), wrap=("Case", "Verdict"), notes=("Why",),
                short={"A median (ms)": "A (ms)", "B median (ms)": "B (ms)"})
PARTS_FIT = Fit(drop=("U-test p(β)", "Z-Score(log_μ)", "Z-Score(β)", "μ_A (ms)", "μ_B (ms)"),
                wrap=("Case", "Part"), short={"Suspicion Score": "Score"})


def environment_lines(cmp: Comparison, bullet: str = "  ") -> list[str]:
    """What else changed between the runs: the fields that differ, then those that did not."""
    changed = cmp.changed_environment()
    same = [row for row in cmp.environment if row[1] == row[2]]
    width = max((len(name) for name, _, _ in changed), default=0)
    lines = [f"{bullet}{name.ljust(width)}  {a}  →  {b}" for name, a, b in changed]
    if not changed:
        lines.append(f"{bullet}nothing the records capture")
    if same:  # wrapped: a sweep's hosts alone can fill a line
        lines += textwrap.wrap("unchanged: " + "; ".join(f"{n} {a}" for n, a, _ in same),
                               WIDTH, initial_indent=bullet,
                               subsequent_indent=" " * len(bullet) + "  ")
    return lines


def header(cmp: Comparison, files_a: list[str], files_b: list[str]) -> list[str]:
    c = cmp.counts
    return [f"A: {', '.join(files_a)} ({c['records_a']} records, {c['cases_a']} cases)",
            f"B: {', '.join(files_b)} ({c['records_b']} records, {c['cases_b']} cases)",
            f"{c['matched']} cases in both runs"]


def unmatched_lines(cmp: Comparison) -> list[str]:
    lines = []
    for side, labels in (("A", cmp.only_a), ("B", cmp.only_b)):
        if labels:
            lines.append(f"Only in {side} ({len(labels)}): " + "; ".join(labels))
    return lines


def table(cmp: Comparison, files_a: list[str], files_b: list[str]) -> str:
    """The terminal report: runs, what else changed, unmatched cases, the verdict table,
    notes, then the profiled parts when both runs have them."""
    out = header(cmp, files_a, files_b) + ["", "What else changed:"]
    out += environment_lines(cmp)
    unmatched = unmatched_lines(cmp)
    out += [""] + unmatched if unmatched else []
    out += [""] + render(None, cells.rows(cmp), "table", TESTS_FIT)
    out += prose([cells.verdict_line(cmp)])
    findings = prose(cells.timing_findings(cmp, bold=False))
    out += ["", "Key findings:"] + findings if findings else []
    if cmp.parts:
        out += ["", "Where the time went (profiled parts, most suspicious first):"]
        out += prose(cells.part_findings(cmp, bold=False))
        out += render(None, [cells.part_row(c) for c in cmp.parts[:TOP_PARTS]], "table",
                      PARTS_FIT)
        if len(cmp.parts) > TOP_PARTS:
            out.append(f"({len(cmp.parts) - TOP_PARTS} more parts: --format markdown)")
    if cmp.notes:
        out += ["", "Notes:"] + prose([f"  {n}" for n in cmp.notes])
    return "\n".join(out) + "\n"


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no inf / nan


def records(cmp: Comparison) -> list[dict]:
    """One dict per (case, phase): the fields ``--format json`` promises, and more (a (case,
    phase) not comparable: its times, verdict "not comparable" and its ``reason``)."""
    return [{"case": t.case, "phase": t.phase, "key": json.loads(t.key),
             "n_a": len(t.samples_a), "n_b": len(t.samples_b),
             "median_a_ms": t.median_a, "median_b_ms": t.median_b,
             "ratio": _finite(t.ratio), "ci_low": _finite(t.ci_low),
             "ci_high": _finite(t.ci_high), "ci_level": cmp.level,
             "p_value": t.p_value, "p_adjusted": t.p_adjusted, "verdict": t.verdict,
             "iters_to_resolve": None if t.iters_to_resolve is None
             else _finite(t.iters_to_resolve),
             "alpha": cmp.alpha, "min_effect": cmp.min_effect}
            for t in cmp.tests] + [
        {"case": u.case, "phase": u.phase, "key": json.loads(u.key), "n_a": len(u.samples_a),
         "n_b": len(u.samples_b), "median_a_ms": u.median_a, "median_b_ms": u.median_b,
         "ratio": None, "ci_low": None, "ci_high": None, "ci_level": cmp.level,
         "p_value": None, "p_adjusted": None, "verdict": NOT_COMPARABLE, "reason": u.reason,
         "iters_to_resolve": None, "alpha": cmp.alpha, "min_effect": cmp.min_effect}
        for u in cmp.uncompared]


def json_text(cmp: Comparison) -> str:
    return json.dumps(records(cmp), indent=2) + "\n"
