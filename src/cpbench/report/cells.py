"""How a figure prints in a cell, for every table of ``cpbench.report``: one place, so a rule
about a figure (a status where none was measured, a row whose times are not measurements)
holds in every table and line that shows it. Units go in the headers, never in the cells."""

from __future__ import annotations

import math

from cpbench.results import FAILED, OK, OOM


def missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))  # pandas' NaN too


def ms(x) -> str:
    return "-" if missing(x) else f"{x:.2f}"


def sig(x, digits: int = 3) -> str:
    """A prediction: ``digits`` significant figures, no exponent ("1490", "59.8", "0.0123"):
    a simulated figure carries no more precision than the model has."""
    if missing(x):
        return "-"
    if x == 0:
        return "0"
    places = digits - 1 - math.floor(math.log10(abs(x)))
    return f"{round(x, places):.{max(places, 0)}f}"


def cell_ms(value, record: dict) -> str:
    """A time cell: the figure, or the row's status (OOM, failed) where none was measured
    ("-" where nothing was timed: ranks as threads time nothing)."""
    return record["status"] if missing(value) and record["status"] != OK else ms(value)


def tflops(x) -> str:
    if missing(x):
        return "-"
    return f"{x:.2f}" if abs(x) >= 1 else f"{x:.3g}"  # CPU rates are fractions of a TFLOP


def pct(x) -> str:
    """A fraction as a percentage, the unit in the header: 0.478 → "47.8"."""
    return "-" if missing(x) else f"{100 * x:.1f}"


def memory(memory_mb, memory_status) -> str:
    if not missing(memory_mb):
        return ms(memory_mb)
    return memory_status if memory_status in (OOM, FAILED) else "-"


def figures(row: dict) -> dict[str, str]:
    """A frame row's measured figures as cells, by header: FWD (ms), FWD+BWD (ms) (- with
    --fwd-only), Memory (MB), TFLOPs/s (FWD+BWD's, FWD's with --fwd-only). A time that was
    measured shows; OOM / failed fill every other time column and TFLOPs/s."""
    status = row["status"]
    none = status if status != OK else "-"  # OK with no time: nothing was timed (threads)
    simulated = bool(row.get("simulated"))
    number = sig if simulated else ms  # a prediction: 3 significant figures
    fwd = none if missing(row["fwd_ms"]) else number(row["fwd_ms"])
    both = "-" if row["fwd_only"] else \
        none if missing(row["fwd_bwd_ms"]) else number(row["fwd_bwd_ms"])
    rate = status if status != OK else \
        (sig if simulated else tflops)(row["fwd_tflops"] if row["fwd_only"]
                                       else row["fwd_bwd_tflops"])
    mem = memory(row["memory_mb"], row["memory_status"])
    if simulated and not missing(row["memory_mb"]):
        mem = sig(row["memory_mb"])
    return {"FWD (ms)": fwd, "FWD+BWD (ms)": both, "Memory (MB)": mem, "TFLOPs/s": rate}


def with_unit(cell: str, unit: str) -> str:
    """A cell in a sentence: "36.40 ms", or the cell alone when it holds no number."""
    try:
        float(cell)
    except ValueError:
        return cell
    return f"{cell} {unit}"


def efficiency(row: dict) -> str:
    """A CP row's efficiency in % with its bootstrap interval: "37.9 [29.9, 53.0]"; the
    figure alone where there is no interval (too few samples: ``metrics.ratio_interval``)."""
    if missing(row["cp_efficiency"]):
        return "-"
    if missing(row["cp_efficiency_low"]):
        return pct(row["cp_efficiency"])
    return (f"{pct(row['cp_efficiency'])} [{pct(row['cp_efficiency_low'])}, "
            f"{pct(row['cp_efficiency_high'])}]")


def documents(documents: str) -> str:
    """Packed documents: how many and the longest ("-" for one sequence)."""
    if documents == "-":
        return "-"
    lengths = [int(x) for x in documents.split(",")]
    return f"{len(lengths)} (max {max(lengths)})"
