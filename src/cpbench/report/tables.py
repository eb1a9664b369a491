"""The tables users know from the seeds, rendered from records.

- ``summary``: seed 001's table — Dtype | QKV Format | B | Seq Len | CP | Window | FWD (ms) |
  FWD+BWD (ms) | Memory (MB) | TFLOPs/s — with Strategy, Placement (the options that set a row
  apart), World and Nodes×GPUs added (and Check when one ran), then the CP efficiency of
  every CP row against the no-CP baseline of the same problem. An OOM row prints OOM in its
  time *and* TFLOPs columns (seed 001 printed OOM beside a measured time; we never do),
  except a FWD time measured before the FWD+BWD step ran out of memory. A memory
  measurement that failed or ran out of memory prints as such in Memory (MB) alone: the
  row's timings stand.
- ``detail``: seed 000's "Benchmark Results for …" block (Configuration, Performance), without
  its FlashAttention Kernel % lines (a profiler ratio that was not what it said).
- markdown / csv / json: the same rows (with the CP efficiency as a column).

Rows are built with pandas from ``report.dataframe`` (every figure derived from the raw
samples); the efficiency joins each CP row to its baseline on the problem's columns.

"Window" is the attention's sliding window as the seeds print it (flash-attn's
``window_size``; None without ``--window-size``; double-ring's ``--window``, its inner ring
size, shows under Placement). With ``--documents`` a Documents column (count, longest) and
Padding (pad tokens' share of the padded sequence: ``--document-padding``), and wherever a
record holds its ``balance`` an Imbalance column: max / mean attended area over ranks, from
the layout and the mask. TFLOPs/s is per GPU for FWD+BWD (FWD alone with --fwd-only); every
figure is recomputed from the record's raw samples by ``cpbench.results.derive``.
"""

from __future__ import annotations

import io
import json
import math
import statistics

from cpbench import guards, rounds
from cpbench.config import FORMATS
from cpbench.metrics import duration
from cpbench.profile.summary import detail_lines
from cpbench.reference import TENSORS, Comparison
from cpbench.report import packings
from cpbench.report.dataframe import baseline_drift, frame
from cpbench.report.labels import mask_text, option_text, row_label, window_text
from cpbench.results import FAILED, OK, OOM, derive

_RULE = 50


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))  # pandas' NaN too


def _ms(x) -> str:
    return "-" if _missing(x) else f"{x:.2f}"


def cell_ms(value, record: dict) -> str:
    """A time cell: the figure, or the row's status (OOM, failed) where none was measured."""
    return record["status"] if _missing(value) and record["status"] != OK else _ms(value)


def _tflops(x) -> str:
    if _missing(x):
        return "-"
    return f"{x:.2f}" if abs(x) >= 1 else f"{x:.3g}"  # CPU rates are fractions of a TFLOP


