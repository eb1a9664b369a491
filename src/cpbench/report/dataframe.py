"""Records as a pandas frame: one row per record, every figure derived from its raw samples
(``results.derive``), plus each CP row's efficiency against the no-CP baseline of the same
problem. Every table, pivot and plot is rendered from this frame.

A row whose timings do not measure CP (``guards.not_measured``: ranks sharing cores, a busy
machine), or whose baseline's do not, has no efficiency, and no fraction of ideal; an
efficiency above what the row's balance allows is flagged (``guards.efficiency_flag``), and a
flagged row's CP figures are None in the frame, as ``guards.withhold`` has them."""

from __future__ import annotations

from statistics import median
from typing import Iterable

from cpbench import guards
from cpbench.metrics import bootstrap_ratio, slowest_per_iter
from cpbench.report.labels import joined, options_label, window_text
from cpbench.results import OK, derive

# the columns that make two rows the same problem (an efficiency compares only those)
PROBLEM = ["dtype", "batch", "seqlen", "heads", "kv_heads", "head_dim", "v_head_dim", "causal",
           "documents", "window", "world", "ranks_per_node", "kernel", "device"]
_FIGURES = ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "memory_mb", "fwd_tflops", "bwd_tflops",
            "fwd_bwd_tflops", "check_passed", "imbalance", "padded_tokens",
            "padding_fraction", "fraction_of_ideal")


def _iterations(r: dict, phase: str) -> list[float] | None:
    """The per-iteration step times (slowest rank) of a phase, where measured."""
    samples = (r.get("samples_ms") or {}).get(phase)
    return slowest_per_iter(samples) if samples else None


def _row(r: dict) -> dict:
    cfg, d, topo = r["config"], derive(r), r["topology"]
    a = cfg["attention"]
    return {
        "strategy": cfg["strategy"], "options": options_label(r),
        "dtype": a["dtype"], "batch": a["batch"], "seqlen": a["seqlen"],
        "heads": a["heads"], "kv_heads": a["kv_heads"] or a["heads"],
        "head_dim": a["head_dim"], "v_head_dim": a.get("v_head_dim") or a["head_dim"],
        "causal": a["causal"],
        "documents": ",".join(map(str, a.get("documents") or ())) or "-",
        "window": window_text(a),
        "world": topo["world_size"], "nodes": topo["num_nodes"],
        "ranks_per_node": topo["ranks_per_node"],
        "ranks_per_problem": r["ranks_per_problem"], "kernel": r["kernel"],
        "device": cfg["run"]["device"], "fwd_only": cfg["run"]["fwd_only"],
        "launcher": r["env"].get("launcher"),
        "status": r["status"], "error": r.get("error"),
        "memory_status": r.get("memory_status"), "memory_error": r.get("memory_error"),
        **{k: d.get(k) for k in _FIGURES},
        "flags": "; ".join(d.get("flags") or ()),  # the physics guards' (cpbench.guards)
        "guard_flags": "; ".join(d.get("flags") or ()),  # those alone: the baseline's not added
        "not_measured": d.get("not_measured"),  # why its timings do not measure CP, or None
        "utc": r["env"].get("utc"), "git_sha": r["env"].get("git_sha"),
        "simulated": bool(r["env"].get("simulated")),
        # the breakdown of a profiled step (run --profile), where the record has one
        "exposed_comm_pct": (r.get("profile") or {}).get("exposed_comm_pct"),
        "exposed_comm_ms": (r.get("profile") or {}).get("exposed_comm_ms"),
        "iters_fwd": _iterations(r, "fwd"), "iters_fwd_bwd": _iterations(r, "fwd_bwd"),
        # --packings K: which packing of which distribution (None: one fixed problem)
        "packing": (r.get("packing") or {}).get("index"),
        "packings": (r.get("packing") or {}).get("count"),
        "documents_spec": (r.get("packing") or {}).get("documents"),
    }


