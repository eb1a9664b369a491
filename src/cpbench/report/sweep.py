"""Reports over many runs (a sweep's JSONL): seed 001's tables grouped by strategy, a pivot
(strategy × Seq Len → TFLOPs/s per GPU, FWD+BWD ms, memory); placements side by side are
``report.placements``.
"GPU" reads "rank" where the ranks are CPU processes (``labels.rank_unit``); every table fits
the terminal (``report.render``) unless ``--wide``.

- ``grouped``: as seed 001 prints a sweep — a ``### <strategy (placement)> on N×G GPUs``
  heading and one seed-format table per strategy, placement and topology, rows by Seq Len.
- ``pivot``: one table per figure, a row per strategy (and placement, and topology when the
  records hold several), a column per Seq Len; OOM / failed cells say so.

A case recorded more than once (a sweep re-run after a failure) counts once: its last record.
Figures come from ``dataframe.frame`` (recomputed from the raw samples).
"""

from __future__ import annotations

import json
from statistics import median

from cpbench import rounds
from cpbench.metrics import ratio_interval
from cpbench.report import tables
from cpbench.report.dataframe import PROBLEM, frame
from cpbench.report.labels import rank_unit, ranks_text, unit_of
from cpbench.report.render import Fit
from cpbench.results import OK

# a case: the options as asked (not as resolved: a failure record written by the sweep has no
# resolved options), the problem, the topology
_CASE = ["strategy", "_asked", *PROBLEM, "fwd_only"]


def one_launch(records: list[dict]) -> bool:
    """Whether every record came from one ``cpbench run`` (they share its captured env)."""
    return len({json.dumps(r.get("env"), sort_keys=True) for r in records}) <= 1


