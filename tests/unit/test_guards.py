"""The physics guards on synthetic records: each flag, no flag on an honest record or an
old one, and a flagged row never winning ``report --best``."""

from __future__ import annotations

import re

from test_results import fake_record

from cpbench import guards, report, results
from cpbench.report import tables
from cpbench.report.best import best_table, verdicts
from cpbench.report.render import WIDE, fitting


def _comm(sent_fwd, sent_both, declared=(100, 300), varies=False):
    per_rank = [[f, int(varies), b, 0, *declared] for f, b in zip(sent_fwd, sent_both)]
    return results.comm_section(per_rank, "every timed step (cpbench.comm)")


def _with(record: dict, **sections) -> dict:
    record = {**record, **sections}
    record["derived"] = results.derive(record)
    return record


def test_bytes_as_declared_raise_no_flag():
    assert guards.comm_flags(_comm([100, 100], [400, 400])) == []


def test_bytes_other_than_declared_are_flagged_with_both_figures():
    flags = guards.comm_flags(_comm([100, 0], [400, 400]))
    assert flags == ["FWD rank 1: sent 0 B, schedule says 100 B"]
    flags = guards.comm_flags(_comm([100, 100], [400, 2_400_000]))
    assert flags == ["FWD+BWD rank 1: sent 2.4 MB, schedule says 400 B"]


def test_timed_steps_that_sent_differently_are_flagged():
    flags = guards.comm_flags(_comm([100, 100], [400, 400], varies=True))
    assert flags == ["FWD: bytes sent differ between timed steps"]


def test_no_schedule_no_comparison():
    comm = _comm([5, 5], [7, 7], declared=(-1, -1))
    assert comm["schedule_bytes"] is None and guards.comm_flags(comm) == []


def test_old_records_have_no_flags():
    assert fake_record()["derived"]["flags"] == []
    old = fake_record()
    del old["derived"]
    assert "comm" not in old and guards.flags(old, results.derive(old)) == []


def test_a_flagged_row_never_wins_and_shows_in_the_table():
    fast = _with(fake_record("zigzag", fwd=[[0.3] * 3] * 4, fwd_bwd=[[1.0, 1.0, 1.0]] * 4),
                 comm=_comm([0] * 4, [0] * 4))
    slow = fake_record("ring")
    assert [v.winner for v in verdicts([fast, slow])] == ["ring"]
    text = report.summary([fast, slow])  # narrow: the row marked, its flags noted under
    assert re.search(r"^ +zigzag \[1,2\] +\|", text, re.M) and not re.search(r"ring \[", text)
    assert "\n[1] FWD rank 0: sent 0 B, schedule says 100 B\n" in text
    with fitting(WIDE):  # --wide: a Flags column
        assert "Flags" in report.summary([fast, slow])
    assert "not ranked: zigzag" in best_table([fast, slow])


def _on(device_name: str, dtype: str, fwd_bwd_ms: float, **env) -> dict:
    """A zigzag row on 4 ranks of ``device_name``, S=1024, H=8, D=32, causal."""
    rec = fake_record(fwd=[[fwd_bwd_ms / 3] * 3] * 4, fwd_bwd=[[fwd_bwd_ms] * 3] * 4)
    rec["config"]["attention"]["dtype"] = dtype
    rec["env"] = {**rec["env"], "device_name": device_name, **env}
    rec["derived"] = results.derive(rec)
    return rec


