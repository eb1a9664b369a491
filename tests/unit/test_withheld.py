"""One rule for every printer (``guards.withhold``): a row that does not measure CP, or is
flagged, keeps its times and memory and prints no TFLOP/s, fraction of ideal, CP efficiency or
slowest rank, in the run's table and lines, ``--details``, markdown, csv, json, the sweep
views and ``report --best``; the record keeps those figures under ``derived.withheld``."""

from __future__ import annotations

import csv
import io
import json

from test_results import fake_record

from cpbench import report, results
from cpbench.report import lines, placements, sweep, tables
from cpbench.report.best import best_table

BUSY = {"foreign_cpu_s": 17.0, "wall_s": 10.0, "cpus": 2, "share": 0.85, "ranks_cores": 2}
IDEAL = {"definition": "share", "times": 4, "fwd_ms": 8.0, "bwd_ms": 16.0,
         "what": "the kernel alone on each GPU's share"}


def _row(strategy: str, load: dict | None, **kw) -> dict:
    """A CP row (S=1024, 4 ranks) with its kernel blocks timed alone, under ``load``."""
    rec = fake_record(strategy, **kw)
    rec.update(ideal=IDEAL, load=load)
    rec["derived"] = results.derive(rec)
    return rec


def _runs(load: dict | None) -> list[dict]:
    base = fake_record("local", ranks_per_problem=1, fwd=[[30.0, 31.0, 32.0]] * 4,
                       fwd_bwd=[[100.0, 101.0, 99.0]] * 4)
    base["load"] = load
    base["derived"] = results.derive(base)
    return [base, _row("zigzag", load), _row("ring", load, fwd_bwd=[[40.0, 41.0, 42.0]] * 4)]


def test_the_record_keeps_times_and_marks_the_cp_figures():
    idle, busy = _row("zigzag", None)["derived"], _row("zigzag", BUSY)["derived"]
    assert idle["not_measured"] is None and "withheld" not in idle
    assert busy["not_measured"].startswith("others kept 1.7 of 2 cores busy")
    # the times as measured; the CP figures moved under the mark, the same values
    assert busy["fwd_bwd_ms"] == idle["fwd_bwd_ms"] == 31.0
    for key in ("fwd_tflops", "fwd_bwd_tflops", "fraction_of_ideal", "slowest_rank_fwd_bwd"):
        assert key not in busy and busy["withheld"][key] == idle[key]
    assert busy["withheld"]["fraction_of_ideal"] == 24.0 / 31.0  # ideal 8 + 16 over 31 ms


def test_every_table_prints_no_cp_figure_for_a_busy_run():
    idle, busy = _runs(None), _runs(BUSY)
    shown = {r["Strategy"]: r for r in tables.rows(idle)}
    assert shown["zigzag"]["TFLOPs/s"] != "-" and shown["zigzag"]["Fraction of Ideal (%)"] \
        == "77.4" and shown["zigzag"]["CP Efficiency (%)"] != "-"
    for r in tables.rows(busy):
        assert r["TFLOPs/s"] == r["CP Efficiency (%)"] == "-", r
        assert r.get("Fraction of Ideal (%)", "-") == "-", r
    text = report.summary(busy)
    assert "31.00" in text and "77.4" not in text and "TFLOP/s, CP efficiency" in text
    md = report.summary(busy, "markdown")
    assert "31.00" in md and "77.4" not in md
    for row in csv.DictReader(io.StringIO(report.summary(busy, "csv"))):
        assert row["tflops"] == row["fraction_of_ideal"] == row["cp_efficiency"] == ""
        assert float(row["fwd_bwd_ms"]) > 0 and row["not_measured"]
    for row in json.loads(report.summary(busy, "json")):
        assert row["tflops"] is row["fraction_of_ideal"] is row["cp_efficiency"] is None
    pivot = sweep.pivot(busy)
    assert "TFLOP" in pivot and "0.0" not in pivot.split("FWD+BWD (ms)")[0]


def test_details_and_case_lines_quote_no_cp_figure():
    zigzag = _runs(BUSY)[1]
    text = report.detail(zigzag)
    assert "Forward+Backward Time: 31.00 ms" in text
    assert "TFLOPs/s" not in text and "Slowest Rank: 0" not in text and "77.4" not in text
    assert "Performance, Slowest Rank: - (not quoted: the row does not measure CP)" in text
    idle = report.detail(_runs(None)[1])
    assert "TFLOPs/s (forward" in idle and "Fraction of Ideal: 77.4 %" in idle
    line = lines.case_line(zigzag, 2.0)
    assert "FWD+BWD 31.00 ms" in line and "TFLOP" not in line
    # the estimate's probe rate was read on the same busy machine: not quoted either
    probe = {"step_s": 0.1, "case_s": 6.1, "probe": "sdpa-cpu at 0.0788 / 0.0781 TFLOP/s fwd / bwd"}
    busy_text = report.detail({**zigzag, "estimate": probe})
    assert "Estimated Beforehand: 100 ms a step, 6.1 s for the case" in busy_text
    assert "TFLOP" not in busy_text
    assert "0.0788 / 0.0781 TFLOP/s" in report.detail({**_runs(None)[1], "estimate": probe})


def test_a_flagged_row_withholds_its_cp_figures_too():
    # FWD 62.7 ms above its FWD+BWD 35.06 ms: impossible, its rate not printed
    bad = fake_record("zigzag", samples={"fwd": [[62.7] * 3] * 4, "fwd_bwd": [[35.06] * 3] * 4})
    assert bad["derived"]["withheld"]["fwd_bwd_tflops"] > 0
    (row,) = tables.rows([bad])
    assert row["TFLOPs/s"] == "-" and row["FWD+BWD (ms)"] == "35.06"
    assert "flagged, below" in report.detail(bad)


def test_best_and_placement_ratios_leave_withheld_rows_out():
    busy = _runs(BUSY)
    assert "not ranked: zigzag" in best_table(busy) and "not ranked: ring" in best_table(busy)
    usp = [fake_record("usp", options={"placement": p}) for p in ("head-first", "ring-first")]
    for r in usp:
        r["load"] = BUSY
        r["derived"] = results.derive(r)
    text = placements.placement_view(usp)
    assert "none: flagged or not CP" in text and " % [" not in text  # no margin of them
