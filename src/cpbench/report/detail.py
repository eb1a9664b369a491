"""Seed 000's per-run block ("Benchmark Results for …": Configuration, Performance), without
its FlashAttention Kernel % lines (a profiler ratio that was not what it said); then the
row's flags, its checks against the float64 reference, its load balance and, with
``--profile``, where the profiled step's time went. ``cpbench run --details`` prints it after
each case; ``cpbench report --details`` re-renders it from the records."""

from __future__ import annotations

import statistics

from cpbench import guards
from cpbench.metrics import duration
from cpbench.profile.summary import detail_lines
from cpbench.reference import TENSORS, Comparison
from cpbench.report import cells
from cpbench.report.labels import (
    head_dim_text,
    mask_text,
    option_text,
    row_label,
    window_text,
)
from cpbench.results import FAILED, OK, OOM, derive

_RULE = 50


def _pct_cell(x) -> str:
    return "-" if cells.missing(x) else f"{cells.pct(x)} %"


def detail(record: dict) -> str:
    """Seed 000's per-run block."""
    d = derive(record)
    lines = ["=" * _RULE, f"Benchmark Results for {row_label(record)}", "=" * _RULE,
             "Configuration:", *_configuration(record), "", "Performance:",
             *_performance(record, d)]
    if d["flags"]:  # cpbench.guards: figures that cannot be what they claim
        lines += ["", "Flagged (never a winner in report --best):",
                  *(f"  {f}" for f in d["flags"])]
    if record.get("check"):
        lines += ["", "Check against the float64 reference:"]
        lines += ["  " + Comparison(**c).line() for c in record["check"]]
        checked = {c["tensor"] for c in record["check"]}
        lines += [f"  {n:>4}: not returned by {record['config']['strategy']}, not checked"
                  for n in TENSORS if n not in checked]
    if record.get("balance"):
        lines += ["", *_balance_lines(record)]
    if record.get("profile"):  # run --profile: where the profiled step's time went
        lines += ["", *detail_lines(record["profile"])]
    lines.append("=" * _RULE)
    return "\n".join(lines) + "\n"


def _configuration(record: dict) -> list[str]:
    cfg, topo = record["config"], record["topology"]
    a, run = cfg["attention"], cfg["run"]
    opts = ", ".join(f"{k}={v}" for k, v in cfg["options"].items()) or "none"
    resolved = record.get("resolved")
    if resolved and resolved != cfg["options"]:
        opts += f" (resolved: {', '.join(f'{k}={option_text(v)}' for k, v in resolved.items())})"
    lines = [f"  - Dtype: {a['dtype']}", "  - QKV Format: bshd",
             f"  - Batch Size: {a['batch']}", f"  - Sequence Length: {a['seqlen']}",
             f"  - Num Heads: {a['heads']}", f"  - Num KV Heads: {a['kv_heads'] or a['heads']}",
             f"  - Head Dimension: {head_dim_text(a)}"
             + (" (Q and K / V)" if a.get("v_head_dim") is not None else ""),
             f"  - Attention Mask: {mask_text(a)}",
             f"  - Window Size: {window_text(a)}",
             f"  - Context Parallel: {record['ranks_per_problem'] > 1}",
             f"  - World Size: {topo['world_size']} ({topo['num_nodes']} node(s) × "
             f"{topo['ranks_per_node']} ranks)",
             f"  - Strategy Options: {opts}"]
    pad = record.get("padding")
    if pad:  # --document-padding pad: what this strategy's layout added
        lines.append(f"  - Document Padding: {pad['padded_tokens']} tokens "
                     f"({100 * pad['fraction']:.2f} % of {pad['padded_seqlen']}; documents "
                     f"to multiples of {pad['document_multiple']}, the sequence of "
                     f"{pad['sequence_multiple']})")
    packing = record.get("packing")
    if packing:
        lines.append(f"  - Packing: {packing['index']} of {packing['count']} "
                     f"({packing['documents']}, seed {packing['seed']})")
    up = record.get("upstream")
    if up:
        lines.append(f"  - Upstream: {', '.join(f'{k} {v}' for k, v in up.items())}")
    threads = (record.get("env") or {}).get("launcher") == "threads"
    iterations = "none timed (one untimed step; ranks as threads)" if threads else \
        f"{run['iters']} timed after {_warmup_text(record)} (median of the slowest rank)"
    synced = (record.get("derived") or {}).get("step_synced")
    return lines + [f"  - Kernel: {record['kernel']} on {run['device']}",
                    f"  - Iterations: {iterations}" + (f"; {synced}" if synced else "")]


def _warmup_text(record: dict) -> str:
    """The warm-up steps run, and whether the step time had settled (``bench.timer``)."""
    timing, run = record.get("timing"), record["config"]["run"]
    if not timing:
        return f"{run['warmup']} warm-up"
    if timing["warmup"] == 0:
        return "no warm-up"
    how = "settled" if timing["settled"] else "not settled: its last 3 steps still " \
        "differed by more than 10 %"
    return f"{timing['warmup']} warm-up ({how})"