def test_above_the_devices_dense_peak_is_impossible():
    rec = _on("NVIDIA H100 80GB HBM3", "bf16", 1.0)
    rate = rec["derived"]["fwd_bwd_tflops"]
    # the synthetic step: the problem's FLOPs over 4 devices in 1 ms, far under 989 TFLOP/s
    assert rate < 989 and rec["derived"]["flags"] == []
    fast = _on("NVIDIA H100 80GB HBM3", "bf16", rate / 1000.0)  # 1000 × that rate
    withheld = fast["derived"]["withheld"]  # the rates are not quoted, but kept under a mark
    assert withheld["fwd_bwd_tflops"] > 989.4 and "fwd_bwd_tflops" not in fast["derived"]
    # FWD a third of the step: 857 TFLOP/s, possible; BWD, timed on its own, is judged too.
    # The flag quotes the times (the step at peak: its time × its rate / the peak)
    both, bwd = fast["derived"]["fwd_bwd_ms"], fast["derived"]["bwd_ms"]
    attention = fast["config"]["attention"]

    def at_peak(mode):  # ms: the phase's FLOPs on each of 4 devices at 989.4 TFLOP/s
        return results.problem_flops(attention, mode) / 4 / 989.4e12 * 1e3

    assert fast["derived"]["flags"] == [
        f"impossible: above peak (BWD {bwd:.3g} ms, under the {at_peak('bwd'):.3g} ms its "
        f"989.4 TFLOP/s bf16 dense peak allows)",
        f"impossible: above peak (FWD+BWD {both:.3g} ms, under the {at_peak('fwd_bwd'):.3g}"
        f" ms its 989.4 TFLOP/s bf16 dense peak allows)"]


def test_the_peak_is_the_dtypes():
    rate = _on("NVIDIA A100-SXM4-80GB", "fp32", 1.0)["derived"]["fwd_bwd_tflops"]
    ms = rate / 200.0  # 200 TFLOP/s: possible in bf16 (312), not in fp32 (TF32 156)
    assert _on("NVIDIA A100-SXM4-80GB", "bf16", ms)["derived"]["flags"] == []
    flags = _on("NVIDIA A100-SXM4-80GB", "fp32", ms)["derived"]["flags"]
    # at 156 TFLOP/s the step takes 200 / 156 of its time
    assert flags[-1] == (f"impossible: above peak (FWD+BWD {ms:.3g} ms, under the "
                         f"{ms * 200 / 156:.3g} ms its 156 TFLOP/s fp32 dense peak allows)")


def test_unknown_devices_and_predictions_are_not_guarded_and_said_once():
    cpu = [_on("x86_64 (2 cores)", "fp32", 1e-9) for _ in range(2)]
    assert all(r["derived"]["flags"] == [] for r in cpu)
    assert guards.unguarded(cpu) == ["x86_64 (2 cores)"]
    assert report.summary(cpu).count("no dense peak known for x86_64 (2 cores)") == 1
    sim = _on("NVIDIA H100 80GB HBM3", "bf16", 1e-9, simulated=True)
    assert sim["derived"]["flags"] == [] and guards.unguarded([sim]) == []


def test_the_simulators_presets_carry_the_same_peaks():
    from cpbench.sim import hardware

    for name in hardware.names():
        hw = hardware.load(name)
        assert abs(guards.peak_tflops(hw.name, "bf16") - hw.peak_tflops) < 1, name


def _sized(world, cp, local_seqlen, ranks_per_problem=4):
    rec = fake_record(ranks_per_problem=ranks_per_problem)  # 4 ranks asked, S = 1024
    return {**rec, "sizes": {"world": world, "cp": cp, "local_seqlen": local_seqlen}}


def test_sizes_as_asked_raise_no_flag():
    assert guards.size_flags(_sized([4] * 4, [4] * 4, [256] * 4)) == []
    assert guards.size_flags(_sized([4] * 4, [1] * 4, [1024] * 4, ranks_per_problem=1)) == []


def test_sizes_other_than_asked_are_flagged():
    assert guards.size_flags(_sized([2] * 4, [4] * 4, [256] * 4)) == [
        "ran in a world of 2 ranks, asked for 4"]
    assert guards.size_flags(_sized([4] * 4, [2] * 4, [256] * 4)) == [
        "CP over 2 ranks, asked for 4"]
    assert guards.size_flags(_sized([4] * 4, [4] * 4, [1024] * 4)) == [
        "the shards hold 4096 tokens, the 1 problem(s) 1024"]


