"""The physics guards end to end: ``cpbench run`` with a strategy a third party registers
through the entry-point group, whose schedule sends K/V and whose attention sends nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLUGINS = Path(__file__).resolve().parent / "plugins"
SMALL = ["--seqlen", "256", "--heads", "2", "--head-dim", "16", "--warmup", "1",
         "--iters", "3"]


def _cpbench(*args, timeout=180):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(PLUGINS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-c", "import sys; from cpbench.cli import main; sys.exit(main())",
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=env)


def test_a_strategy_that_sends_nothing_is_flagged_and_never_wins(tmp_path):
    out = tmp_path / "r.jsonl"
    run = _cpbench("run", "--strategy", "test-silent-zigzag,zigzag,test-cp-off", "--nproc",
                   "2", *SMALL, "--out", str(out))
    assert run.returncode == 0, run.stdout + run.stderr  # exit status unchanged
    silent, zigzag, cp_off = (json.loads(line) for line in out.read_text().splitlines())
    assert silent["config"]["strategy"] == "test-silent-zigzag"
    # zigzag's ring at S=256, H=2, D=16, fp32, 2 ranks: one K and one V block of 128 tokens
    block = 2 * 128 * 2 * 16 * 4
    assert silent["comm"]["sent_bytes"]["fwd"] == [0, 0]
    assert silent["comm"]["schedule_bytes"]["fwd"] == [block, block]
    assert silent["derived"]["flags"] == [f"FWD rank 0: sent 0 B, schedule says "
                                          f"{block / 1e3:.3g} KB",
                                          "FWD+BWD rank 0: sent 0 B, schedule says "
                                          f"{4 * block / 1e3:.3g} KB"]
    assert zigzag["comm"]["sent_bytes"] == {"fwd": [block, block],
                                            "fwd_bwd": [4 * block, 4 * block]}
    assert zigzag["derived"]["flags"] == []
    assert zigzag["sizes"] == {"world": [2, 2], "cp": [2, 2], "local_seqlen": [128, 128]}
    assert cp_off["sizes"] == {"world": [2, 2], "cp": [1, 1], "local_seqlen": [256, 256]}
    assert cp_off["derived"]["flags"] == ["CP over 1 ranks, asked for 2",
                                          "the shards hold 512 tokens, the 1 problem(s) 256"]
    table = run.stdout[run.stdout.index("Benchmark Summary:"):]
    # the flagged rows marked [n], the reasons numbered under the table (narrow by default)
    assert re.search(r"^ +test-silent-zigzag \[1,2\] +\|", table, re.M)
    assert "\n[1] FWD rank 0: sent 0 B, schedule says" in table
    best = _cpbench("report", str(out), "--best")
    assert best.returncode == 0, best.stderr
    ranked = best.stdout.split("not ranked:")[0]
    assert "test-silent-zigzag" not in ranked
    # zigzag wins, unless the machine's load or shared cores kept it from measuring CP
    assert ("zigzag" in ranked) == (zigzag["derived"]["not_measured"] is None)
    assert "not ranked: test-silent-zigzag" in best.stdout
    assert "test-cp-off" not in ranked and "not ranked: test-cp-off" in best.stdout


def test_every_cp_row_prints_its_fraction_of_ideal(tmp_path):
    out = tmp_path / "r.jsonl"
    run = _cpbench("run", "--strategy", "zigzag,ring", "--nproc", "2", *SMALL,
                   "--out", str(out), "--details")
    assert run.returncode == 0, run.stdout + run.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for r in records:  # the slowest rank's blocks, as declared, each timed once
        assert r["ideal"]["rank"] in (0, 1) and r["ideal"]["fwd_ms"] > 0
        assert 0 < r["derived"]["fraction_of_ideal"] < 10
    # each detail block: the fraction, or why the row's timings do not measure CP
    assert run.stdout.count("  - Fraction of Ideal: ") + \
        run.stdout.count("  - Not Measuring CP: ") == 2
    table = run.stdout[run.stdout.index("Benchmark Summary:"):].splitlines()
    header = [c.strip() for c in table[3].split("|")]  # under the shared columns' line
    assert "Ideal (%)" in header  # the narrow table's name, the unit in the header
    col = header.index("Ideal (%)")
    # a figure, or "-" where the row's timings do not measure CP (a machine others load)
    shown = [r["derived"]["not_measured"] is None for r in records]
    for line, measured in zip(table[5:7], shown):
        cell = [c.strip() for c in line.split("|")][col]
        assert (0 < float(cell) < 1000) if measured else cell == "-"
    md = _cpbench("report", str(out), "--format", "markdown").stdout.splitlines()
    header = [c.strip() for c in md[0].split("|")]
    # beside the CP efficiency
    assert header.index("CP Efficiency (%)") == header.index("Fraction of Ideal (%)") + 1
    for line, measured in zip(md[2:4], shown):
        cell = line.split("|")[header.index("Fraction of Ideal (%)")].strip()
        assert (float(cell) > 0) if measured else cell == "-"