def rows(records: list[dict]) -> list[dict]:
    """Display rows: column title → cell text, in table order."""
    df = frame(records)
    with_check = any(r.get("check") for r in records)
    with_profile = df["exposed_comm_pct"].notna().any()
    mixed = df["simulated"].nunique() > 1  # measured and simulated rows side by side
    with_docs = (df["documents"] != "-").any()
    with_balance = df["imbalance"].notna().any()
    with_packings = df["packing"].notna().any()
    common = _common_reason(df)  # one reason for every row: said once, under the table
    with_flags = (df["flags"] != "").any() or (df["not_measured"].notna().any() and not common)
    with_ideal = any(r.get("ideal") for r in records)  # records before it: no column
    out = []
    for row in df.to_dict("records"):
        status = row["status"]
        # a time that was measured shows; OOM / failed in every other time column and TFLOPs
        fwd = status if _missing(row["fwd_ms"]) else _ms(row["fwd_ms"])
        both = "-" if row["fwd_only"] else \
            status if _missing(row["fwd_bwd_ms"]) else _ms(row["fwd_bwd_ms"])
        tf = status if status != OK else \
            _tflops(row["fwd_tflops"] if row["fwd_only"] else row["fwd_bwd_tflops"])
        mem = _memory_cell(row["memory_mb"], row["memory_status"])
        cells = {
            "Strategy": row["strategy"], "Placement": row["options"],
            "Dtype": row["dtype"], "QKV Format": "bshd", "B": str(row["batch"]),
            "Seq Len": str(row["seqlen"]), "World": str(row["world"]),
            "Nodes×GPUs": f"{row['nodes']}×{row['ranks_per_node']}",
            "CP": str(row["ranks_per_problem"] > 1),
            "Window": "None" if row["window"] == "(-1, -1)" else row["window"],
            **({"Packing": str(int(row["packing"]))} if with_packings else {}),
            **({"Documents": _docs_cell(row["documents"]),
                "Padding": _padding_cell(row["padding_fraction"])} if with_docs else {}),
            **({"Imbalance": "-" if _missing(row["imbalance"]) else
                f"{row['imbalance']:.2f}"} if with_balance else {}),
            **({"Source": "simulated" if row["simulated"] else "measured"} if mixed else {}),
            "FWD (ms)": fwd, "FWD+BWD (ms)": both, "Memory (MB)": mem, "TFLOPs/s": tf,
        }
        if with_profile:  # the profiled step's communication no kernel hides (--profile)
            cells["Exposed Comm"] = "-" if _missing(row["exposed_comm_pct"]) else \
                f"{row['exposed_comm_pct']:.1f} %"
        if with_check:
            passed = row["check_passed"]
            cells["Check"] = "-" if _missing(passed) else "PASS" if passed else "FAIL"
        if with_flags:  # the physics guards' (cpbench.guards): the row's figures are suspect
            cells["Flags"] = "; ".join(x for x in (
                row["flags"], None if common else _short(row["not_measured"])) if x) or "-"
        # the kernel blocks alone over the step (bench.ideal): needs no baseline that fits
        if with_ideal:
            cells["Fraction of Ideal"] = _pct_cell(row["fraction_of_ideal"])
        cells["CP Efficiency"] = ("-" if _missing(row["cp_efficiency"]) else
                                  f"{100 * row['cp_efficiency']:.1f} % "
                                  f"[{_pct(row['cp_efficiency_low'])}, "
                                  f"{_pct(row['cp_efficiency_high'])}]")
        out.append(cells)
    return out


def _short(reason) -> str | None:
    """A row's "not measuring CP" reason as its Flags cell says it."""
    return None if _missing(reason) else f"{reason.split(':')[0]}: not CP"


def _common_reason(df) -> str | None:
    """The one reason every measured row's timings do not measure CP, if they share it."""
    reasons = set(df["not_measured"][df["status"] == OK])
    return next(iter(reasons)) if len(reasons) == 1 and None not in reasons and \
        not any(_missing(r) for r in reasons) else None


def not_measured_lines(records: list[dict]) -> list[str]:
    """Under the table: why rows' timings do not measure CP (``guards.not_measured``), and
    that their CP efficiency and fraction of ideal are not printed."""
    df = frame(records)
    if df.empty or not df["not_measured"].notna().any():
        return []
    common = _common_reason(df)
    if common:
        return [f"not measuring CP: {common} (every row; CP efficiency and fraction of ideal "
                f"not printed)"]
    n = int(df["not_measured"].notna().sum())
    which = "every row" if n == len(df) else f"{n} of {len(df)} rows"
    return [f"not measuring CP: {which} (see Flags): their timings, and every efficiency "
            f"against them, do not measure CP; CP efficiency and fraction of ideal not printed"]


def _docs_cell(documents: str) -> str:
    if documents == "-":
        return "-"
    lengths = [int(x) for x in documents.split(",")]
    return f"{len(lengths)} (max {max(lengths)})"


def _padding_cell(fraction) -> str:
    """The pad tokens' share of the padded sequence (--document-padding pad)."""
    return "-" if _missing(fraction) else f"{100 * fraction:.2f} %"


def _pct_cell(x) -> str:
    return "-" if _missing(x) else f"{100 * x:.1f} %"


def _pct(x) -> str:
    return "-" if _missing(x) else f"{100 * x:.1f}"


def _memory_cell(memory_mb, memory_status) -> str:
    if not _missing(memory_mb):
        return _ms(memory_mb)
    return memory_status if memory_status in (OOM, FAILED) else "-"


def render(title: str | None, table_rows: list[dict], fmt: str) -> list[str]:
    """A table under an optional ``### title``: seed 001's layout, or markdown."""
    out = [f"### {title}"] if title else []
    if fmt == "markdown":
        cols = list(table_rows[0])
        out += ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        out += ["| " + " | ".join(r[c] for c in cols) + " |" for r in table_rows]
    else:
        out += _seed_table(table_rows)
    return out


