"""How the comparison's figures print, and the findings written out in words (seed 004's
"Key findings"), shared by the terminal table and the markdown report."""

from __future__ import annotations

import math

from cpbench.compare import stats
from cpbench.compare.analysis import NOT_COMPARABLE, PHASES, Comparison, PhaseTest, Uncompared
from cpbench.compare.profile import PartChange

TOP_FINDINGS = 3


def percent(fraction: float) -> str:
    """0.95 → "95 %", 0.02 → "2 %" (the docs' spacing)."""
    return f"{fraction * 100:g} %"


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def ratio(x: float) -> str:
    return f"{x:.3f}"


def interval(t: PhaseTest) -> str:
    return f"{t.ci_low:.3f}–{t.ci_high:.3f}"


def p(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "-"
    return "<0.001" if x < 0.001 else f"{x:.3f}"


def z(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if math.isfinite(x) else ("+inf" if x > 0 else "-inf")


def p_is(x: float) -> str:
    """A p-value in a sentence: "p < 0.001", "p = 0.012"."""
    text = p(x)
    return f"p {text[0]} {text[1:]}" if text.startswith("<") else f"p = {text}"


def signed(x: float, digits: int = 2) -> str:
    return f"{x:+.{digits}f}"


def test_row(t: PhaseTest) -> dict[str, str]:
    """One (case, phase) as the verdict table prints it."""
    return {"Case": t.case, "Phase": PHASES[t.phase], "n A": str(len(t.samples_a)),
            "n B": str(len(t.samples_b)), "A median (ms)": ms(t.median_a),
            "B median (ms)": ms(t.median_b), "B/A": ratio(t.ratio),
            f"{percent(stats.LEVEL)} CI": interval(t), "p": p(t.p_value),
            "p (Holm)": p(t.p_adjusted),
            "Verdict": verdict(t)}


def uncompared_row(u: Uncompared) -> dict[str, str]:
    """A (case, phase) with no verdict as the verdict table prints it: its times, and why."""
    return {"Case": u.case, "Phase": PHASES[u.phase], "n A": str(len(u.samples_a)),
            "n B": str(len(u.samples_b)), "A median (ms)": ms(u.median_a),
            "B median (ms)": ms(u.median_b), "B/A": "-", f"{percent(stats.LEVEL)} CI": "-",
            "p": "-", "p (Holm)": "-", "Verdict": NOT_COMPARABLE, "Why": u.reason}


def rows(cmp: Comparison) -> list[dict[str, str]]:
    """The verdict table's rows: the tests, then the (case, phase)s not comparable, with a
    Why column where there are some (the terminal numbers its reasons under the table)."""
    why = {"Why": "-"} if cmp.uncompared else {}
    return [{**test_row(t), **why} for t in cmp.tests] + \
        [uncompared_row(u) for u in cmp.uncompared]


def resolve(k: float | None) -> str:
    """The iterations an unclear test needs, as a note: "~140 iters", "never (ratio on the
    band's edge)"."""
    if k is None:
        return ""
    return f"~{int(k)} iters" if math.isfinite(k) else "never: ratio on the band's edge"


def verdict(t: PhaseTest) -> str:
    return f"{t.verdict} ({resolve(t.iters_to_resolve)})" if t.iters_to_resolve is not None \
        else t.verdict


def part_row(c: PartChange) -> dict[str, str]:
    """One profiled part as the detailed table prints it (seed 004's columns)."""
    delta_mu = None if c.mu_a is None or c.mu_b is None else c.mu_b - c.mu_a
    return {"Case": c.case, "Part": c.part,
            "Suspicion Score": "-" if c.score is None else f"{c.score:.3g}",
            "β_A (%)": f"{c.beta_a:.2f}", "β_B (%)": f"{c.beta_b:.2f}",
            "Δβ (ppt)": signed(c.delta_pp), "Z-Score(β)": z(c.z_beta),
            "p-value(β)": p(c.p_beta), "U-test p(β)": p(c.u_p_beta),
            "μ_A (ms)": ms(c.mu_a), "μ_B (ms)": ms(c.mu_b),
            "Δμ (ms)": "-" if delta_mu is None else signed(delta_mu),
            "Z-Score(log_μ)": z(c.z_log_mu)}


def rule_text(cmp: Comparison) -> str:
    """The decision rule in one sentence, with this comparison's figures."""
    return (f"α = {cmp.alpha:g} after Holm over {len(cmp.tests)} tests; slower / faster also "
            f"need the {percent(cmp.level)} interval of B/A outside 1 ± {cmp.min_effect:g}, "
            f"same needs it inside; unclear: neither")


def verdict_line(cmp: Comparison) -> str:
    counts = cmp.verdict_counts()
    return "Verdicts: " + ", ".join(f"{v} {counts[v]}" for v in stats.VERDICTS) + \
        f", {NOT_COMPARABLE} {len(cmp.uncompared)} ({rule_text(cmp)})"


def _b(text: str, bold: bool) -> str:
    return f"**{text}**" if bold else text


def timing_findings(cmp: Comparison, bold: bool = True) -> list[str]:
    """The slower and faster (case, phase)s in words, largest change first."""
    changed = sorted((t for t in cmp.tests if t.verdict in (stats.SLOWER, stats.FASTER)),
                     key=lambda t: -abs(math.log(t.ratio)))
    lines = []
    for t in changed:
        lines.append(
            f"- {_b(f'{t.case}, {PHASES[t.phase]}:', bold)} B is {_b(t.verdict, bold)}: "
            f"median {ms(t.median_a)} → {ms(t.median_b)} ms (×{t.ratio:.3f}, "
            f"{percent(cmp.level)} CI {interval(t)}), Holm-corrected {p_is(t.p_adjusted)}.")
    unclear = [t for t in cmp.tests if t.verdict == stats.UNCLEAR]
    if unclear:
        need = max((t.iters_to_resolve for t in unclear if t.iters_to_resolve is not None),
                   default=math.inf)
        lines.append(f"- {len(unclear)} tests are unclear: their intervals straddle the edge of "
                     f"1 ± {cmp.min_effect:g}, neither a change nor its absence shown; "
                     + (f"about --iters {int(need)} would resolve them all at this spread."
                        if math.isfinite(need) else
                        "at least one has its ratio on the band's edge (no iteration count "
                        "resolves it): widen or narrow --min-effect."))
    if cmp.uncompared:  # the guards' one rule: no verdict on what does not measure CP
        lines.append(f"- {len(cmp.uncompared)} (case, phase)s are {NOT_COMPARABLE}: a side is "
                     f"flagged or does not measure CP (why: beside them, Why), so no "
                     f"verdict; re-run them on an idle machine with the flags' fixes.")
    insufficient = [t for t in cmp.tests if t.verdict == stats.INSUFFICIENT]
    if insufficient:
        sizes = sorted({(len(t.samples_a), len(t.samples_b)) for t in insufficient})
        lines.append(f"- {len(insufficient)} tests have too few iterations "
                     f"({', '.join(f'{a} vs {b}' for a, b in sizes)}) to reach α = "
                     f"{cmp.alpha:g} over {len(cmp.tests)} tests whatever the timings: "
                     f"re-run with more --iters.")
    return lines


def part_findings(cmp: Comparison, bold: bool = True, top: int = TOP_FINDINGS) -> list[str]:
    """The most suspicious profiled parts in words, as seed 004's Key Findings."""
    lines = []
    for c in cmp.parts[:top]:
        way = "increased" if c.delta_pp > 0 else "decreased"
        head = f"- {_b(f'`{c.part}` in {c.case}:', bold)}"
        share = (f"  - Its share of the step (β) {_b(way, bold)} from "
                 f"{_b(f'{c.beta_a:.2f}%', bold)} to {_b(f'{c.beta_b:.2f}%', bold)} "
                 f"({signed(c.delta_pp)} ppt)" if c.delta_pp else
                 f"  - Its share of the step (β) did not change ({c.beta_a:.2f}%)")
        if not c.tested:
            share += ", not tested (no per-iteration shares on both sides)."
        elif c.p_beta is not None and c.p_beta < cmp.alpha:
            share += f", which is statistically significant (p-value: {p(c.p_beta)})."
        else:
            share += (f", though this change may not be statistically significant "
                      f"(p-value: {p(c.p_beta)}).")
        lines += [head, share]
        if c.mu_a is not None and c.mu_b is not None:
            went = "increased" if c.mu_b > c.mu_a else "decreased"
            lines.append(f"  - Its time (μ) {went} from {ms(c.mu_a)} ms to {ms(c.mu_b)} ms."
                         if c.mu_b != c.mu_a else f"  - Its time (μ): {ms(c.mu_a)} ms in both.")
    return lines