def _threaded(record: dict) -> dict:
    """``record`` as its ranks ran as threads on one device: nothing timed or measured."""
    return _with(record, env={**record["env"], "launcher": "threads"}, samples_ms=None,
                 memory_bytes=None)


def test_rows_of_threads_show_no_figure_and_say_why():
    base = _threaded(fake_record("local", ranks_per_problem=1))
    row = _threaded(fake_record("zigzag", check=[]))
    assert guards.not_measured(row) == guards.THREADS
    assert row["derived"]["not_measured"] == guards.THREADS
    assert fake_record()["derived"]["not_measured"] is None
    cells = {r["Strategy"]: r for r in tables.rows([row, base])}
    for name in ("zigzag", "local"):
        assert [cells[name][c] for c in ("FWD (ms)", "FWD+BWD (ms)", "Memory (MB)",
                                         "TFLOPs/s", "CP Efficiency (%)")] == ["-"] * 5
    assert f"not measuring CP: {guards.THREADS} (every row" in report.summary([row, base])
    assert report.efficiencies([row, base]) == []  # no baseline among them
    measured = fake_record("ring")
    assert [v.winner for v in verdicts([row, measured])] == ["ring"]
    assert "not ranked: zigzag" in best_table([row, measured])
    detail = report.detail(row)
    assert f"Times and memory: - ({guards.THREADS})" in detail
    assert "Iterations: none timed" in detail and "Forward Time" not in detail
    # a failed case on shared cores has no samples either: its ranks were no threads
    shared = _with(fake_record("ring", status="failed", error="rank 1: boom"),
                   env={"hostnames": ["h"] * 4, "cpus_usable": 2})
    assert guards.not_measured(shared) not in (None, guards.THREADS)  # not CP, not threads
    assert "ranks as threads" not in report.detail(shared)


# -- figures that contradict each other ------------------------------------------------------

def test_an_honest_row_has_no_contradiction():
    rec = fake_record(fwd=[[10.0, 11.0, 12.0]] * 4, fwd_bwd=[[38.0, 40.0, 41.0]] * 4)
    assert guards.contradictions(rec, rec["derived"]) == [] and rec["derived"]["flags"] == []


def test_an_old_records_negative_backward_and_fwd_above_fwd_bwd_are_flagged():
    # seed 001's double-ring: FWD timed cold on its own loop, above its FWD+BWD
    old = fake_record(samples={"fwd": [[62.7, 62.7, 62.7]] * 4,
                               "fwd_bwd": [[35.06, 35.06, 35.06]] * 4})
    assert old["derived"]["flags"] == ["impossible: FWD 62.70 ms above FWD+BWD 35.06 ms"]
    assert old["derived"]["bwd_ms"] is None  # never printed as -27.64
    neg = fake_record(bwd=[[-1.0, -2.0, -1.5]] * 4)
    assert "impossible: BWD -1.50 ms is not a time" in neg["derived"]["flags"]
    assert "BWD -1.50 ms is not a time" in report.summary([neg])


def test_a_backward_faster_than_its_forward_beyond_noise_is_flagged():
    # megatron-cp: BWD 33.4 below FWD 34.7 though it does 2.5x the FLOPs
    fwd = [[34.7, 34.9, 34.6, 34.8, 34.7]] * 4
    bwd = [[33.4, 33.5, 33.3, 33.4, 33.6]] * 4
    both = [[68.1, 68.4, 67.9, 68.2, 68.3]] * 4
    rec = fake_record(fwd=fwd, bwd=bwd, fwd_bwd=both)
    (flag,) = rec["derived"]["flags"]
    assert flag.startswith("impossible: BWD 33.40 ms below FWD 34.70 ms though it does 2.5x")
    # level within the noise: not judged (statistics, not a point estimate)
    noisy = fake_record(fwd=[[30.0, 40.0, 35.0, 20.0, 45.0]] * 4,
                        bwd=[[33.0, 50.0, 20.0, 40.0, 34.0]] * 4,
                        fwd_bwd=[[70.0, 95.0, 60.0, 65.0, 85.0]] * 4)
    assert noisy["derived"]["bwd_ms"] < noisy["derived"]["fwd_ms"]
    assert noisy["derived"]["flags"] == []