def to_frame(records: Iterable[dict]):
    """One pandas row per record: the problem, topology, status and every derived figure."""
    import pandas as pd

    return pd.DataFrame([_row(r) for r in records])


def frame(records: list[dict]):
    """``to_frame`` plus each CP row's efficiency against the no-CP baseline
    (ranks_per_problem == 1) of the same problem: T_local / (N · T_cp), FWD+BWD where both
    have it, else FWD."""
    df = to_frame(records)
    if df.empty:
        return df
    ok = df["status"] == OK
    df = df.merge(_baselines(df[ok & (df["ranks_per_problem"] == 1)]), on=PROBLEM,
                  how="left")  # keeps the records' order
    both = df["fwd_bwd_ms"].notna() & df["base_fwd_bwd_ms"].notna()
    t_cp = df["fwd_bwd_ms"].where(both, df["fwd_ms"])
    t_base = df["base_fwd_bwd_ms"].where(both, df["base_fwd_ms"])
    # a row, or its baseline, timed where the timings do not measure CP: no efficiency
    df["efficiency_not_measured"] = df["not_measured"].where(
        df["not_measured"].notna(), df["base_not_measured"])
    measured = df["efficiency_not_measured"].isna()
    # a flagged row's CP figures are withheld (guards.withhold): its efficiency too
    cp_row = ok & (df["ranks_per_problem"] > 1) & measured & (df["guard_flags"] == "")
    df["cp_efficiency"] = (t_base / (df["ranks_per_problem"] * t_cp)).where(cp_row)
    df["efficiency_phase"] = both.map({True: "FWD+BWD", False: "FWD"})
    lo_hi = [_efficiency_interval(row, b) if c else (None, None)
             for row, b, c in zip(df.to_dict("records"), both, cp_row)]
    df["cp_efficiency_low"] = [lo for lo, _ in lo_hi]
    df["cp_efficiency_high"] = [hi for _, hi in lo_hi]
    df["efficiency_flag"] = [_efficiency_flag(row) for row in df.to_dict("records")]
    df["flags"] = ["; ".join(f for f in parts if isinstance(f, str) and f)
                   for parts in zip(df["flags"], df["efficiency_flag"], drift_flags(df))]
    # the flags the join added (an efficiency past its bound, a drifted baseline) withhold
    # the row's CP figures as the record's own do (guards.withhold)
    withheld = (df["flags"] != "") | df["not_measured"].notna()
    for column in guards.CP_FIGURES:
        if column in df:
            df[column] = df[column].where(~withheld)  # NaN: cells print "-"
    df["label"] = [joined(s, o) for s, o in zip(df["strategy"], df["options"])]
    return df


def _efficiency_flag(row: dict) -> str | None:
    """The row's efficiency's flag where it is above what its balance allows, or None."""
    eff = row["cp_efficiency"]
    if eff is None or eff != eff:  # none (NaN)
        return None
    low = row["cp_efficiency_low"]
    interval = None if low is None else (low, row["cp_efficiency_high"])
    imbalance = row["imbalance"] if row["imbalance"] == row["imbalance"] else None
    both = row["efficiency_phase"] == "FWD+BWD"
    times = (row["efficiency_phase"], row["fwd_bwd_ms"] if both else row["fwd_ms"],
             row["base_fwd_bwd_ms"] if both else row["base_fwd_ms"],
             int(row["ranks_per_problem"]))
    return guards.efficiency_flag(eff, interval, imbalance, times)


def _pooled(series) -> list[float] | None:
    lists = [x for x in series if x]
    return [v for x in lists for v in x] if lists else None


