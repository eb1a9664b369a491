"""cpbench calibrate on 2 local ranks writes a preset that cpbench simulate accepts, and
``simulate --self-check`` with it prints predicted vs measured and the worst error (tiny
sizes: this checks the chain, not the model's accuracy, which docs/simulator.md states)."""

from __future__ import annotations

import re

import pytest

from cpbench.bench import load
from cpbench.cli import main
from cpbench.sim import hardware, selfcheck

# starts cpbench commands with ranks of their own: one at a time across xdist workers
pytestmark = pytest.mark.command


def test_calibrate_then_self_check(tmp_path, capsys, monkeypatch):
    preset = tmp_path / "cpu.yaml"
    # a limit no load can pass: this shared machine may be busy (the mark is tested below)
    assert main(["calibrate", "--out", str(preset), "--nproc", "2", "--sides", "64,128",
                 "--heads", "2", "--head-dim", "16", "--iters", "1",
                 "--load-limit", "1000"]) == 0
    assert "preset written to" in capsys.readouterr().out
    hw = hardware.load(str(preset))
    assert hw.dtypes == ("fp32",) and hw.kernel_fwd_causal is not None
    assert hw.step_overhead_us > 0 and hw.intra.bandwidth_gbs > 0
    assert hw.calibration_load is not None and "busy: false" in preset.read_text()

    assert main(["simulate", "--hardware", str(preset), "--seqlen", "256", "--heads", "2",
                 "--head-dim", "16", "--strategy", "zigzag,local"]) == 0  # plain simulate too
    capsys.readouterr()

    # scored whatever else this machine runs (limits no load can pass), 2 rounds
    assert main(["simulate", "--self-check", "--hardware", str(preset), "--seqlen", "256",
                 "--heads", "2", "--head-dim", "16", "--strategy", "zigzag,ulysses,local",
                 "--iters", "1", "--rounds", "2", "--load-limit", "1000",
                 "--drift-limit", "1000"]) == 0
    out = capsys.readouterr().out
    rows = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()
            if re.search(r"[+-]\d+\.\d%\s+[+-]\d+\.\d%\s+\S+ %\s+(no|held out|in-sample)$",
                         line)]
    assert {r[0] for r in rows} == {"zigzag", "ulysses", "local"}
    assert all(r[6] == "2" for r in rows if r[0] != "local")  # both rounds counted
    assert {r[-1] for r in rows if r[0] == "local"} == {"no"}  # the kernel alone
    # at 256 on 2 ranks zigzag's diagonal block is 128 tokens, a side calibrated above:
    # in-sample; Ulysses' one block is 256: held out
    assert {r[-1] for r in rows if r[0] == "zigzag"} == {"in-sample"}
    assert {r[-1] for r in rows if r[0] == "ulysses"} == {"held out"}
    scored = [r for r in rows if r[-1] == "held out"]  # the headline's rows
    errors = [abs(float(r[7].rstrip("%"))) for r in scored]  # against the median
    worst = float(re.search(r"worst \|error\| ([\d.]+) %", out).group(1))
    assert worst == max(errors)
    assert len(re.findall(r"^  256: probe ", out, re.M)) == 2  # a probe around each length
    assert re.search(r"^  median \|error\| [\d.]+ %, \d of 2 within 15 % \(against the "
                     r"median, as cpbench run reports\)$", out, re.M)
    assert re.search(r"^in-sample \(2 rows: a block at a side the preset's curve measured\)",
                     out, re.M)

    # a machine others loaded (the meter's reading stood in: a quiet CI machine may show
    # none): the table, no verdict, exit 1; the records it saved carry that reading, and
    # re-predicting them (--measured) refuses too
    monkeypatch.setattr(selfcheck, "Meter", _LoadedMeter)
    # the preset as an idle machine would have marked it (this one may be busy): only the
    # check's own reading refuses here; a busy preset's refusal: tests/unit/test_selfcheck.py
    preset.write_text(re.sub(r"^load: .*$", "load: {share: 0.0, wall_s: 1}",
                             preset.read_text(), flags=re.M))
    saved = tmp_path / "sc.jsonl"
    assert main(["simulate", "--self-check", "--hardware", str(preset), "--seqlen", "256",
                 "--heads", "2", "--head-dim", "16", "--strategy", "zigzag",
                 "--iters", "1", "--rounds", "1", "--drift-limit", "1000",
                 "--load-limit", "0.2", "--out", str(saved)]) == 1
    out = capsys.readouterr().out
    assert "not scored: other processes used 25 % of the cores while 256 was measured" in out
    assert "median |error|" not in out and "zigzag" in out
    monkeypatch.undo()
    assert main(["simulate", "--self-check", "--hardware", str(preset), "--measured",
                 str(saved), "--load-limit", "0.2"]) == 1
    out = capsys.readouterr().out
    assert "not scored: other processes used 25 % of the cores while 256 was measured" in out


class _LoadedMeter:
    """What ``bench.load.Meter`` reports when others took a quarter of 2 cores for 10 s."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.load = load.Load(foreign_cpu_s=5.0, wall_s=10.0, cpus=2)
