"""cpbench calibrate on 2 local ranks writes a preset that cpbench simulate accepts, and
``simulate --self-check`` with it prints predicted vs measured and the worst error (tiny
sizes: this checks the chain, not the model's accuracy, which docs/simulator.md states)."""

from __future__ import annotations

import re

from cpbench.cli import main
from cpbench.sim import hardware


def test_calibrate_then_self_check(tmp_path, capsys):
    preset = tmp_path / "cpu.yaml"
    assert main(["calibrate", "--out", str(preset), "--nproc", "2", "--sides", "64,128",
                 "--heads", "2", "--head-dim", "16", "--iters", "1"]) == 0
    assert "preset written to" in capsys.readouterr().out
    hw = hardware.load(str(preset))
    assert hw.dtypes == ("fp32",) and hw.kernel_fwd_causal is not None
    assert hw.step_overhead_us > 0 and hw.intra.bandwidth_gbs > 0

    assert main(["simulate", "--hardware", str(preset), "--seqlen", "256", "--heads", "2",
                 "--head-dim", "16", "--strategy", "zigzag,local"]) == 0  # plain simulate too
    capsys.readouterr()

    # scored whatever else this machine runs (limits no load can pass), 2 rounds
    assert main(["simulate", "--self-check", "--hardware", str(preset), "--seqlen", "256",
                 "--heads", "2", "--head-dim", "16", "--strategy", "zigzag,ulysses",
                 "--iters", "1", "--rounds", "2", "--load-limit", "1.01",
                 "--drift-limit", "1000"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.search(r"[+-]\d+\.\d%\s+\S+ %$", line)]
    assert len(rows) == 4  # two strategies x FWD, FWD+BWD
    assert all(line.split()[-4] == "2" for line in rows)  # both rounds counted
    errors = [abs(float(line.split()[-3].rstrip("%"))) for line in rows]
    worst = float(re.search(r"worst \|error\| ([\d.]+) %", out).group(1))
    assert worst == max(errors)
    assert len(re.findall(r"^  256: probe ", out, re.M)) == 2  # a probe around each length
    assert re.search(r"^median \|error\| [\d.]+ %, \d of 4 within 15 %$", out, re.M)

    # the same with a limit any measurement breaks: the table, no verdict, exit 1
    assert main(["simulate", "--self-check", "--hardware", str(preset), "--seqlen", "256",
                 "--heads", "2", "--head-dim", "16", "--strategy", "zigzag",
                 "--iters", "1", "--rounds", "1", "--load-limit", "1e-9",
                 "--drift-limit", "1000"]) == 1
    out = capsys.readouterr().out
    assert "not scored: other processes used" in out and "median |error|" not in out
