"""The self-check's parts that decide whether it scores: the load meter tells our own
processes from others', the probe's drift against a preset, the steadiness test of a
calibration, and the verdict (scored, or refused with why; per strategy, per length; each
row's error with the interval its rounds allow)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

import pytest

from cpbench.bench import load
from cpbench.sim import hardware, selfcheck, selfcheck_report
from cpbench.sim.calibrate import steady

BUSY = [sys.executable, "-c", "for _ in iter(int, 1): pass"]  # spins until killed


def _wait_for(pid: int) -> None:
    for _ in range(100):
        if os.path.exists(f"/proc/{pid}/stat"):
            return
        time.sleep(0.05)


@pytest.mark.skipif(not load.Meter.available(), reason="needs Linux's /proc")
def test_the_meter_tells_our_children_from_an_orphan(tmp_path):
    child = subprocess.Popen(BUSY)
    pidfile = tmp_path / "pid"
    # an orphan: its parent shell exits at once, so it is not in our tree
    subprocess.run(["sh", "-c", f"{shlex.join(BUSY)} & echo $! > {pidfile}"], check=True)
    orphan = int(pidfile.read_text())
    try:
        _wait_for(orphan)
        snap = load._snapshot(os.getpid())
        assert snap[child.pid][0] is False  # ours
        assert snap[orphan][0] is True  # foreign
        assert snap[os.getpid()][0] is False
    finally:
        child.kill()
        os.kill(orphan, 9)


def _cpu_s(pid: int) -> float:
    return load._stat(str(pid))[1]


def _machine_busy_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / load._TICK  # all but idle, iowait


@pytest.mark.slow  # two seconds of busy processes
@pytest.mark.skipif(not load.Meter.available(), reason="needs Linux's /proc")
def test_the_meter_counts_an_orphans_cpu_and_not_our_childs(tmp_path):
    """An orphan's CPU is in the foreign time; a child's is not: the foreign time is at most
    what the whole machine did less the child (whatever else runs on the machine)."""
    pidfile = tmp_path / "pid"
    with load.Meter(period=0.1) as meter:
        subprocess.run(["sh", "-c", f"{shlex.join(BUSY)} & echo $! > {pidfile}"], check=True)
        orphan = int(pidfile.read_text())
        _wait_for(orphan)
        time.sleep(1.0)
        spent = _cpu_s(orphan)
        os.kill(orphan, 9)
    assert spent > 0.1 and meter.load.foreign_cpu_s >= 0.8 * spent

    machine_before = _machine_busy_s()
    with load.Meter(period=0.1) as meter:
        child = subprocess.Popen(BUSY)
        time.sleep(1.0)
        spent = _cpu_s(child.pid)
        child.kill()
    machine = _machine_busy_s() - machine_before
    assert spent > 0.1 and meter.load.foreign_cpu_s <= machine - 0.8 * spent + 0.1


def _preset(**extra) -> hardware.Hardware:
    flat = [[256, 0.08], [8192, 0.08]]
    return hardware.from_dict({
        "name": "cpu", "gpus_per_node": 2, "memory_gib": 8.0, "peak_tflops_bf16": 0.1,
        "dtypes": ["fp32"], "kernel": {"fwd": flat, "bwd": flat},
        "intra_node": {"bandwidth_gbs": 1.0, "latency_us": 100.0},
        "inter_node": {"bandwidth_gbs_per_gpu": 1.0, "node_bandwidth_gbs": 1.0,
                       "latency_us": 100.0}, **extra})


PROBLEM = {"heads": 2, "head_dim": 64}


def test_drift_is_measured_against_the_presets_own_probe():
    hw = _preset(probe={"side": 2048, "heads": 2, "head_dim": 64, "busy_ms": 26.0,
                        "alone_ms": 25.0})
    assert selfcheck.drift(hw, PROBLEM, 26.0, 25.0) == pytest.approx(0.0)
    assert selfcheck.drift(hw, PROBLEM, 28.6, 27.5) == pytest.approx(0.1)
    # the host put both ranks on one core: busy 1.7x, alone unchanged
    assert selfcheck.drift(hw, PROBLEM, 44.2, 25.0) == pytest.approx(0.7)
    # twice the heads: twice the work, the same machine
    assert selfcheck.drift(hw, {"heads": 4, "head_dim": 64}, 52.0, 50.0) == pytest.approx(0.0)


def test_a_calibration_is_steady_only_when_both_readings_agree():
    assert steady((26.0, 25.0), (27.0, 25.5))
    assert not steady((26.0, 25.0), (44.0, 25.0))  # the busy forward moved
    assert not steady((26.0, 25.0), (26.0, 20.0))  # the idle speed-up moved


def _row(label, seqlen, predicted, *rounds, strategy=None):
    return selfcheck.Row(label, strategy or label, seqlen, "FWD", predicted, tuple(rounds))


ROWS = [_row("zigzag", 2048, 10.0, 10.0, 11.0), _row("zigzag", 4096, 36.0, 40.0, 41.0),
        _row("ring", 2048, 12.0, 10.0, 10.5), _row("ring", 4096, 40.0, 40.0)]


def test_a_rows_error_is_against_its_fastest_round_with_the_rounds_interval():
    r = ROWS[0]
    assert r.measured_ms == 10.0 and r.error == pytest.approx(0.0)
    assert r.interval == pytest.approx((10 / 11 - 1, 0.0))


def test_the_verdict_per_strategy_per_length_and_overall():
    measured = selfcheck.Measured(probes=["2048: ..."], load=load.Load(0.5, 100.0, 2))
    text, scored = selfcheck_report.render(ROWS, _preset(), 2, measured=measured)
    assert scored
    assert "load: other processes used 0.2 % of the cores over 100 s" in text
    lines = text.splitlines()
    assert lines[-2] == "median |error| 5.0 %, 3 of 4 within 15 %"
    assert lines[-1] == "worst |error| 20.0 % (ring, 2048, FWD)"
    zig = next(line for line in lines if line.strip().startswith("zigzag ") and "median" in line)
    assert "2 of   2 within 15 %" in zig and "worst  10.0 %" in zig


def test_a_loaded_machine_is_not_scored():
    measured = selfcheck.Measured(load=load.Load(30.0, 100.0, 2))
    text, scored = selfcheck_report.render(ROWS, _preset(), 2, measured=measured)
    assert not scored
    assert "not scored: other processes used 15 % of the cores" in text
    assert "median |error|" not in text  # no verdict line


def test_re_predicting_saved_records_is_scored_without_a_meter():
    text, scored = selfcheck_report.render(ROWS, _preset(), 2, measured=None)
    assert scored and "median |error| 5.0 %" in text


@pytest.mark.skipif(not load.Meter.available(), reason="needs Linux's /proc")
def test_the_meter_takes_the_tree_of_the_root_it_is_given():
    """``cpbench run``'s rank 0 meters with its launcher as root: its sibling ranks (children
    of the same forkserver or torchrun agent) are ours, the launcher's parent is not."""
    launcher = subprocess.Popen(["sh", "-c", f"{shlex.join(BUSY)} & {shlex.join(BUSY)} & wait"])
    ranks: list[int] = []
    try:
        _wait_for(launcher.pid)
        time.sleep(0.3)  # both ranks started
        snap = load._snapshot(launcher.pid)
        ranks = [pid for pid in snap if load._stat(str(pid)) and
                 load._stat(str(pid))[0] == launcher.pid]
        assert len(ranks) == 2 and all(snap[pid][0] is False for pid in ranks)
        assert snap[launcher.pid][0] is False and snap[os.getpid()][0] is True
        with load.Meter(root=launcher.pid) as meter:
            time.sleep(0.5)
        assert meter._root == launcher.pid and meter.load is not None
    finally:
        launcher.kill()
        for pid in ranks:
            os.kill(pid, 9)
