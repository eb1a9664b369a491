"""Records as a pandas frame: one row per record, every figure derived from its raw samples
(``results.derive``), plus each CP row's efficiency against the no-CP baseline of the same
problem. Every table, pivot and plot is rendered from this frame."""

from __future__ import annotations

from typing import Iterable

from cpbench.report.labels import joined, options_label
from cpbench.results import OK, derive

# the columns that make two rows the same problem (an efficiency compares only those)
PROBLEM = ["dtype", "batch", "seqlen", "heads", "kv_heads", "head_dim", "causal", "world",
           "ranks_per_node", "kernel", "device"]
_FIGURES = ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "memory_mb", "fwd_tflops", "bwd_tflops",
            "fwd_bwd_tflops", "check_passed")


def _row(r: dict) -> dict:
    cfg, d, topo = r["config"], derive(r), r["topology"]
    a = cfg["attention"]
    return {
        "strategy": cfg["strategy"], "options": options_label(r),
        "dtype": a["dtype"], "batch": a["batch"], "seqlen": a["seqlen"],
        "heads": a["heads"], "kv_heads": a["kv_heads"] or a["heads"],
        "head_dim": a["head_dim"], "causal": a["causal"],
        "world": topo["world_size"], "nodes": topo["num_nodes"],
        "ranks_per_node": topo["ranks_per_node"],
        "ranks_per_problem": r["ranks_per_problem"], "kernel": r["kernel"],
        "device": cfg["run"]["device"], "fwd_only": cfg["run"]["fwd_only"],
        "status": r["status"], "error": r.get("error"),
        "memory_status": r.get("memory_status"), "memory_error": r.get("memory_error"),
        **{k: d.get(k) for k in _FIGURES},
        "utc": r["env"].get("utc"), "git_sha": r["env"].get("git_sha"),
        "simulated": bool(r["env"].get("simulated")),
        # the breakdown of a profiled step (run --profile), where the record has one
        "exposed_comm_pct": (r.get("profile") or {}).get("exposed_comm_pct"),
        "exposed_comm_ms": (r.get("profile") or {}).get("exposed_comm_ms"),
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
    base = (df[ok & (df["ranks_per_problem"] == 1)]
            .drop_duplicates(PROBLEM)[PROBLEM + ["strategy", "fwd_ms", "fwd_bwd_ms"]]
            .rename(columns={"strategy": "baseline", "fwd_ms": "base_fwd_ms",
                             "fwd_bwd_ms": "base_fwd_bwd_ms"}))
    df = df.merge(base, on=PROBLEM, how="left")  # keeps the records' order
    both = df["fwd_bwd_ms"].notna() & df["base_fwd_bwd_ms"].notna()
    t_cp = df["fwd_bwd_ms"].where(both, df["fwd_ms"])
    t_base = df["base_fwd_bwd_ms"].where(both, df["base_fwd_ms"])
    cp_row = ok & (df["ranks_per_problem"] > 1)
    df["cp_efficiency"] = (t_base / (df["ranks_per_problem"] * t_cp)).where(cp_row)
    df["efficiency_phase"] = both.map({True: "FWD+BWD", False: "FWD"})
    df["label"] = [joined(s, o) for s, o in zip(df["strategy"], df["options"])]
    return df


def efficiencies(records: list[dict]) -> list[tuple[str, int, str, str, float]]:
    """(row label, N, baseline, timed phase, efficiency) for every CP row with a baseline."""
    df = frame(records)
    if df.empty:
        return []
    return [(row["label"], int(row["ranks_per_problem"]), row["baseline"],
             row["efficiency_phase"], float(row["cp_efficiency"]))
            for row in df[df["cp_efficiency"].notna()].to_dict("records")]