def _performance(record: dict, d: dict) -> list[str]:
    status = record["status"]
    if status != OK:
        label = "OOM" if status == OOM else "failed"
        fwd = label if d.get("fwd_ms") is None else f"{cells.ms(d['fwd_ms'])} ms"
        lines = [f"  - Forward Time: {fwd}", f"  - Forward+Backward Time: {label}",
                 f"  - Performance: {label}"]
        if status == FAILED or record.get("error"):
            lines.append(f"  - Error: {record.get('error')}")
        return lines
    if d.get("not_measured") and d.get("fwd_ms") is None:  # ranks as threads: none timed
        return [f"  - Times and memory: - ({d['not_measured']})"]
    lines = [f"  - Forward Time: {cells.ms(d['fwd_ms'])} ms"]
    if d.get("fwd_bwd_ms") is not None:
        lines += [f"  - Backward Time: {cells.ms(d['bwd_ms'])} ms",
                  f"  - Forward+Backward Time: {cells.ms(d['fwd_bwd_ms'])} ms"]
    lines.append(f"  - Memory Usage: {_memory_text(record, d)}")
    if guards.withheld_reason(d):  # guards.withhold: no CP figure for such a row
        why = "does not measure CP" if d.get("not_measured") else "flagged, below"
        lines.append(f"  - Performance, Slowest Rank: - (not quoted: the row {why})")
    elif d.get("fwd_bwd_ms") is None:
        lines += [f"  - Performance: {cells.tflops(d['fwd_tflops'])} TFLOPs/s (forward)",
                  f"  - Slowest Rank: {d['slowest_rank_fwd']}"]
    else:
        lines += [f"  - Performance: {cells.tflops(d['fwd_bwd_tflops'])} TFLOPs/s (forward "
                  f"{cells.tflops(d['fwd_tflops'])}, backward "
                  f"{cells.tflops(d.get('bwd_tflops'))})",
                  f"  - Slowest Rank: {d['slowest_rank_fwd_bwd']}"]
    return lines + _ideal_lines(record, d)


def _revised(est: dict) -> str:
    """"; 35 s re-estimated after the cases before it, took 30 s" (``bench.eta``)."""
    if est.get("took_s") is None:
        return ""
    return (f"; {duration(est['revised_s'])} re-estimated after the cases before it, took "
            f"{duration(est['took_s'])}")


def _ideal_lines(record: dict, d: dict) -> list[str]:
    ideal = record.get("ideal")
    est = record.get("estimate")
    # the probe's TFLOP/s was read on the same machine: not quoted where the row's are not
    quiet = d.get("not_measured") or guards.withheld_reason(d)
    lines = [f"  - Estimated Beforehand: {duration(est['step_s'])} a step, "
             f"{duration(est['case_s'])} for the case" + _revised(est)
             + ("" if quiet else f" ({est['probe']})")] if est else []
    if d.get("not_measured"):  # guards.not_measured: no fraction of ideal, no efficiency
        return lines + [f"  - Not Measuring CP: {d['not_measured']}"]
    if not ideal:
        return lines
    if ideal.get("none"):
        return lines + [f"  - Fraction of Ideal: - ({ideal['none']})"]
    if guards.withheld_reason(d):
        return lines + ["  - Fraction of Ideal: - (not quoted: the row is flagged, below)"]
    if d.get("ideal_superseded"):
        return lines + [f"  - Fraction of Ideal: - ({d['ideal_superseded']})"]
    return lines + [f"  - Fraction of Ideal: {_pct_cell(d.get('fraction_of_ideal'))} ("
                    f"{ideal.get('what')}: {cells.ms(ideal['fwd_ms'] + (ideal.get('bwd_ms') or 0))}"
                    f" ms)"]


def _balance_lines(record: dict) -> list[str]:
    """Attended area per rank (from the layout and the mask) beside each rank's measured
    median step time, and per ring step where the strategy has steps."""
    bal = record["balance"]
    samples = (record.get("samples_ms") or {})
    timed = samples.get("fwd_bwd") or samples.get("fwd")
    what = "FWD+BWD" if samples.get("fwd_bwd") else "FWD"
    lines = [f"Load balance (attended pairs per rank; imbalance = max / mean = "
             f"{bal['imbalance']:.2f}):"]
    for r, area in enumerate(bal["area_per_rank"]):
        line = f"  rank {r}: {area:,} pairs"
        if timed and r < len(timed):
            line += f", {what} median {statistics.median(timed[r]):.2f} ms"
        if bal.get("area_per_step"):
            line += f"; per ring step: {', '.join(f'{a:,}' for a in bal['area_per_step'][r])}"
        lines.append(line)
    return lines


def _memory_text(record: dict, d: dict) -> str:
    if d.get("memory_mb") is not None:
        return f"{cells.ms(d['memory_mb'])} MB"
    if record.get("memory_status") in (OOM, FAILED):
        return f"{record['memory_status']} ({record.get('memory_error')})"
    return "- MB"
