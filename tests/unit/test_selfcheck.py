"""The self-check's parts that decide whether it scores: the load meter tells our own
processes from others', the probe's drift against a preset, the steadiness test of a
calibration, and the verdict (scored, or refused with why; per strategy, per length; each
row's error with the interval its rounds allow)."""

from __future__ import annotations

import dataclasses
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


def _spend(pid: int, cpu_s: float = 0.5) -> float:
    """Wait until ``pid`` has used ``cpu_s`` of CPU, however long a busy host makes that
    take (a fixed sleep gave it 0.1 s under a load of 12 on 2 cores); its CPU seconds."""
    t0 = time.monotonic()
    while _cpu_s(pid) < cpu_s and time.monotonic() - t0 < 120:
        time.sleep(0.1)
    return _cpu_s(pid)


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
        spent = _spend(orphan)
        os.kill(orphan, 9)
    assert spent >= 0.5 and meter.load.foreign_cpu_s >= 0.8 * spent

    machine_before = _machine_busy_s()
    with load.Meter(period=0.1) as meter:
        child = subprocess.Popen(BUSY)
        _wait_for(child.pid)
        spent = _spend(child.pid)
        child.kill()
    machine = _machine_busy_s() - machine_before
    assert spent >= 0.5 and meter.load.foreign_cpu_s <= machine - 0.8 * spent + 0.1


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