def _with_ideal(rec: dict, fwd_ms: float, bwd_ms: float) -> dict:
    return _with(rec, ideal={"definition": "share", "times": 4, "fwd_ms": fwd_ms,
                             "bwd_ms": bwd_ms})


def test_a_fraction_of_ideal_above_one_is_flagged_by_its_interval():
    # the step 30-35 ms (median 31); the ideal 10 + 20 = 30 ms: 97 %, no flag
    ok = _with_ideal(fake_record(), 10.0, 20.0)
    assert ok["derived"]["fraction_of_ideal"] < 1 and ok["derived"]["flags"] == []
    # the ideal 40 ms, every step faster: impossible; the flag quotes times, the
    # fraction (131 %) withheld
    fast = _with_ideal(fake_record(fwd_bwd=[[30.0, 30.5, 31.0, 30.2, 30.7]] * 4), 15.0, 25.0)
    (flag,) = fast["derived"]["flags"]
    assert flag == ("fraction of ideal above 100 % (FWD+BWD 30.50 ms, faster than its ideal, the "
                    "kernel alone on its share: 40.00 ms), its 95 % interval wholly past it: "
                    "impossible")
    assert fast["derived"]["withheld"]["fraction_of_ideal"] == 40 / 30.5
    assert "fraction_of_ideal" not in fast["derived"] and "131" not in flag
    # 32 ms alone against steps of 20-45 ms: above 1 at the median, not beyond the noise
    noisy = _with_ideal(fake_record(fwd_bwd=[[20.0, 45.0, 31.0, 25.0, 40.0]] * 4), 12.0, 20.0)
    (flag,) = noisy["derived"]["flags"]
    assert flag.endswith("within its 95 % interval: too noisy to quote")


def test_efficiency_above_its_balance_bound_is_flagged_with_its_interval():
    times = ("FWD+BWD", 20.0, 88.0, 4)  # 88 / (4 × 20) = 110 %
    assert guards.efficiency_flag(0.5, (0.4, 0.6), None, times) is None
    assert guards.efficiency_flag(1.1, (0.693, 1.335), None, times) == (
        "CP efficiency above 100 % (FWD+BWD 20.00 ms, under the 22.00 ms that the baseline's "
        "88.00 ms over 4 ranks allows), within its 95 % interval: too noisy to quote")
    # the imbalanced ring (1.75): at most 57 %, so 110 % [69, 134] is wholly past its bound;
    # at 57 % the step would take 88 × 1.75 / 4 = 38.5 ms
    assert guards.efficiency_flag(1.1, (0.693, 1.335), 1.75, times) == (
        "CP efficiency above 57 % (FWD+BWD 20.00 ms, under the 38.50 ms that the baseline's "
        "88.00 ms over 4 ranks allows at imbalance 1.75), its 95 % interval wholly past it: "
        "impossible")


