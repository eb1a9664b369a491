"""``cpbench report`` over a sweep's records (written to real JSONL files by ``results.append``):
seed 001's tables grouped by strategy, the pivot, placements compared, the plot, and the
run view kept for a single run's file."""

from __future__ import annotations

import sys

import pytest
from test_results import fake_record

from cpbench import report, results
from cpbench.cli import main
from cpbench.report.render import WIDE, fitting

SEQLENS = (131072, 262144, 524288)


def _rec(strategy, seqlen, ms, *, status="ok", options=None, defaults=None, launch=None):
    r = fake_record(strategy, seqlen=seqlen, status=status, options=options, defaults=defaults,
                    fwd=[[ms / 3] * 3] * 4, fwd_bwd=[[ms] * 3] * 4,
                    error=None if status == "ok" else "rank 0: OutOfMemoryError")
    r["env"] = {**r["env"], "utc": launch or f"{strategy}-{options}-{seqlen}"}  # own launch
    r["derived"] = results.derive(r)
    return r


def _sweep(path):
    """Seed 001's shape: megatron-cp OOM at 512K, double-ring, USP in both placements; the
    OOM case first recorded as failed, then re-run (the last record counts)."""
    results.append(path, _rec("usp", SEQLENS[0], 999.0, status="failed",
                              options={"placement": "ring-first"}))
    for s, f in zip(SEQLENS, (1, 3.5, 13)):
        results.append(path, _rec("megatron-cp", s, 330 * f,
                                  status="OOM" if s == SEQLENS[-1] else "ok"))
        results.append(path, _rec("double-ring", s, 180 * f))
        results.append(path, _rec("usp", s, 310 * f, options={"placement": "ring-first"}))
        results.append(path, _rec("usp", s, 140 * f, options={"placement": "head-first"}))
    return results.read(path)


def _cells(line):
    return [c.strip() for c in line.split("|")]


def test_grouped_tables_like_seed_001(tmp_path):
    with fitting(WIDE):  # seed 001's layout, every column
        text = report.sweep.grouped(_sweep(tmp_path / "r.jsonl"))
    headings = [line for line in text.splitlines() if line.startswith("### ")]
    # CPU ranks, not GPUs
    assert headings == ["### usp (ring-first) on 2×2 ranks",  # in the order first recorded
                        "### megatron-cp on 2×2 ranks", "### double-ring on 2×2 ranks",
                        "### usp (head-first) on 2×2 ranks"]
    block = text.split("### ")[2].splitlines()
    header = _cells(block[2])
    assert header[:4] == ["Dtype", "QKV Format", "B", "Seq Len"]
    assert header[-4:] == ["FWD (ms)", "FWD+BWD (ms)", "Memory (MB)", "TFLOP/s/rank"]
    rows = [dict(zip(header, _cells(line))) for line in block[4:7]]
    assert [r["Seq Len"] for r in rows] == [str(s) for s in SEQLENS]
    assert rows[0]["FWD+BWD (ms)"] == "330.00"
    assert (rows[2]["FWD+BWD (ms)"], rows[2]["TFLOP/s/rank"]) == ("OOM", "OOM")
    usp = text.split("### ")[1].splitlines()  # the failed first try was re-run: ok now
    assert dict(zip(header, _cells(usp[4])))["FWD+BWD (ms)"] == "310.00"
    assert "failed" not in text
    # by default the columns every row shares go to a line under the heading
    narrow = report.sweep.grouped(_sweep(tmp_path / "n.jsonl")).split("### ")[2].splitlines()
    assert narrow[1] == "every row: Dtype fp32, QKV Format bshd, B 1, World 4, CP True, " \
                        "Window None"
    assert _cells(narrow[3]) == ["Seq Len", "FWD (ms)", "FWD+BWD (ms)", "Mem (MB)",
                                 "TFLOP/s/rank"]


