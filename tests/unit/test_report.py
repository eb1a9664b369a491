"""Seed-format tables from records: columns, OOM / failed rows, CP efficiency, formats."""

import io
import json
import re

import pandas as pd
import pytest
from test_results import fake_record

from cpbench import report
from cpbench.report.render import WIDE, fitting

# seed 001's columns, TFLOPs/s per rank as CPU ranks are not GPUs (the records here are CPU's)
SEED_COLUMNS = ["Dtype", "QKV Format", "B", "Seq Len", "CP", "Window", "FWD (ms)",
                "FWD+BWD (ms)", "Memory (MB)", "TFLOP/s/rank"]


@pytest.fixture
def wide():
    """Tables as --wide prints them: seed 001's layout, every column."""
    with fitting(WIDE):
        yield


def _records():
    return [
        fake_record("zigzag"),
        fake_record("megatron-cp", status="OOM", error="rank 1: OutOfMemoryError: CUDA out"),
        fake_record("burst", status="failed", error="rank 0: RuntimeError: boom"),
        fake_record("local", ranks_per_problem=1, fwd=[[20.0, 20.0, 20.0]] * 4,
                    fwd_bwd=[[62.0, 62.0, 62.0]] * 4),
    ]


def _cells(line):
    return [c.strip() for c in line.split("|")]


def test_summary_is_seed_001_with_added_columns(wide):
    text = report.summary(_records())
    lines = text.splitlines()
    assert lines[0] == "Benchmark Summary:"
    assert set(lines[1]) == {"="} and set(lines[3]) == {"-"}
    header = _cells(lines[2])
    assert header[:2] == ["Strategy", "Placement"]
    assert [h for h in header if h in SEED_COLUMNS] == SEED_COLUMNS  # seed order kept
    assert {"World", "Nodes×Ranks"} <= set(header)
    rows = {(_cells(line)[0]): dict(zip(header, _cells(line))) for line in lines[4:8]}
    z = rows["zigzag"]
    assert (z["FWD (ms)"], z["FWD+BWD (ms)"], z["Memory (MB)"]) == ("11.00", "31.00", "1.00")
    assert z["CP"] == "True" and z["Window"] == "None" and z["Nodes×Ranks"] == "2×2"
    assert rows["local"]["CP"] == "False"


def test_oom_row_has_oom_in_every_time_and_tflops_column(wide):
    lines = report.summary(_records()).splitlines()
    header = _cells(lines[2])
    oom = dict(zip(header, _cells(lines[5])))
    assert oom["Strategy"] == "megatron-cp"
    assert [oom[c] for c in ("FWD (ms)", "FWD+BWD (ms)", "TFLOP/s/rank")] == ["OOM"] * 3
    failed = dict(zip(header, _cells(lines[6])))
    assert failed["FWD (ms)"] == failed["TFLOP/s/rank"] == "failed"


def test_cp_efficiency():
    effs = report.efficiencies(_records())
    assert len(effs) == 1
    label, n, base, phase, eff, (low, high) = effs[0]
    assert (label, n, base, phase) == ("zigzag", 4, "local", "FWD+BWD")
    assert eff == pytest.approx(62.0 / (4 * 31.0))
    assert low <= eff <= high  # the bootstrap interval of the per-iteration samples
    text = report.summary(_records())
    assert "CP efficiency = T_local / (N · T_cp)" in text and "50.0 %" in text


def test_efficiency_needs_the_same_problem():
    other = fake_record("local", ranks_per_problem=1, seqlen=2048)
    assert report.efficiencies([fake_record("zigzag"), other]) == []


def test_efficiency_falls_back_to_fwd_when_a_side_has_no_backward():
    recs = [fake_record("zigzag", fwd_only=True),
            fake_record("local", ranks_per_problem=1, fwd=[[44.0] * 3] * 4)]
    (label, n, base, phase, eff, _), = report.efficiencies(recs)
    assert phase == "FWD" and eff == pytest.approx(44.0 / (4 * 11.0))


def test_frame_is_pandas_with_every_figure():
    df = report.frame(_records())
    assert list(df["strategy"]) == ["zigzag", "megatron-cp", "burst", "local"]
    assert df.loc[0, "fwd_bwd_ms"] == 31.0 and df.loc[0, "cp_efficiency"] == pytest.approx(0.5)
    assert pd.isna(df.loc[1, "cp_efficiency"]) and pd.isna(df.loc[3, "cp_efficiency"])


def test_detail_block_like_seed_000():
    text = report.detail(fake_record("zigzag", check=[
        {"tensor": "out", "max_abs": 1e-6, "max_rel": 1e-7, "passed": True}]))
    assert "Benchmark Results for zigzag" in text
    for line in ("  - Sequence Length: 1024", "  - Forward Time: 11.00 ms",
                 "  - Backward Time: 20.00 ms", "  - Forward+Backward Time: 31.00 ms",
                 "  - Memory Usage: 1.00 MB"):
        assert line in text.splitlines()
    assert "Kernel:" in text and "FlashAttention Kernel" not in text and "%" not in text
    assert "PASS" in text
    oom = report.detail(fake_record(status="OOM", error="rank 0: OutOfMemoryError"))
    assert "  - Forward+Backward Time: OOM" in oom.splitlines()