def _row(label, seqlen, predicted, *rounds, strategy=None, fastest=None, sample="held out",
         excluded=None):
    """A row whose rounds' medians are ``rounds``: its median their middle (an odd count) or
    given, its fastest iteration ``fastest`` (default 0.9 x the smallest)."""
    median = sorted(rounds)[len(rounds) // 2]
    return selfcheck.Row(label, strategy or label, seqlen, "FWD", predicted, tuple(rounds),
                         median, fastest or 0.9 * min(rounds), sample, excluded)


ROWS = [_row("zigzag", 2048, 10.0, 10.0, 11.0, 10.5), _row("zigzag", 4096, 36.0, 40.0),
        _row("ring", 2048, 12.0, 10.0), _row("ring", 4096, 40.0, 40.0, fastest=36.0)]
IDLE = dict(length_loads=[(2048, 0.001), (4096, 0.003)])


def test_a_rows_error_is_against_its_median_with_the_fastest_beside_and_the_rounds_interval():
    r = ROWS[0]  # rounds' medians 10, 11, 10.5: the median 10.5
    assert r.measured_ms == 10.5 and r.error == pytest.approx(10 / 10.5 - 1)
    assert r.error_fastest == pytest.approx(10 / 9 - 1)
    assert r.interval == pytest.approx((10 / 11 - 1, 0.0))


def test_the_verdict_per_strategy_per_length_and_overall():
    measured = selfcheck.Measured(probes=["2048: ..."], load=load.Load(0.5, 100.0, 2), **IDLE)
    text, scored = selfcheck_report.render(ROWS, _preset(), 2, measured=measured)
    assert scored
    assert "load: other processes used 0.2 % of the cores over 100 s" in text
    lines = text.splitlines()
    # errors against the median: -4.8 %, -10 %, +20 %, 0 %; against the fastest: 10/9,
    # 36/36, 12/9, 40/36 (+11.1, 0, +33.3, +11.1 %)
    assert lines[-4:] == [
        "held out (4 rows: no block at a side the preset's curve measured):",
        "  median |error| 7.4 %, 3 of 4 within 15 % (against the median, as cpbench run "
        "reports)",
        "  median |error| 11.1 %, 3 of 4 within 15 % (against the fastest iteration, "
        "calibrate's statistic)",
        "worst |error| 20.0 % (ring, 2048, FWD, held out)"]
    zig = next(line for line in lines if line.strip().startswith("zigzag ") and "median" in line)
    assert "2 of   2 within 15 %" in zig and "worst  10.0 %" in zig


def test_rows_not_scored_and_in_sample_rows_stay_out_of_the_headline():
    rows = ROWS + [_row("local", 2048, 5.0, 50.0, excluded="no CP"),
                   _row("usp", 2048, 5.0, 50.0, excluded="the same schedule as zigzag"),
                   _row("ulysses", 2048, 5.0, 50.0, sample="in-sample")]
    text, scored = selfcheck_report.render(rows, _preset(), 2,
                                           measured=selfcheck.Measured(**IDLE, saved=True))
    assert scored
    assert "held out (4 rows" in text and "in-sample (1 rows" in text
    assert "  local: no CP" in text and "  usp: the same schedule as zigzag" in text
    assert text.splitlines()[-1] == "worst |error| 20.0 % (ring, 2048, FWD, held out)"
    table = {line.split()[0]: line.split()[-1] for line in text.splitlines()
             if line.split() and line.split()[0] in ("local", "usp", "ulysses")}
    assert table == {"local": "no", "usp": "no", "ulysses": "in-sample"}


def test_a_loaded_machine_is_not_scored():
    measured = selfcheck.Measured(load=load.Load(30.0, 100.0, 2), **IDLE)
    text, scored = selfcheck_report.render(ROWS, _preset(), 2, measured=measured)
    assert not scored
    assert "not scored: other processes used 15 % of the cores while all was measured" in text
    assert "median |error|" not in text  # no verdict line
    # one length loaded is enough, though the whole check was quiet
    one = selfcheck.Measured(load=load.Load(0.5, 100.0, 2),
                             length_loads=[(2048, 0.001), (4096, 0.3)])
    text, scored = selfcheck_report.render(ROWS, _preset(), 2, measured=one)
    assert not scored and "used 30 % of the cores while 4096 was measured" in text


def _records(*shares):
    """Saved self-check records, one per length, with the load reading each carries."""
    from test_results import fake_record

    out = []
    for seqlen, share in zip((2048, 4096), shares):
        r = fake_record("zigzag", seqlen=seqlen)
        if share != "none":
            r["env"]["selfcheck"] = {"load_share": share, "probe": f"{seqlen}: probe ..."}
        out.append(r)
    return out


def test_re_predicting_saved_records_is_judged_by_the_readings_they_carry():
    quiet = selfcheck.from_records(_records(0.01, 0.02))
    assert quiet.probes == ["2048: probe ...", "4096: probe ..."]
    text, scored = selfcheck_report.render(ROWS, _preset(), 2, measured=quiet)
    assert scored and "median |error| 7.4 %" in text
    text, scored = selfcheck_report.render(ROWS, _preset(), 2,
                                           measured=selfcheck.from_records(_records(0.01, 0.4)))
    assert not scored and "used 40 % of the cores while 4096 was measured" in text
    text, scored = selfcheck_report.render(ROWS, _preset(), 2, measured=selfcheck.from_records(
        _records(0.01, "none")))
    assert not scored and "these records carry no load reading for 4096" in text


PROBE = {"side": 2048, "heads": 2, "head_dim": 64, "busy_ms": 26.0, "alone_ms": 25.0}


def test_a_preset_calibrated_on_a_busy_machine_or_without_a_reading_is_not_scored_against():
    quiet = selfcheck.Measured(**IDLE, saved=True)
    for extra, needle in (({}, "the preset carries no load reading"),
                          ({"load": {"share": 0.3}}, "used 30 % of the cores while the preset "
                                                     "was calibrated")):
        text, scored = selfcheck_report.render(ROWS, _preset(probe=PROBE, **extra), 2,
                                               measured=quiet)
        assert not scored and needle in text, text
    text, scored = selfcheck_report.render(ROWS, _preset(probe=PROBE, load={"share": 0.02}), 2,
                                           measured=quiet)
    assert scored and "preset: calibrated while other processes used 2.0 % of the cores" in text


def _case(strategy, options=None, samples=((10.0, 30.0, 12.0), (11.0, 9.0, 12.0)),
          ranks_per_problem=2):
    """A 2-rank record (one rank a node) of the self-check's problem at 2048, with per-rank
    FWD samples ``samples`` (the slowest rank per iteration: 11, 30, 12)."""
    from test_results import fake_record

    from cpbench import strategies

    cls = strategies.get(strategy)
    opts = dataclasses.asdict(cls.Options(**(options or {})))
    r = fake_record(strategy, seqlen=2048, options=opts,
                    defaults=dataclasses.asdict(cls.Options()),
                    ranks_per_problem=ranks_per_problem, samples={"fwd": [list(s) for s in
                                                                       samples]})
    r["config"]["attention"].update(heads=2, head_dim=64)
    r["topology"] = {"world_size": 2, "ranks_per_node": 1, "num_nodes": 2}
    return r


def test_compare_scores_the_median_leaves_out_the_baseline_and_repeated_schedules():
    records = [_case("zigzag"), _case("usp", {"ulysses_degree": 1}), _case("ulysses"),
               _case("usp", {"ulysses_degree": 2}), _case("local", ranks_per_problem=1)]
    rows, skipped = selfcheck.compare(records, _preset())
    assert not skipped and [r.phase for r in rows] == ["FWD"] * 5
    z = next(r for r in rows if r.strategy == "zigzag")
    assert (z.median_ms, z.fastest_ms, z.rounds_ms) == (12.0, 11.0, (12.0,))
    assert z.excluded is None and next(r for r in rows if r.strategy == "ulysses").excluded \
        is None
    usp = [r for r in rows if r.strategy == "usp"]
    assert [r.excluded for r in usp] == [f"the same schedule as {z.label}: counted once",
                                         "the same schedule as ulysses: counted once"]
    local = next(r for r in rows if r.strategy == "local")
    assert local.excluded.startswith("no CP")
    # the flat preset has points at 256 and 8192 only: no block of these cases is there
    assert {r.sample for r in rows} == {"held out"}
    # a preset measured at 1024 (zigzag's blocks at 2048 on 2 ranks: its diagonal 1024 x
    # 1024 and 512 x 1024 off it, side 724)
    at = _preset(kernel={"fwd": [[256, 0.08], [1024, 0.08], [8192, 0.08]],
                         "bwd": [[256, 0.08], [8192, 0.08]]})
    rows, _ = selfcheck.compare(records, at)
    assert next(r for r in rows if r.strategy == "zigzag").sample == "in-sample"
    assert next(r for r in rows if r.strategy == "ulysses").sample == "held out"  # 2048


def test_the_check_refuses_a_busy_presets_machine_before_measuring(tmp_path, capsys):
    import yaml

    from cpbench.cli import main

    flat = [[256, 0.08], [8192, 0.08]]
    preset = {"name": "cpu", "gpus_per_node": 2, "memory_gib": 8.0, "peak_tflops_bf16": 0.1,
              "dtypes": ["fp32"], "kernel": {"fwd": flat, "bwd": flat}, "probe": PROBE,
              "load": {"share": 0.4},
              "intra_node": {"bandwidth_gbs": 1.0, "latency_us": 100.0},
              "inter_node": {"bandwidth_gbs_per_gpu": 1.0, "node_bandwidth_gbs": 1.0,
                             "latency_us": 100.0}}
    path = tmp_path / "busy.yaml"
    path.write_text(yaml.safe_dump(preset))
    assert main(["simulate", "--self-check", "--hardware", str(path), "--seqlen", "256"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "used 40 % of the cores while the preset was calibrated" in err


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
