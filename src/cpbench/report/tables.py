"""The tables users know from the seeds, rendered from records.

- ``summary``: seed 001's table — Dtype | QKV Format | B | Seq Len | CP | Window | FWD (ms) |
  FWD+BWD (ms) | Memory (MB) | TFLOPs/s — with Strategy, Placement (the options that set a row
  apart), World and Nodes×GPUs added (and Check when one ran), then the CP efficiency of
  every CP row against the no-CP baseline of the same problem. An OOM row prints OOM in its
  time *and* TFLOPs columns (seed 001 printed OOM beside a measured time; we never do),
  except a FWD time measured before the FWD+BWD step ran out of memory. A memory
  measurement that failed or ran out of memory prints as such in Memory (MB) alone: the
  row's timings stand.
- ``detail`` (``report.detail``): seed 000's "Benchmark Results for …" block, one per case.
- markdown / csv / json: the same rows (with the CP efficiency as a column).

Rows are built with pandas from ``report.dataframe`` (every figure derived from the raw
samples); the efficiency joins each CP row to its baseline on the problem's columns.

"Window" is the attention's sliding window as the seeds print it (flash-attn's
``window_size``; None without ``--window-size``; double-ring's ``--window``, its inner ring
size, shows under Placement). With ``--documents`` a Documents column (count, longest) and
Padding (pad tokens' share of the padded sequence: ``--document-padding``), and wherever a
record holds its ``balance`` an Imbalance column: max / mean attended area over ranks, from
the layout and the mask. TFLOPs/s is per GPU for FWD+BWD (FWD alone with --fwd-only); every
figure is recomputed from the record's raw samples by ``cpbench.results.derive``. Where the
ranks are CPU processes, headers say ranks, not GPUs (``labels.rank_unit``).

The table format fits the terminal (``report.render``): the problem columns every row shares
go to a line above the table, Flags become numbered notes under it (one per kind of note),
columns "-" in every row go, and the least essential columns (Fraction of Ideal, Exposed
Comm, Padding) are hidden only when the table is still too wide, never CP or Imbalance;
``--wide`` prints every column.
"""

from __future__ import annotations

import io
import json

from cpbench import guards, rounds
from cpbench.config import FORMATS
from cpbench.report import cells, packings
from cpbench.report.cells import cell_ms
from cpbench.report.dataframe import baseline_drift, frame
from cpbench.report.detail import detail
from cpbench.report.labels import rank_unit, row_label
from cpbench.report.lines import outcome_line
from cpbench.report.render import Fit, prose, render
from cpbench.results import OK

__all__ = ["FORMATS", "cell_ms", "detail", "render", "report", "rows", "summary"]

# what the narrow table may do with the summary's columns (report.render.Fit)
PROBLEM_COLUMNS = ("Dtype", "QKV Format", "B", "Seq Len", "Head Dim", "World", "Nodes×GPUs",
                   "CP", "Window", "Packing", "Documents", "Source")
# the columns hidden first when a table is still too wide; CP and Imbalance carry a verdict
# (whether a row is CP, how evenly its ranks work) and are never hidden: a label wraps first
OPTIONAL_COLUMNS = ("Fraction of Ideal (%)", "Exposed Comm (%)", "Padding (%)", "QKV Format",
                    "World", "Window")
SHORT = {"Memory (MB)": "Mem (MB)", "Fraction of Ideal (%)": "Ideal (%)",
         "Exposed Comm (%)": "Exposed (%)", "Padding (%)": "Pad (%)", "Imbalance": "Imbal",
         "CP Efficiency (%)": "CP Eff (%)"}


def fit(records: list[dict], label: str = "Strategy") -> Fit:
    """How the summary's columns narrow (``report.render``), its words for a rank those of
    the records' devices."""
    unit = rank_unit(records)
    rename = {} if unit == "GPU" else {"Nodes×GPUs": "Nodes×Ranks", "TFLOPs/s": "TFLOP/s/rank"}
    return Fit(lift=PROBLEM_COLUMNS, drop=OPTIONAL_COLUMNS, wrap=(label,), notes=("Flags",),
               short=SHORT, rename=rename, merge=(("Strategy", "Placement"),))