def test_other_formats_have_the_same_rows():
    recs = _records()
    md = report.summary(recs, "markdown").splitlines()
    # Placement is "-" in every row: no column (report.render), as in the terminal's table
    assert md[0].startswith("| Strategy | Dtype") and len(md) == 2 + len(recs)
    assert "| OOM |" in md[3]
    df = pd.read_csv(io.StringIO(report.summary(recs, "csv")))
    assert list(df["strategy"]) == [r["config"]["strategy"] for r in recs]
    assert list(df["status"]) == ["ok", "OOM", "failed", "ok"]
    assert df.loc[0, "fwd_bwd_ms"] == 31.0 and pd.isna(df.loc[1, "fwd_bwd_ms"])
    data = json.loads(report.summary(recs, "json"))
    assert data[0]["cp_efficiency"] == pytest.approx(0.5) and data[1]["tflops"] is None


def test_a_failed_memory_step_keeps_the_row_and_a_measured_fwd_shows(wide):
    recs = [fake_record("ring", memory_status="OOM", memory_error="rank 1: OutOfMemoryError"),
            fake_record("zigzag", status="OOM", error="rank 0: OutOfMemoryError",
                        samples={"fwd": [[10.0, 11.0, 12.0]] * 4, "fwd_bwd": None})]
    lines = report.summary(recs).splitlines()
    header = _cells(lines[2])
    mem, oom = (dict(zip(header, _cells(line))) for line in lines[4:6])
    assert (mem["FWD+BWD (ms)"], mem["Memory (MB)"]) == ("31.00", "OOM")
    assert mem["TFLOP/s/rank"] not in ("OOM", "-")
    assert (oom["FWD (ms)"], oom["FWD+BWD (ms)"], oom["TFLOP/s/rank"]) == ("11.00", "OOM", "OOM")
    assert "  - Memory Usage: OOM (rank 1: OutOfMemoryError)" in report.detail(recs[0])
    assert "  - Forward Time: 11.00 ms" in report.detail(recs[1])
    data = json.loads(report.summary(recs, "json"))
    assert data[0]["memory_status"] == "OOM" and data[0]["memory_mb"] is None


def test_resolved_options_show_in_placement_and_detail(wide):
    rec = fake_record("double-ring", options={"window": 0}, resolved={"window": 2})
    row = dict(zip(_cells(report.summary([rec]).splitlines()[2]),
                   _cells(report.summary([rec]).splitlines()[4])))
    assert row["Placement"] == "window=2"
    assert "  - Strategy Options: window=0 (resolved: window=2)" in report.detail(rec)


def test_fwd_only_rows(wide):
    lines = report.summary([fake_record(fwd_only=True), fake_record("ring")]).splitlines()
    row = dict(zip(_cells(lines[2]), _cells(lines[4])))
    assert row["FWD (ms)"] == "11.00" and row["FWD+BWD (ms)"] == "-"
    assert "nan" not in "\n".join(lines).lower()


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_progress_lines_plain_when_not_a_terminal(tty):
    import logging

    from cpbench.report.console import Progress

    stream = _Stream(tty)
    handler = Progress(stream)
    logger = logging.getLogger(f"cpbench.test.{tty}")
    logger.handlers, logger.propagate, logger.level = [handler], False, logging.INFO
    logger.info("[1/2] ring", extra={"transient": "plain"})
    logger.info("[1/2] ring: timing FWD", extra={"transient": True})
    logger.info("[1/2] ring: done")
    if tty:  # one status line, overwritten in place, then the permanent line
        assert stream.getvalue() == ("\r\033[K[1/2] ring\r\033[K[1/2] ring: timing FWD"
                                     "\r\033[K[1/2] ring: done\n")
    else:
        assert stream.getvalue() == "[1/2] ring\n[1/2] ring: done\n"


@pytest.fixture
def restore_loggers():
    import logging

    loggers = [logging.getLogger(n) for n in ("cpbench", "cpbench.out")]
    saved = [(lg.handlers[:], lg.propagate, lg.level) for lg in loggers]
    yield
    for lg, (handlers, propagate, level) in zip(loggers, saved):
        lg.handlers, lg.propagate, lg.level = handlers, propagate, level


def test_console_routes_progress_off_stdout_for_machine_formats(monkeypatch, restore_loggers):
    import logging
    import sys

    from cpbench.report import console

    out, err = _Stream(False), _Stream(False)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    console.setup(0, "csv")
    logging.getLogger("cpbench").info("progress")
    logging.getLogger("cpbench.out").info("a,b")
    assert out.getvalue() == "a,b\n" and err.getvalue() == "progress\n"
    console.setup(1, "table")  # other ranks say nothing
    logging.getLogger("cpbench").info("progress")
    logging.getLogger("cpbench.out").info("a,b")
    assert out.getvalue() == "a,b\n" and err.getvalue() == "progress\n"


