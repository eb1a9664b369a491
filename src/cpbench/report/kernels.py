"""``cpbench kernels`` tables (seed 003's single-device attention benchmark): one row per
kernel × shape, FWD / BWD / FWD+BWD ms, memory, TFLOPs/s and the speedup over a baseline
kernel on the same shape. Built from result records (``env.kernel_bench``), so ``cpbench
report`` renders a kernels file the same way; cases that were skipped are rows with a note.
"""

from __future__ import annotations

from typing import Sequence

from cpbench.report.render import Fit, render
from cpbench.report.rows import data_text

SHAPE = ("seqlen", "heads", "head_dim", "dtype", "causal")
# narrow (report.render): the shape every row shares above the table, skip reasons as notes,
# then the per-phase speedups, the forward's rate and memory go before the FWD+BWD figures
_FIT = Fit(lift=("Seq Len", "Heads", "Head Dim", "dtype", "Causal"), notes=("Note",),
           drop=("Speedup FWD", "Speedup BWD", "FWD TFLOPs/s", "Memory (MB)"),
           short={"Memory (MB)": "Mem (MB)"})


def is_kernel_bench(records: list[dict]) -> bool:
    return bool(records) and all(r.get("env", {}).get("kernel_bench") for r in records)


def _shape(attention: dict) -> tuple:
    return tuple(attention[k] for k in SHAPE)


def _values(record: dict) -> dict:
    a, d = record["config"]["attention"], record.get("derived") or {}
    failed = record["status"] in ("OOM", "failed")
    return {"kernel": record["kernel"], **{k: a[k] for k in SHAPE},
            "fwd_ms": d.get("fwd_ms"), "bwd_ms": d.get("bwd_ms"),
            "fwd_bwd_ms": d.get("fwd_bwd_ms"), "memory_mb": d.get("memory_mb"),
            "fwd_tflops": d.get("fwd_tflops"), "fwd_bwd_tflops": d.get("fwd_bwd_tflops"),
            "status": record["status"], "note": record.get("error") if failed else None}


def values(records: list[dict], skipped: Sequence[dict] = (), baseline: str | None = None
           ) -> list[dict]:
    """Every row's numbers (None where not measured), with speedups over ``baseline``'s row
    of the same shape (its time / this time: > 1 is faster)."""
    rows = [_values(r) for r in records] + [
        {"kernel": s["kernel"], **{k: s["attention"][k] for k in SHAPE}, "status": "skipped",
         "note": s["reason"]} for s in skipped]
    base = {_shape(r): r for r in rows if r["kernel"] == baseline and r["status"] == "ok"}
    for r in rows:
        b = base.get(tuple(r[k] for k in SHAPE))
        for phase in ("fwd", "bwd", "fwd_bwd"):
            mine, theirs = r.get(f"{phase}_ms"), b and b.get(f"{phase}_ms")
            r[f"speedup_{phase}"] = theirs / mine if mine and theirs and mine > 0 else None
    return rows


def _cell(x, spec: str = ".2f", status: str = "ok") -> str:
    if x is None:
        return status if status in ("OOM", "failed", "skipped") else "-"
    return format(x, spec)


NOTE_CHARS = 72  # a failure's error in the table; the record keeps it whole, and its traceback


def _note(r: dict) -> str:
    note = r.get("note") or ""
    if r["status"] not in ("OOM", "failed") or len(note) <= NOTE_CHARS:
        return note
    return note[:NOTE_CHARS - 1] + "…"


def _table_row(r: dict) -> dict:
    st = r["status"]
    return {
        "Kernel": r["kernel"], "Seq Len": str(r["seqlen"]), "Heads": str(r["heads"]),
        "Head Dim": str(r["head_dim"]), "dtype": r["dtype"],
        "Causal": "yes" if r["causal"] else "no",
        "FWD (ms)": _cell(r.get("fwd_ms"), status=st),
        "BWD (ms)": _cell(r.get("bwd_ms"), status=st),
        "FWD+BWD (ms)": _cell(r.get("fwd_bwd_ms"), status=st),
        "Memory (MB)": _cell(r.get("memory_mb"), ".1f", st),
        "FWD TFLOPs/s": _cell(r.get("fwd_tflops"), ".4f", st),
        "FWD+BWD TFLOPs/s": _cell(r.get("fwd_bwd_tflops"), ".4f", st),
        "Speedup FWD": _speed(r["speedup_fwd"]), "Speedup BWD": _speed(r["speedup_bwd"]),
        "Speedup FWD+BWD": _speed(r["speedup_fwd_bwd"]), "Note": _note(r),
    }


def _speed(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def render_kernels(records: list[dict], fmt: str, *, skipped: Sequence[dict] = (),
                   baseline: str | None = None) -> str:
    """The kernels table in ``fmt`` (table, markdown: seed layouts; csv, json: numbers)."""
    rows = values(records, skipped, baseline)
    if not rows:
        return "no kernel cases\n"
    if fmt in ("json", "csv"):
        return data_text(rows, fmt)
    speedups = any(r[f"speedup_{p}"] is not None for r in rows for p in ("fwd", "fwd_bwd"))
    title = "Attention kernels" + (f" (speedup: {baseline}'s time / this time)"
                                   if baseline and speedups else "")
    return "\n".join(render(title, [_table_row(r) for r in rows], fmt, _FIT)) + "\n"
