"""``cpbench report FILE --accuracy``: the error of every ``--check`` as a metric.

One row per checked case: strategy (options), ranks sharing the problem, dtype, mask, sequence
length; per tensor (out, lse, dq, dk, dv) the max and the RMS error relative to the float64
reference (``reference.compare``: max |err| / max |ref|, sqrt(mean err²) / sqrt(mean ref²)).
Rows of one strategy, dtype and mask sit together by rank count, so the growth of the error
with ring size reads down a column (a strategy that sums its partial results in the activation
dtype grows; one that keeps them in fp32 stays flat). Records from before the RMS fields show
"-" there; a case checked twice in a file (the baseline at both ends, a re-run) shows its last.
"""

from __future__ import annotations

from cpbench.reference import TENSORS
from cpbench.report.labels import head_dim_text, mask_text, rank_unit, row_label
from cpbench.report.render import Fit, prose, render
from cpbench.report.rows import data_text


def _key(record: dict) -> tuple:
    a, topo = record["config"]["attention"], record["topology"]
    return (row_label(record), record["ranks_per_problem"], a["dtype"], mask_text(a),
            a["seqlen"], f"{topo['num_nodes']}×{topo['ranks_per_node']}", record["kernel"],
            head_dim_text(a))


def _values(record: dict) -> dict:
    by = {c["tensor"]: c for c in record["check"]}
    out = {}
    for t in TENSORS:
        c = by.get(t) or {}
        out[f"{t} max"], out[f"{t} rms"] = c.get("max_rel"), c.get("rms_rel")
    out["check"] = "PASS" if all(c["passed"] for c in record["check"]) else "FAIL"
    return out


def rows(records: list[dict]) -> list[dict]:
    """Every checked case's row (its last record), grouped by strategy, dtype and mask and
    ordered by rank count within."""
    last = {_key(r): r for r in records if r.get("check")}
    head = ("Strategy", "Ranks", "Dtype", "Mask", "Seq Len", "Nodes×GPUs", "Kernel", "Head Dim")
    ordered = sorted(last.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][3], kv[0][4],
                                                   kv[0][1], kv[0][5], kv[0][7]))
    return [{**dict(zip(head, key)), **_values(r)} for key, r in ordered]


def _cell(x) -> str:
    if x is None:
        return "-"
    return f"{x:.1e}" if isinstance(x, float) else str(x)


def accuracy_table(records: list[dict], fmt: str = "table") -> str:
    """The table in ``fmt``: table or markdown (errors to two digits), csv or json (every
    figure as recorded)."""
    found = rows(records)
    if not found:
        return "no record has a check: run with --check to measure the errors\n"
    if fmt in ("json", "csv"):
        return data_text(found, fmt)
    title = ("Error against the float64 reference, relative: max = max |err| / max |ref|, "
             "rms = sqrt(mean err²) / sqrt(mean ref²)")
    rename = {} if rank_unit(records) == "GPU" else {"Nodes×GPUs": "Nodes×Ranks"}
    # narrow: the shared problem above the table, then the RMS errors go (the max is what
    # --check compares with its tolerance)
    fit = Fit(lift=("Ranks", "Dtype", "Mask", "Seq Len", "Nodes×GPUs", "Kernel"),
              drop=tuple(f"{t} rms" for t in TENSORS), wrap=("Strategy", "Mask"),
              rename=rename)
    lines = render(None, [{k: _cell(v) for k, v in r.items()} for r in found], fmt, fit)
    head = prose([title + ":"]) if fmt == "table" else [f"*{title}*"]
    return "\n".join([*head, "", *lines]) + "\n"