def _upstream(strategy, twin, twin_options=None, **kw):
    r = fake_record(strategy, **kw)
    r["upstream"] = {"package": "lib", "version": "1", "twin": twin,
                     "twin_options": twin_options or {}}
    return r


def test_compare_upstream_pairs_twins_on_the_same_problem_with_the_time_ratio():
    from cpbench.report.upstream import compare_upstream, pairs

    usp_opts = {"placement": "head-first", "ulysses_degree": 2, "ring_impl": "zigzag"}
    records = [
        fake_record("zigzag", fwd_bwd=[[40.0] * 3] * 4),
        _upstream("rfa-zigzag", "zigzag", fwd_bwd=[[50.0] * 3] * 4),
        fake_record("usp", options=usp_opts, defaults=usp_opts, fwd_bwd=[[30.0] * 3] * 4),
        fake_record("usp", options={**usp_opts, "placement": "ring-first"}, defaults=usp_opts),
        _upstream("yunchang-usp", "usp", usp_opts, fwd_bwd=[[60.0] * 3] * 4),
        _upstream("rfa-ring", "ring", seqlen=2048),  # no ring row at all: unpaired
        _upstream("rfa-zigzag", "zigzag", seqlen=2048),  # another problem: unpaired
    ]
    found = [(o["config"]["strategy"], o["config"]["options"].get("placement"),
              u["config"]["strategy"]) for o, u in pairs(records)]
    assert found == [("zigzag", None, "rfa-zigzag"), ("usp", "head-first", "yunchang-usp")]
    text = compare_upstream(records)
    assert "1.25x" in text and "2.00x" in text  # 50 / 40 and 60 / 30
    assert "no strategy ran beside" in compare_upstream(records[:1])


def _profiled(strategy, exposed, **kw):
    r = fake_record(strategy, **kw)
    r["profile"] = {"rank": 0, "step_ms": 30.0, "exposed_comm_ms": 30.0 * exposed / 100,
                    "exposed_comm_pct": exposed,
                    "wall_pct": {"attention/fwd": 20.0, "attention/bwd": 50.0,
                                 "communication/p2p": 20.0, "idle": 10.0}}
    return r


def test_profiled_records_show_exposed_communication(tmp_path, wide):
    from cpbench.report import plot

    records = [_profiled("zigzag", 12.5), fake_record("ring")]
    lines = report.summary(records).splitlines()
    header = [c.strip() for c in lines[2].split("|")]
    assert "Exposed Comm (%)" in header
    col = header.index("Exposed Comm (%)")
    assert [line.split("|")[col].strip() for line in lines[4:6]] == ["12.5", "-"]
    data = json.loads(report.summary(records, "json"))
    assert data[0]["exposed_comm_pct"] == 12.5 and data[1]["exposed_comm_pct"] is None
    assert "Exposed Comm" not in report.summary([fake_record("ring")])  # no profile: no column
    out = tmp_path / "b.png"
    assert plot.plot_breakdown(records, str(out)) and out.stat().st_size > 0
    assert not plot.plot_breakdown([fake_record("ring")], str(tmp_path / "none.png"))
    assert plot.breakdown_path("dir/t.png") == "dir/t.breakdown.png"


def test_a_baseline_timed_at_both_ends_is_pooled_and_drift_is_flagged():
    """The run times the no-CP baseline first and last: both timings count (pooled), and
    when they disagree beyond their spread the report says the machine's load changed."""
    cp = fake_record("zigzag", fwd_bwd=[[31.0, 32.0, 30.0]] * 4)
    steady = [fake_record("local", ranks_per_problem=1, fwd_bwd=[[t, t + 1, t - 1]] * 4)
              for t in (62.0, 62.5)]
    (_, _, _, _, eff, (low, high)), = report.efficiencies([cp, *steady])
    assert eff == pytest.approx(62.25 / (4 * 31.0)) and low <= eff <= high  # median of six
    assert "beyond their spread" not in report.summary([cp, *steady])
    drifted = [steady[0], fake_record("local", ranks_per_problem=1,
                                      fwd_bwd=[[90.0, 91.0, 89.0]] * 4)]
    (_, _, _, _, eff, _), = report.efficiencies([cp, *drifted])
    assert eff == pytest.approx(76.0 / (4 * 31.0))  # the median of all six iterations
    text = report.summary([cp, *drifted])
    assert "warning: local at seqlen 1024 timed 62.00, 90.00 ms, beyond their spread" in text
    # and where it happened: both of the baseline's rows carry it (the CP row does not), a
    # note under the narrow table
    note = re.search(r"^\[(\d+)\] baseline drifted: timed 62.00, 90.00 ms, beyond their "
                     r"spread", text, re.M)
    assert note and text.count("baseline drifted") == 1
    marked = [line for line in text.splitlines()
              if "|" in line and f"[{note.group(1)}]" in line.split("|")[0]]
    assert len(marked) == 2 and all("local" in line for line in marked)