def rows(records: list[dict]) -> list[dict]:
    """Display rows: column title → cell text, in table order (every column: the table
    format narrows them, ``fit``)."""
    df = frame(records)
    with_check = any(r.get("check") for r in records)
    with_profile = df["exposed_comm_pct"].notna().any()
    mixed = df["simulated"].nunique() > 1  # measured and simulated rows side by side
    with_docs = (df["documents"] != "-").any()
    with_dv = (df["v_head_dim"] != df["head_dim"]).any()  # V with its own width (MLA)
    with_balance = df["imbalance"].notna().any()
    with_packings = df["packing"].notna().any()
    common = _common_reason(df)  # one reason for every row: said once, under the table
    with_flags = (df["flags"] != "").any() or (df["not_measured"].notna().any() and not common)
    with_ideal = any(r.get("ideal") for r in records)  # records before it: no column
    out = []
    for row in df.to_dict("records"):
        figures = cells.figures(row)
        out_row = {
            "Strategy": row["strategy"], "Placement": row["options"],
            "Dtype": row["dtype"], "QKV Format": "bshd", "B": str(row["batch"]),
            "Seq Len": str(row["seqlen"]),
            **({"Head Dim": f"{row['head_dim']}/{row['v_head_dim']}"} if with_dv else {}),
            "World": str(row["world"]),
            "Nodes×GPUs": f"{row['nodes']}×{row['ranks_per_node']}",
            "CP": str(row["ranks_per_problem"] > 1),
            "Window": "None" if row["window"] == "(-1, -1)" else row["window"],
            **({"Packing": str(int(row["packing"]))} if with_packings else {}),
            **({"Documents": cells.documents(row["documents"]),
                "Padding (%)": cells.pct(row["padding_fraction"])} if with_docs else {}),
            **({"Imbalance": "-" if cells.missing(row["imbalance"]) else
                f"{row['imbalance']:.2f}"} if with_balance else {}),
            **({"Source": "simulated" if row["simulated"] else "measured"} if mixed else {}),
            **figures,
        }
        if with_profile:  # the profiled step's communication no kernel hides (--profile)
            out_row["Exposed Comm (%)"] = cells.pct(row["exposed_comm_pct"] / 100) \
                if not cells.missing(row["exposed_comm_pct"]) else "-"
        if with_check:
            passed = row["check_passed"]
            out_row["Check"] = "-" if cells.missing(passed) else "PASS" if passed else "FAIL"
        if with_flags:  # the physics guards' (cpbench.guards): the row's figures are suspect
            out_row["Flags"] = "; ".join(x for x in (
                row["flags"], None if common else short_reason(row["not_measured"])) if x) \
                or "-"
        # the ideal over the step (cpbench.ideal): needs no baseline that fits;
        # none where the row's timings do not measure CP (report.dataframe.frame)
        if with_ideal:
            out_row["Fraction of Ideal (%)"] = cells.pct(row["fraction_of_ideal"])
        out_row["CP Efficiency (%)"] = cells.efficiency(row)
        out.append(out_row)
    return out


def short_reason(reason) -> str | None:
    """A row's "not measuring CP" reason as its Flags cell says it."""
    return None if cells.missing(reason) else f"{reason.split(':')[0]}: not CP"


def _common_reason(df) -> str | None:
    """The one reason every measured row's timings do not measure CP, if they share it."""
    reasons = set(df["not_measured"][df["status"] == OK])
    return next(iter(reasons)) if len(reasons) == 1 and None not in reasons and \
        not any(cells.missing(r) for r in reasons) else None


def not_measured_lines(records: list[dict]) -> list[str]:
    """Under the table: why rows' timings do not measure CP (``guards.not_measured``), and
    that their CP figures are not printed (``guards.withhold``)."""
    df = frame(records)
    if df.empty or not df["not_measured"].notna().any():
        return []
    common = _common_reason(df)
    if common:
        return [f"not measuring CP: {common} (every row; TFLOP/s, CP efficiency and fraction "
                f"of ideal not printed)"]
    n = int(df["not_measured"].notna().sum())
    which = "every row" if n == len(df) else f"{n} of {len(df)} rows"
    return [f"not measuring CP: {which} (see Flags): their timings, and every efficiency "
            f"against them, do not measure CP; their TFLOP/s, CP efficiency and fraction of "
            f"ideal not printed"]


def flagged_lines(records: list[dict]) -> list[str]:
    """Under the table: that flagged rows' CP figures are not printed (``guards.withhold``)."""
    df = frame(records)
    n = 0 if df.empty else int((df["flags"] != "").sum())
    return [f"flagged: {n} row{'s' * (n > 1)} (see Flags): {'their' if n > 1 else 'its'} "
            f"TFLOP/s, CP efficiency and fraction of ideal not printed"] if n else []


