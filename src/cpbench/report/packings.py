"""Many packings of one documents distribution (``--packings K``): each a row of its own in
the summary, and here each strategy's median over its packings with their spread: the
fastest and slowest packing, the range of the load imbalance the packings gave it, and the
median padding. A training run packs different documents every step, so the spread is what
a run would see from step to step; the median is what its steps take typically."""

from __future__ import annotations

import math
from statistics import median

from cpbench.report.cells import missing
from cpbench.report.dataframe import frame
from cpbench.report.labels import joined
from cpbench.report.render import Fit, render
from cpbench.results import OK

# what makes rows the same packed problem: the problem less its sampled lengths
PACKED_PROBLEM = ["dtype", "batch", "seqlen", "heads", "kv_heads", "head_dim", "v_head_dim",
                  "causal",
                  "documents_spec", "window", "world", "ranks_per_node", "kernel", "device",
                  "simulated"]


def _time(row: dict) -> float | None:
    t = row["fwd_ms"] if row["fwd_only"] else row["fwd_bwd_ms"]
    return None if t is None or (isinstance(t, float) and math.isnan(t)) else t


def per_strategy(records: list[dict]) -> list[dict]:
    """One entry per (packed problem, strategy and options) that ran: its label, the
    problem, and per packing the time (FWD+BWD, FWD with --fwd-only), imbalance, padding
    and per-iteration times."""
    df = frame(records)
    if df.empty or df["packing"].isna().all():
        return []
    df = df[df["packing"].notna() & (df["status"] == OK)]
    out: dict[tuple, dict] = {}
    for row in df.to_dict("records"):
        if _time(row) is None:
            continue
        problem = tuple(str(row[c]) for c in PACKED_PROBLEM)
        label = joined(row["strategy"], row["options"])
        entry = out.setdefault((problem, label), {
            "label": label, "problem": problem, "row": row, "packings": {}})
        entry["packings"][int(row["packing"])] = {
            "time": _time(row), "imbalance": row["imbalance"],
            "flagged": bool(row["guard_flags"]),
            "not_measured": None if missing(row["not_measured"]) else row["not_measured"],
            "padding": row["padding_fraction"],
            "iters": row["iters_fwd"] if row["fwd_only"] else row["iters_fwd_bwd"]}
    return list(out.values())


def _finite(values) -> list[float]:
    return [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]


def rows(records: list[dict]) -> list[dict]:
    """Display rows: per strategy, its median over packings and the spread."""
    out = []
    entries = per_strategy(records)
    with_flags = any(x["flagged"] or x["not_measured"] for e in entries
                     for x in e["packings"].values())
    for e in entries:
        p = e["packings"].values()
        # a flagged time (cpbench.guards: impossible or too noisy) is no spread to quote
        times = [x["time"] for x in p if not x["flagged"]]
        left_out = len(p) - len(times)
        imb, pad = _finite(x["imbalance"] for x in p), _finite(x["padding"] for x in p)
        row = {
            "Strategy": e["label"], "Documents": e["row"]["documents_spec"],
            "Packings": str(len(times)),
            "Median (ms)": f"{median(times):.2f}" if times else "-",
            "Min (ms)": f"{min(times):.2f}" if times else "-",
            "Max (ms)": f"{max(times):.2f}" if times else "-",
            "Imbalance": f"{min(imb):.2f} - {max(imb):.2f}" if imb else "-",
            "Padding": f"{100 * median(pad):.2f} %" if pad else "-"}
        if with_flags:
            reasons = sorted({x["not_measured"].split(":")[0] for x in p if x["not_measured"]})
            row["Flags"] = "; ".join(
                ([f"{left_out} flagged left out"] if left_out else [])
                + [f"{r}: not CP" for r in reasons]) or "-"
        out.append(row)
    return out


def lines(records: list[dict], fmt: str) -> list[str]:
    """The table under its title, or nothing without packings."""
    table = rows(records)
    if not table:
        return []
    phase = "FWD" if all(r["fwd_only"] for r in frame(records).to_dict("records")) \
        else "FWD+BWD"
    title = (f"Over the packings ({phase}: median over packings, fastest and slowest "
             f"packing; the imbalance range they gave; median padding)")
    if fmt == "markdown":
        return ["", *render(title, table, fmt)]
    return ["", f"{title}:", *render(None, table, fmt, _FIT)]


_FIT = Fit(lift=("Documents",), wrap=("Strategy", "Documents"))