def test_a_flagged_efficiency_is_withheld_and_never_wins():
    base = fake_record("local", ranks_per_problem=1, fwd=[[30.0, 31.0, 32.0]] * 4,
                       fwd_bwd=[[100.0, 101.0, 99.0]] * 4)
    ring = fake_record("ring", fwd=[[5.0, 5.1, 5.2]] * 4, fwd_bwd=[[20.0, 20.5, 19.5]] * 4)
    ring["balance"] = {"area_per_rank": [7, 1, 1, 3], "area_per_step": None,
                       "imbalance": 1.75}
    ring["derived"] = results.derive(ring)
    zigzag = fake_record("zigzag", fwd=[[8.0, 8.1, 8.2]] * 4, fwd_bwd=[[30.0, 30.5, 29.5]] * 4)
    text = report.summary([base, ring, zigzag])
    # ring: 100 / (4 × 20) = 125 %, its balance allows 57 %: flagged, and 125 % nowhere
    assert "125" not in text
    assert "CP efficiency above 57 % (FWD+BWD 20.00 ms, under the 43.75 ms" in text
    assert not any(x.lstrip().startswith("ring ") and "N=4" in x for x in text.splitlines())
    assert "flagged" not in next(x for x in text.splitlines()
                                 if x.lstrip().startswith("zigzag ") and "N=4" in x)
    row = next(r for r in tables.rows([base, ring, zigzag]) if r["Strategy"] == "ring")
    assert row["CP Efficiency (%)"] == row["TFLOPs/s"] == "-" and row["FWD+BWD (ms)"] == "20.00"
    assert [v.winner for v in verdicts([base, ring, zigzag])] == ["zigzag"]


# -- timings that do not measure CP -----------------------------------------------------------

def _env(rec: dict, **env) -> dict:
    rec = {**rec, "env": {**rec["env"], **env}}
    rec["derived"] = results.derive(rec)
    return rec


def test_ranks_sharing_cores_do_not_measure_cp():
    shared = _env(fake_record(), hostnames=["h"] * 4, cpus_usable=2)
    assert shared["derived"]["not_measured"] == "4 ranks share 2 cores: timings do not " \
                                                "measure CP"
    enough = _env(fake_record(), hostnames=["a", "a", "b", "b"], cpus_usable=2)
    assert enough["derived"]["not_measured"] is None  # two nodes of 2 ranks, 2 cores each
    threads = _env(fake_record(), launcher="threads", hostnames=["h"] * 4, cpus_usable=64)
    assert "threads sharing one device" in threads["derived"]["not_measured"]


def test_a_busy_host_does_not_measure_cp():
    def loaded(others_s, ranks_cores=2, cpus=2):
        return _with(fake_record(), load={"foreign_cpu_s": others_s, "wall_s": 10.0,
                                          "cpus": cpus, "share": others_s / 10 / cpus,
                                          "ranks_cores": ranks_cores})
    assert loaded(1.0)["derived"]["not_measured"] is None  # 0.1 cores: within 10 % of 2
    assert loaded(17.0)["derived"]["not_measured"] == (
        "others kept 1.7 of 2 cores busy: timings do not measure CP")
    # 16 cores, the ranks using 2: others may use the 14 left free
    assert loaded(130.0, ranks_cores=2, cpus=16)["derived"]["not_measured"] is None
    assert loaded(160.0, ranks_cores=2, cpus=16)["derived"]["not_measured"] is not None
    # both at once: both said
    both = _env(loaded(17.0), hostnames=["h"] * 4, cpus_usable=2)
    assert both["derived"]["not_measured"] == (
        "4 ranks share 2 cores; others kept 1.7 of 2 cores busy: timings do not measure CP")


def test_rows_not_measuring_cp_keep_their_times_and_print_no_efficiency_and_never_win():
    env = {"hostnames": ["h"] * 4, "cpus_usable": 2}
    base = _env(fake_record("local", ranks_per_problem=1, fwd_bwd=[[99.0, 100.0, 101.0]] * 4),
                **env)
    zigzag = _with_ideal(_env(fake_record("zigzag"), **env), 10.0, 15.0)
    ring = _env(fake_record("ring", fwd_bwd=[[40.0, 41.0, 42.0]] * 4), **env)
    text = report.summary([base, zigzag, ring])
    assert "not measuring CP: 4 ranks share 2 cores: timings do not measure CP (every row" in text
    assert "31.00" in text  # zigzag's FWD+BWD, as measured
    assert "CP efficiency = " not in text  # not printed for them
    row = next(line for line in text.splitlines() if line.lstrip().startswith("zigzag"))
    # no fraction of ideal (it was 81 %): "-" in every row, so no column
    assert "81" not in row and "Ideal" not in text
    assert verdicts([base, zigzag, ring]) == []
    assert "not ranked: zigzag" in best_table([base, zigzag, ring])
    # one row measured beside others that were not: the reason is that row's flag
    mixed = report.summary([fake_record("zigzag"), ring])
    assert "4 ranks share 2 cores: not CP" in mixed and "1 of 2 rows" in mixed


