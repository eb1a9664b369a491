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
    fast = _with(fake_record("zigzag", fwd_bwd=[[1.0, 1.0, 1.0]] * 4),
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
    assert fast["derived"]["fwd_bwd_tflops"] > 989.4
    assert fast["derived"]["flags"] == [
        f"impossible: above peak (FWD+BWD {fast['derived']['fwd_bwd_tflops']:.0f} TFLOP/s "
        f"per device > 989.4 bf16 dense)"]


def test_the_peak_is_the_dtypes():
    rate = _on("NVIDIA A100-SXM4-80GB", "fp32", 1.0)["derived"]["fwd_bwd_tflops"]
    ms = rate / 200.0  # 200 TFLOP/s: possible in bf16 (312), not in fp32 (TF32 156)
    assert _on("NVIDIA A100-SXM4-80GB", "bf16", ms)["derived"]["flags"] == []
    flags = _on("NVIDIA A100-SXM4-80GB", "fp32", ms)["derived"]["flags"]
    assert flags[-1] == "impossible: above peak (FWD+BWD 200 TFLOP/s per device > 156 fp32 " \
                        "dense)"


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
    """``record`` as if its ranks ran as threads on one device (with its samples kept, as
    a later reason for not measuring may keep them)."""
    return _with(record, env={**record["env"], "launcher": "threads"})


def test_rows_of_threads_show_no_figure_and_say_why():
    base = _threaded(fake_record("local", ranks_per_problem=1, fwd=[[20.0] * 3] * 4,
                                 fwd_bwd=[[62.0] * 3] * 4))
    row = _threaded(fake_record("zigzag", check=[]))
    assert guards.not_measured(row) == guards.THREADS
    assert row["derived"]["not_measured"] == guards.THREADS
    assert row["derived"]["flags"] == [guards.THREADS]
    assert fake_record()["derived"]["not_measured"] is None
    cells = {r["Strategy"]: r for r in tables.rows([row, base])}
    for name in ("zigzag", "local"):
        assert [cells[name][c] for c in ("FWD (ms)", "FWD+BWD (ms)", "Memory (MB)",
                                         "TFLOPs/s", "CP Efficiency (%)")] == ["-"] * 5
        assert cells[name]["Flags"] == guards.THREADS
    assert report.efficiencies([row, base]) == []  # no baseline among them
    assert tables.cell_ms(10.0, row) == "-" and tables.cell_ms(10.0, fake_record()) == "10.00"
    measured = fake_record("ring")
    assert [v.winner for v in verdicts([row, measured])] == ["ring"]
    assert "not ranked: zigzag" in best_table([row, measured])
    detail = report.detail(row)
    assert f"Times and memory: - ({guards.THREADS})" in detail
    assert "Iterations: none timed" in detail and "Forward Time" not in detail