def _efficiency_lines(records: list[dict]) -> list[str]:
    df = frame(records)
    effs = [] if df.empty else df[df["cp_efficiency"].notna()].to_dict("records")
    if not effs:
        return []
    phases = {e["efficiency_phase"] for e in effs}
    spread = any(not cells.missing(e["cp_efficiency_low"]) for e in effs)
    out = [f"CP efficiency = T_local / (N · T_cp), {' or '.join(sorted(phases))}, against "
           f"{effs[0]['baseline']}"
           + (" (95 % bootstrap interval of the per-iteration samples):" if spread else ":")]
    width = max(len(e["label"]) for e in effs)
    for e in effs:
        low, high = e["cp_efficiency_low"], e["cp_efficiency_high"]
        span = "" if cells.missing(low) else f"  [{100 * low:.1f}, {100 * high:.1f}]"
        out.append(f"  {e['label']:<{width}}  N={int(e['ranks_per_problem']):<3} "
                   f"{100 * e['cp_efficiency']:6.1f} %{span}"
                   + (f"  flagged: {e['efficiency_flag']}"
                      if isinstance(e["efficiency_flag"], str) else ""))
    return out + baseline_drift(records)


def simulated(records: list[dict]) -> tuple[int, str]:
    """How many records are predictions of ``cpbench simulate``, and their presets."""
    sims = [r for r in records if r.get("env", {}).get("simulated")]
    return len(sims), ", ".join(dict.fromkeys(r["env"].get("hardware", "?") for r in sims))


def evidence_lines(records: list[dict]) -> list[str]:
    """What the simulated rows rest on (``simulation.evidence``, per preset): said under any
    table that shows them; a record from before it was stated says so."""
    seen: dict[tuple, str] = {}
    for r in records:
        if r.get("env", {}).get("simulated"):
            sim = r.get("simulation") or {}
            seen.setdefault((r["env"].get("hardware"), sim.get("kernel")),
                            sim.get("evidence") or "not recorded (a record from before "
                                                   "cpbench stated it)")
    return [f"Evidence ({hw}{f', kernel {k}' if k else ''}): {text}."
            for (hw, k), text in seen.items()]


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
        table_rows = [{k: v for k, v in r.items() if k != "CP Efficiency (%)"}
                      for r in rows(records)]
        lines = [f"Benchmark Summary{simulated_note(records)}:",
                 *render(None, table_rows, fmt, fit(records))]
        for extra in (flagged_lines(records) + not_measured_lines(records),
                      _efficiency_lines(records),
                      rounds.drift_lines(records, case_text)):
            lines += ["", *prose(extra)] if extra else []
        lines += prose([f"no dense peak known for {name}: its rows have no above-peak guard"
                        for name in guards.unguarded(records)])
        return "\n".join(lines + packings.lines(records, fmt)) + "\n"
    if fmt == "markdown":
        note = simulated_note(records)
        lines = [f"*Benchmark Summary{note}*", ""] if note else []
        under = flagged_lines(records) + not_measured_lines(records)
        return "\n".join(lines + render(None, rows(records), "markdown", fit(records))
                         + (["", *under] if under else []) + packings.lines(records, fmt)) + "\n"
    data = _data(records)
    if fmt == "json":
        records_out = [{k: (None if cells.missing(v) else v) for k, v in row.items()}
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
            "kv_heads", "head_dim", "v_head_dim", "causal", "documents", "window", "world", "nodes",
            "gpus_per_node", "cp", "kernel", "status", "fwd_ms", "bwd_ms", "fwd_bwd_ms",
            "memory_mb", "tflops", "imbalance", "padded_tokens", "padding_fraction",
            "packing", "documents_spec", "check",
            "cp_efficiency", "cp_efficiency_low", "cp_efficiency_high", "fraction_of_ideal",
            "exposed_comm_pct",
            "exposed_comm_ms", "flags", "not_measured", "error", "memory_status",
            "memory_error"]
    return df[cols]


def report(records: list[dict], fmt: str = "table", details: bool = False) -> str:
    """What ``cpbench run`` printed for these records: the summary and the run in a line,
    after each case's detail block with ``details`` (table format); the summary rows alone
    in the other formats."""
    if fmt != "table":
        return summary(records, fmt)
    # a prediction has no run to detail (iterations, hosts, checks): its row says it all
    measured = [r for r in records if not r.get("env", {}).get("simulated")] if details else []
    # the outcome line folded here, as every line of the summary: the run prints this text
    return "".join(detail(r) + "\n" for r in measured) + summary(records, fmt) + \
        "".join(f"{line}\n" for line in prose([outcome_line(records)]))