def _timed(warmup: int, iters: int) -> dict:
    rec = fake_record(fwd=[[10.0] * iters] * 4, fwd_bwd=[[30.0] * iters] * 4)
    rec["config"]["run"].update(warmup=warmup, iters=iters)
    return _with(rec, timing={"warmup": warmup, "settled": warmup > 0, "warmup_least": warmup})


def test_a_median_the_cold_first_step_can_move_is_flagged_and_never_wins():
    cold = _timed(0, 1)
    assert cold["derived"]["flags"] == [
        "cold: no warm-up, and the median of 1 step holds the first one's one-off costs "
        "(--warmup 1 or more)"]
    assert _timed(0, 2)["derived"]["flags"][0].startswith("cold: no warm-up, and the median "
                                                          "of 2 steps")
    # a warm-up, or 3 steps (the median sets one slow step aside): not cold
    assert _timed(1, 1)["derived"]["flags"] == _timed(0, 3)["derived"]["flags"] == []
    warm = fake_record("ring", fwd=[[20.0] * 3] * 4, fwd_bwd=[[60.0] * 3] * 4)
    assert [v.winner for v in verdicts([cold, warm])] == ["ring"]  # cold was faster
    assert "cold: no warm-up" in report.summary([cold, warm])


def _warmed(steps: list[float], settled: bool, warmup: int = 7) -> dict:
    """A row whose slowest rank's FWD+BWD steps are ``steps`` (FWD a third of each)."""
    rec = fake_record("ring", fwd=[[s / 3 for s in steps]] * 4, fwd_bwd=[list(steps)] * 4)
    rec["config"]["run"].update(warmup=2, iters=len(steps))
    return _with(rec, timing={"warmup": warmup, "settled": settled, "warmup_least": 2,
                              "warmup_most": 2 + len(steps)})


def test_an_unsettled_warm_up_is_flagged_only_where_the_timed_steps_still_fell():
    # this machine's ring at 1K on 4 ranks: never settled, the timed steps still falling
    falling = _warmed([262.4, 245.6, 98.3, 108.4, 114.3], settled=False)
    # first 2: median 254.00; last 3: median 108.40
    assert falling["derived"]["flags"] == [
        "unsettled: 7 warm-up steps, timed FWD+BWD still fell 254.00 to 108.40 ms "
        "(first 2, last 3)"]
    assert "fwd_bwd_tflops" in falling["derived"]["withheld"]
    # never settled, but the timed steps level within noise (most rows of a small machine)
    assert _warmed([88.7, 192.7, 94.1, 92.7, 292.2], settled=False)["derived"]["flags"] == []
    assert _warmed([372.2, 260.5, 246.4, 250.0, 263.1], settled=False)["derived"]["flags"] == []
    # settled, or too few timed steps to tell a trend from noise: no flag
    assert _warmed([262.4, 245.6, 98.3, 108.4, 114.3], settled=True)["derived"]["flags"] == []
    assert _warmed([262.4, 98.3, 108.4], settled=False)["derived"]["flags"] == []


def test_an_unsettled_row_never_wins_report_best():
    falling = _warmed([262.4, 245.6, 98.3, 108.4, 114.3], settled=False)  # median 114.3
    level = fake_record("zigzag", fwd=[[50.0] * 5] * 4, fwd_bwd=[[150.0] * 5] * 4)
    assert [v.winner for v in verdicts([falling, level])] == ["zigzag"]
    assert "\n[1] unsettled: 7 warm-up steps, timed" in report.summary([falling, level])
    assert [r["Flags"] for r in tables.rows([falling, level])][0].startswith("unsettled: 7")