def _baselines(base_rows):
    """One baseline per problem: every record of it (a run times it at both ends) pooled,
    its time the median of the pooled iterations; each record's iterations kept apart
    (``base_each``) to see whether they agree."""
    import pandas as pd

    rows = []
    for key, g in base_rows.groupby(PROBLEM, sort=False, dropna=False):
        fwd, both = _pooled(g["iters_fwd"]), _pooled(g["iters_fwd_bwd"])
        reasons = [x for x in g["not_measured"] if x]
        rows.append({**dict(zip(PROBLEM, key)), "baseline": g["strategy"].iloc[0],
                     "base_not_measured": reasons[0] if reasons else None,
                     "base_fwd_ms": median(fwd) if fwd else None,
                     "base_fwd_bwd_ms": median(both) if both else None,
                     "base_iters_fwd": fwd, "base_iters_fwd_bwd": both,
                     "base_each": [x for x in g["iters_fwd_bwd"] if x]
                     or [x for x in g["iters_fwd"] if x]})
    columns = PROBLEM + ["baseline", "base_not_measured", "base_fwd_ms", "base_fwd_bwd_ms",
                         "base_iters_fwd",
                         "base_iters_fwd_bwd", "base_each"]
    return pd.DataFrame(rows, columns=columns)


def _efficiency_interval(row: dict, both: bool) -> tuple[float | None, float | None]:
    """The efficiency's bootstrap 95 % interval from the per-iteration samples."""
    base = row["base_iters_fwd_bwd"] if both else row["base_iters_fwd"]
    mine = row["iters_fwd_bwd"] if both else row["iters_fwd"]
    if not isinstance(base, list) or not isinstance(mine, list) or not base or not mine:
        return None, None  # no baseline for this problem (pandas fills NaN), or no samples
    return bootstrap_ratio(base, mine, scale=1 / row["ranks_per_problem"])


def efficiencies(records: list[dict]) -> list[tuple]:
    """(row label, N, baseline, timed phase, efficiency, (interval low, high)) for every CP
    row with a baseline; the interval is None where samples are missing."""
    df = frame(records)
    if df.empty:
        return []
    return [(row["label"], int(row["ranks_per_problem"]), row["baseline"],
             row["efficiency_phase"], float(row["cp_efficiency"]),
             None if row["cp_efficiency_low"] is None
             else (row["cp_efficiency_low"], row["cp_efficiency_high"]))
            for row in df[df["cp_efficiency"].notna()].to_dict("records")]


def _drift(each: list[list[float]]) -> str | None:
    """"timed A, B ms, beyond their spread" when a baseline's timings (a run's first and
    last case) have 95 % intervals of their medians that do not overlap; else None."""
    if len(each) < 2:
        return None
    spans = [bootstrap_ratio(x, [1.0]) for x in each]  # each timing's median interval
    if max(lo for lo, _ in spans) <= min(hi for _, hi in spans):
        return None
    return f"timed {', '.join(f'{median(x):.2f}' for x in each)} ms, beyond their spread"


def _drifted(df):
    """Problem key → its baseline's drift (``_drift``), where it drifted."""
    base = _baselines(df[(df["status"] == OK) & (df["ranks_per_problem"] == 1)])
    found = {}
    for row in base.to_dict("records"):
        drift = _drift(row["base_each"])
        if drift:
            found[tuple(row[k] for k in PROBLEM)] = (row["baseline"], row["seqlen"], drift)
    return found


def baseline_drift(records: list[dict]) -> list[str]:
    """Problems whose baseline was timed more than once (a run's first and last case) with
    intervals that do not overlap: the machine's load changed during the run, and every
    efficiency against it is suspect. One line each (the baseline's rows carry the flag)."""
    df = to_frame(records)
    if df.empty:
        return []
    return [f"warning: {name} at seqlen {seqlen} {drift}: the machine's load changed during "
            f"the run; its efficiencies are suspect"
            for name, seqlen, drift in _drifted(df).values()]


def drift_flags(df) -> list[str]:
    """Per row of ``df``: "baseline drifted: …" on a baseline row whose timings drifted."""
    drifted = _drifted(df)
    return [f"baseline drifted: {drifted[key][2]}"
            if r["ranks_per_problem"] == 1 and r["status"] == OK and key in drifted else ""
            for r, key in ((r, tuple(r[k] for k in PROBLEM)) for r in df.to_dict("records"))]