def _seed_table(table_rows: list[dict]) -> list[str]:
    """Seed 001's layout: centred cells between '|', '=' rules around, '-' under the header."""
    cols = list(table_rows[0])
    widths = [max(len(c), *(len(r[c]) for r in table_rows)) + 2 for c in cols]

    def line(cells):
        return "|".join(str(cell).center(w) for cell, w in zip(cells, widths)).rstrip()

    total = sum(widths) + len(widths) - 1
    out = ["=" * total, line(cols), "-" * total]
    out += [line(r[c] for c in cols) for r in table_rows]
    out.append("=" * total)
    return out


def _efficiency_lines(records: list[dict]) -> list[str]:
    df = frame(records)
    effs = [] if df.empty else df[df["cp_efficiency"].notna()].to_dict("records")
    if not effs:
        return []
    phases = {e["efficiency_phase"] for e in effs}
    out = [f"CP efficiency = T_local / (N · T_cp), {' or '.join(sorted(phases))}, against "
           f"{effs[0]['baseline']} (95 % bootstrap interval of the per-iteration samples):"]
    width = max(len(e["label"]) for e in effs)
    for e in effs:
        low, high = e["cp_efficiency_low"], e["cp_efficiency_high"]
        span = "" if _missing(low) else f"  [{100 * low:.1f}, {100 * high:.1f}]"
        out.append(f"  {e['label']:<{width}}  N={int(e['ranks_per_problem']):<3} "
                   f"{100 * e['cp_efficiency']:6.1f} %{span}"
                   + (f"  flagged: {e['efficiency_flag']}"
                      if isinstance(e["efficiency_flag"], str) else ""))
    return out + baseline_drift(records)


def simulated(records: list[dict]) -> tuple[int, str]:
    """How many records are predictions of ``cpbench simulate``, and their presets."""
    sims = [r for r in records if r.get("env", {}).get("simulated")]
    return len(sims), ", ".join(dict.fromkeys(r["env"].get("hardware", "?") for r in sims))


def simulated_note(records: list[dict]) -> str:
    """" (simulated on <preset>, not measured)" when every record is a prediction; " (N of M
    rows simulated: Source column)" when some are; "" when none are."""
    n, hardware = simulated(records)
    if not n:
        return ""
    if n < len(records):
        return f" ({n} of {len(records)} rows simulated, not measured: see Source)"
    return f" (simulated on {hardware}, not measured)"


def case_text(record: dict) -> str:
    """A case in a line of text: its row, sequence length and packing."""
    packing = (record.get("packing") or {}).get("index")
    return f"{row_label(record)} S={record['config']['attention']['seqlen']}" + \
        ("" if packing is None else f" packing {packing}")


def summary(records: list[dict], fmt: str = "table") -> str:
    """The summary of ``records`` in ``fmt`` (table, markdown, csv or json)."""
    if not records:
        return "no records\n"
    records = rounds.pool(records)  # --rounds K: a case's rounds are one row
    if fmt == "table":
        table_rows = [{k: v for k, v in r.items() if k != "CP Efficiency"} for r in rows(records)]
        lines = [f"Benchmark Summary{simulated_note(records)}:", *_seed_table(table_rows)]
        for extra in (not_measured_lines(records), _efficiency_lines(records),
                      rounds.drift_lines(records, case_text)):
            lines += ["", *extra] if extra else []
        lines += [f"no dense peak known for {name}: its rows have no above-peak guard"
                  for name in guards.unguarded(records)]
        return "\n".join(lines + packings.lines(records, fmt)) + "\n"
    if fmt == "markdown":
        note = simulated_note(records)
        lines = [f"*Benchmark Summary{note}*", ""] if note else []
        under = not_measured_lines(records)
        return "\n".join(lines + render(None, rows(records), "markdown")
                         + (["", *under] if under else []) + packings.lines(records, fmt)) + "\n"
    data = _data(records)
    if fmt == "json":
        records_out = [{k: (None if _missing(v) else v) for k, v in row.items()}
                       for row in data.to_dict("records")]
        return json.dumps(records_out, indent=1) + "\n"
    if fmt == "csv":
        buf = io.StringIO()
        data.to_csv(buf, index=False)
        return buf.getvalue()
    raise ValueError(f"unknown format {fmt!r}; choose one of: {', '.join(FORMATS)}")