def size_text(n: int) -> str:
    """131072 → 128K, 1048576 → 1M; other values as they are."""
    for unit, scale in (("M", 2 ** 20), ("K", 2 ** 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def latest_frame(records: list[dict]):
    """``frame`` with its display cells, one row per case (the last record of each),
    in first-seen order; ``label`` is strategy (options), ``topo`` N×G."""
    df = frame(records)
    if df.empty:
        return df
    cells = tables.rows(records)
    for col in ("FWD (ms)", "FWD+BWD (ms)", "Memory (MB)", "TFLOPs/s", "CP Efficiency (%)"):
        df[col] = [c[col] for c in cells]
    df["_cells"] = cells
    df["_asked"] = [json.dumps(r["config"]["options"], sort_keys=True) for r in records]
    if df["kernel"].nunique() > 1:  # e.g. two hardware presets, or flash-attn and cuDNN runs
        df["label"] = [f"{lab} [{k}]" for lab, k in zip(df["label"], df["kernel"])]
    df["topo"] = [f"{n}×{g}" for n, g in zip(df["nodes"], df["ranks_per_node"])]
    first = df.drop_duplicates(_CASE, keep="first").index
    last = df.drop_duplicates(_CASE, keep="last")
    order = {tuple(df.loc[i, _CASE]): k for k, i in enumerate(first)}
    last = last.assign(_order=[order[tuple(r)] for r in last[_CASE].itertuples(index=False)])
    return last.sort_values("_order", kind="stable").drop(columns="_order")


def grouped(records: list[dict], fmt: str = "table") -> str:
    """Seed 001's layout: a heading and a table per strategy (placement) and topology."""
    df = latest_frame(records)
    if df.empty:
        return "no records\n"
    lines: list[str] = []
    fit = tables.fit(records)
    for (label, topo), g in df.groupby(["label", "topo"], sort=False):
        units = ranks_text(unit_of(zip(g["device"], g["launcher"])))
        g = g.sort_values("seqlen", kind="stable")
        drop = {"Strategy", "Placement", "Nodes×GPUs"}
        for col in ("CP Efficiency (%)", "Fraction of Ideal (%)"):  # neither measured: no column
            if all(c.get(col, "-") == "-" for c in g["_cells"]):
                drop.add(col)
        if "Check" in g["_cells"].iloc[0] and all(c["Check"] == "-" for c in g["_cells"]):
            drop.add("Check")
        table_rows = [{k: v for k, v in c.items() if k not in drop} for c in g["_cells"]]
        if lines:
            lines.append("")
        lines += tables.render(f"{label} on {topo} {units}", table_rows, fmt, fit)
    return "\n".join(lines) + "\n"


def row_keys(df):
    """Each row's name in pivots and plots: its label, with the topology when the frame holds
    several and "(simulated)" beside measured rows."""
    several = df["topo"].nunique() > 1
    mixed = df["simulated"].nunique() > 1  # a prediction beside the measured row
    return [(f"{lab} [{t}]" if several else lab) + (" (simulated)" if mixed and sim else "")
            for lab, t, sim in zip(df["label"], df["topo"], df["simulated"])]


_PIVOTS = (("TFLOPs/s per {unit}", "TFLOPs/s"), ("FWD+BWD (ms)", "FWD+BWD (ms)"),
           ("Memory (MB)", "Memory (MB)"))
_PIVOT_FIT = Fit(wrap=("Strategy",))


def pivot(records: list[dict], fmt: str = "table") -> str:
    """Strategy (placement[, topology]) × Seq Len → TFLOPs/s per GPU, FWD+BWD ms, memory."""
    df = latest_frame(records)
    if df.empty:
        return "no records\n"
    df = df.assign(row=row_keys(df))
    if df["fwd_only"].all():  # a forward-only sweep: its time is the FWD column
        pivots = (_PIVOTS[0], ("FWD (ms)", "FWD (ms)"), _PIVOTS[2])
    else:
        pivots = _PIVOTS
    seqlens = sorted(df["seqlen"].unique())
    lines: list[str] = []
    for title, col in pivots:
        table = df.pivot_table(index="row", columns="seqlen", values=col, aggfunc="last",
                               sort=False)
        table_rows = []
        for row in dict.fromkeys(df["row"]):
            cells = {"Strategy": row}
            for s in seqlens:
                value = table.at[row, s] if s in table.columns else None
                cells[size_text(int(s))] = "-" if not isinstance(value, str) else value
            table_rows.append(cells)
        if lines:
            lines.append("")
        lines += tables.render(f"{title.format(unit=rank_unit(records))} by Seq Len",
                               table_rows, fmt, _PIVOT_FIT)
    return "\n".join(lines) + "\n"


def ratio_cell(den: dict | None, num: dict | None, phase: str) -> str:
    """``num``'s rate over ``den``'s (time of den over time of num: > 1 is faster) with its
    bootstrap 95 % interval from the per-iteration samples (none from fewer than
    ``metrics.MIN_SAMPLES`` a side); "-" unless both ran."""
    if not (den and num and den["status"] == num["status"] == OK):
        return "-"
    if any(r["flags"] or isinstance(r["not_measured"], str) for r in (den, num)):
        return "-"  # a rate withheld (guards.withhold) is no ratio either
    a, b = den[f"iters_{phase}"], num[f"iters_{phase}"]
    if not isinstance(a, list) or not isinstance(b, list) or not a or not b:
        return "-"
    interval = ratio_interval(a, b)  # none from fewer than 3 samples a side
    return f"{median(a) / median(b):.2f}x" + \
        (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")


def sweep_report(records: list[dict], fmt: str = "table") -> str:
    """The grouped tables, then the pivot; first a line saying so when rows are simulated."""
    n, hardware = tables.simulated(records)
    head = ""
    if n and n == len(records):
        head = f"Every row is simulated on {hardware}, not measured (cpbench simulate).\n\n"
    elif n:
        head = (f"{n} of {len(records)} rows are simulated, not measured: the Source "
                f"column and '(simulated)' in the pivots mark them.\n\n")
    drift = rounds.drift_lines(records, tables.case_text)
    return head + grouped(records, fmt) + "\n" + pivot(records, fmt) + \
        ("\n" + "\n".join(drift) + "\n" if drift else "")
