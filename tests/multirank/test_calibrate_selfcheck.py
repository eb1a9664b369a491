"""cpbench calibrate on 2 local ranks writes a preset that cpbench simulate accepts, and
``simulate --self-check`` with it prints predicted vs measured and the worst error (tiny
sizes: this checks the chain, not the model's accuracy, which docs/simulator.md states)."""

from __future__ import annotations

import re

from cpbench.bench import load
from cpbench.cli import main
from cpbench.sim import hardware, selfcheck


def test_calibrate_then_self_check(tmp_path, capsys, monkeypatch):
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

    # a machine others loaded (the meter's reading stood in: a quiet CI machine may show
    # none): the table, no verdict, exit 1
    monkeypatch.setattr(selfcheck, "Meter", _LoadedMeter)
    assert main(["simulate", "--self-check", "--hardware", str(preset), "--seqlen", "256",
                 "--heads", "2", "--head-dim", "16", "--strategy", "zigzag",
                 "--iters", "1", "--rounds", "1", "--drift-limit", "1000"]) == 1
    out = capsys.readouterr().out
    assert "not scored: other processes used 25 % of the cores" in out
    assert "median |error|" not in out and "zigzag" in out


class _LoadedMeter:
    """What ``bench.load.Meter`` reports when others took a quarter of 2 cores for 10 s."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.load = load.Load(foreign_cpu_s=5.0, wall_s=10.0, cpus=2)