def _data(records: list[dict]):
    """Machine-readable rows: numbers as numbers, status in its own column."""
    df = frame(records).rename(columns={"options": "placement", "ranks_per_node": "gpus_per_node",
                                        "check_passed": "check"})
    df["qkv_format"] = "bshd"
    df["cp"] = df["ranks_per_problem"] > 1
    df["tflops"] = df["fwd_tflops"].where(df["fwd_only"], df["fwd_bwd_tflops"])
    cols = ["strategy", "placement", "dtype", "qkv_format", "batch", "seqlen", "heads",
            "kv_heads", "head_dim", "causal", "documents", "window", "world", "nodes",
            "gpus_per_node", "cp", "kernel", "status", "fwd_ms", "bwd_ms", "fwd_bwd_ms",
            "memory_mb", "tflops", "imbalance", "padded_tokens", "padding_fraction",
            "packing", "documents_spec", "check",
            "cp_efficiency", "cp_efficiency_low", "cp_efficiency_high", "fraction_of_ideal",
            "exposed_comm_pct",
            "exposed_comm_ms", "flags", "not_measured", "error", "memory_status",
            "memory_error"]
    return df[cols]


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
             f"  - Head Dimension: {a['head_dim']}",
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
    return lines + [f"  - Kernel: {record['kernel']} on {run['device']}",
                    f"  - Iterations: {run['iters']} timed after {_warmup_text(record)} "
                    f"(median of the slowest rank)"]


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
        fwd = label if d.get("fwd_ms") is None else f"{_ms(d['fwd_ms'])} ms"
        lines = [f"  - Forward Time: {fwd}", f"  - Forward+Backward Time: {label}",
                 f"  - Performance: {label}"]
        if status == FAILED or record.get("error"):
            lines.append(f"  - Error: {record.get('error')}")
        return lines
    lines = [f"  - Forward Time: {_ms(d['fwd_ms'])} ms"]
    if d.get("fwd_bwd_ms") is None:
        return lines + [f"  - Memory Usage: {_memory_text(record, d)}",
                        f"  - Performance: {_tflops(d['fwd_tflops'])} TFLOPs/s (forward)",
                        f"  - Slowest Rank: {d['slowest_rank_fwd']}", *_ideal_lines(record, d)]
    return lines + [f"  - Backward Time: {_ms(d['bwd_ms'])} ms",
                    f"  - Forward+Backward Time: {_ms(d['fwd_bwd_ms'])} ms",
                    f"  - Memory Usage: {_memory_text(record, d)}",
                    f"  - Performance: {_tflops(d['fwd_bwd_tflops'])} TFLOPs/s (forward "
                    f"{_tflops(d['fwd_tflops'])}, backward {_tflops(d['bwd_tflops'])})",
                    f"  - Slowest Rank: {d['slowest_rank_fwd_bwd']}",
                    *_ideal_lines(record, d)]


def _ideal_lines(record: dict, d: dict) -> list[str]:
    ideal = record.get("ideal")
    est = record.get("estimate")
    lines = [f"  - Estimated Beforehand: {duration(est['step_s'])} a step, "
             f"{duration(est['case_s'])} for the case ({est['probe']})"] if est else []
    if d.get("not_measured"):  # guards.not_measured: no fraction of ideal, no efficiency
        return lines + [f"  - Not Measuring CP: {d['not_measured']}"]
    if not ideal:
        return lines
    if ideal.get("none"):
        return lines + [f"  - Fraction of Ideal: - ({ideal['none']})"]
    return lines + [f"  - Fraction of Ideal: {_pct_cell(d.get('fraction_of_ideal'))} (rank "
            f"{ideal['rank']}'s {len(ideal['blocks'])} distinct kernel block(s) timed alone: "
            f"{_ms(ideal['fwd_ms'] + (ideal.get('bwd_ms') or 0))} ms)"]


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
        return f"{_ms(d['memory_mb'])} MB"
    if record.get("memory_status") in (OOM, FAILED):
        return f"{record['memory_status']} ({record.get('memory_error')})"
    return "- MB"


def report(records: list[dict], fmt: str = "table") -> str:
    """What ``cpbench run`` printed for these records: each detail block, then the summary
    (table format); the summary rows alone in the other formats."""
    if fmt != "table":
        return summary(records, fmt)
    # a prediction has no run to detail (iterations, hosts, checks): its row says it all
    measured = [r for r in records if not r.get("env", {}).get("simulated")]
    return "".join(detail(r) + "\n" for r in measured) + summary(records, fmt)