def test_pivot_strategy_by_seqlen(tmp_path):
    text = report.sweep.pivot(_sweep(tmp_path / "r.jsonl"))
    blocks = text.split("### ")[1:]
    assert [b.splitlines()[0] for b in blocks] == [
        "TFLOPs/s per rank by Seq Len", "FWD+BWD (ms) by Seq Len", "Memory (MB) by Seq Len"]
    lines = blocks[1].splitlines()
    assert _cells(lines[2]) == ["Strategy", "128K", "256K", "512K"]
    table = {_cells(line)[0]: _cells(line)[1:] for line in lines[4:8]}
    assert list(table)[0] == "usp (ring-first)"
    assert table["megatron-cp"] == ["330.00", "1155.00", "OOM"]
    assert table["usp (head-first)"] == ["140.00", "490.00", "1820.00"]
    tflops = {_cells(line)[0]: _cells(line)[1:] for line in blocks[0].splitlines()[4:8]}
    assert tflops["megatron-cp"][2] == "OOM" and float(tflops["double-ring"][0]) > 0


def test_cli_views(tmp_path, capsys):
    path = tmp_path / "sweep.jsonl"
    _sweep(path)
    assert main(["report", str(path)]) == 0  # many launches: the sweep view
    out = capsys.readouterr().out
    assert "### double-ring on 2×2 ranks" in out and "### FWD+BWD (ms) by Seq Len" in out
    assert "Benchmark Results for" not in out
    assert main(["report", str(path), "--view", "run"]) == 0
    assert "Benchmark Summary:" in capsys.readouterr().out
    assert main(["report", str(path), "--format", "markdown"]) == 0
    md = capsys.readouterr().out
    assert "### usp (head-first) on 2×2 ranks\n| Dtype | QKV Format |" in md
    assert main(["report", str(path), "--compare", "placement"]) == 0
    out = capsys.readouterr().out  # one table (report.placements; test_placements.py)
    assert out.count("### ") == 1 and "ring-first" in out and "Winner" in out
    assert main(["report", str(path), "--compare", "placement", "--format", "csv"]) == 2
    assert "use --format table or markdown" in capsys.readouterr().err

    one = tmp_path / "run.jsonl"  # one run's file: what `cpbench run` printed, as before
    for s in ("ring", "zigzag"):
        results.append(one, _rec(s, 1024, 30.0, launch="same run"))
    assert main(["report", str(one)]) == 0
    out = capsys.readouterr().out
    assert out == report.report(results.read(one))
    assert "Benchmark Summary:" in out and "### " not in out
    assert "Benchmark Results for" not in out  # the blocks: --details
    assert main(["report", str(one), "--details"]) == 0
    out = capsys.readouterr().out
    assert out == report.report(results.read(one), details=True)
    assert out.index("Benchmark Results for ring") < out.index("Benchmark Summary:")


def test_plot_written_with_failed_points_marked(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path, png = tmp_path / "sweep.jsonl", tmp_path / "p.png"
    _sweep(path)
    assert main(["report", str(path), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"plot written to {png}" in capsys.readouterr().err


def test_plot_without_matplotlib_is_one_line_with_the_install(tmp_path, capsys, monkeypatch):
    path = tmp_path / "sweep.jsonl"
    _sweep(path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert main(["report", str(path), "--plot", str(tmp_path / "p.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "pip install 'cpbench[plot]'" in err
    assert not (tmp_path / "p.png").exists()


def test_plot_lines_never_share_a_look():
    """Up to 60 lines, each its own (colour, marker): matplotlib's default cycle repeats its
    colours after ten, which made two strategies look like one; any 10 styles in a row (a
    panel holds at most 8 lines) differ by colour alone too."""
    from cpbench.report.plot import line_style, require_matplotlib

    plt = require_matplotlib()
    looks = [tuple(line_style(i, plt).values()) for i in range(60)]
    assert len(set(looks)) == 60
    assert all(len({colour for colour, _ in looks[i:i + 10]}) == 10 for i in range(50))
