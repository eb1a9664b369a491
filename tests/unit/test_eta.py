"""The estimate as a run goes (``bench.eta``) and on a machine others keep busy
(``bench.estimate.loaded``): every figure computed by hand, the load meter and the clocks
stubbed, so nothing here depends on how busy this machine is."""

from __future__ import annotations

import dataclasses

import pytest

from cpbench.bench import estimate, eta
from cpbench.bench.load import Load
from cpbench.config import AttentionConfig, RunConfig

RATE = estimate.Rate(fwd=20e9, bwd=10e9, side=1024, kernel="sdpa-cpu", threads=1)
ATTN = AttentionConfig(batch=1, seqlen=8192, heads=8, head_dim=64, dtype="fp32", causal=True)
RUN = RunConfig(strategy=("zigzag",), warmup=2, iters=5).resolved("cpu")
CPU = estimate.Machine(device="cpu", local_ranks=2, threads_per_rank=1, cpus=2)


def test_others_keep_what_the_meter_saw_them_use():
    assert estimate.loaded(CPU, 0.5).others == 0.5 == estimate.loaded(CPU, 0.5).seen
    assert estimate.loaded(CPU, None) == CPU  # no meter: nothing counted
    gpu = estimate.Machine(device="cuda", local_ranks=8, threads_per_rank=1, cpus=2)
    assert estimate.loaded(gpu, 1.6) == gpu  # a GPU's rate is not the cores'


def test_a_ranks_share_is_its_part_of_what_others_leave():
    # idle: each of 2 ranks one of the 2 cores, as the probe had (its CPU time: a core)
    assert CPU.thread_share() == 1.0 and CPU.share(RATE) == 1.0
    # read beside the probe's one thread, the middle of two bounds for our 2: others on 0.5
    # of 2 cores leave 1.5, or their 0.5 thread and our 2 share the 2 cores, 2 * 2 / 2.5 =
    # 1.6 ours: 1.55, 0.775 each
    assert estimate.loaded(CPU, 0.5).thread_share() == pytest.approx(0.775)
    # on 1.6: 0.4 left, or their 4 threads (4 * 2 / 5 = 1.6) and our 2, 2 * 2 / 6 ours
    assert estimate.loaded(CPU, 1.6).thread_share() == pytest.approx((0.4 + 2 / 3) / 2 / 2)
    # read beside the ranks themselves: what others left them, 1 of 2 cores, 0.5 each
    busy_cpu = estimate.loaded(CPU, 1.0, beside=2)
    assert busy_cpu.thread_share() == 0.5 and busy_cpu.share(RATE) == 0.5
    # a full machine read as fuller than full: the least part, not nothing
    assert estimate.loaded(CPU, 2.5, beside=2).thread_share() == estimate.MIN_CORE
    # one thread of ours there: 1 core left, or their 2 threads (2 * 2 / 3 beside our 2)
    # and our 1, 2 / 3: 5 / 6
    alone = 5 / 6
    assert busy_cpu.alone(RATE) == pytest.approx(alone)
    # an imbalanced layout on shared cores: the slowest rank's 1.5 m at 5 / 6 of a core
    # (1.8 m), or both ranks' work at 0.5 each (2 m): the latter
    even = estimate.case_estimate(ATTN, RUN, 2, 1.0, RATE, busy_cpu, has_ideal=False)
    assert estimate.case_estimate(ATTN, RUN, 2, 1.5, RATE, busy_cpu, has_ideal=False
                                  ).step_s == pytest.approx(even.step_s)
    # and at 3 x, the slowest rank's: 3 m / (5 / 6) = 3.6 m against 2 m
    assert estimate.case_estimate(ATTN, RUN, 2, 3.0, RATE, busy_cpu, has_ideal=False
                                  ).step_s == pytest.approx(1.8 * even.step_s)
    # so a step is twice the idle one's; the set-up, every rank at once, at half a core
    idle = estimate.case_estimate(ATTN, RUN, 2, 1.0, RATE, CPU, has_ideal=False)
    assert even.step_s == pytest.approx(idle.step_s * 2)
    # busy: the warm-up 3 / 4 of the way from 3 to 2 + 5, 6, against the idle middle, 5;
    # the memory step
    assert even.case_s == pytest.approx(estimate.CASE_SETUP_S / 0.5 + even.step_s * 12)
    assert idle.case_s == pytest.approx(estimate.CASE_SETUP_S + idle.step_s * (5 + 5 + 1))
    assert idle.parts == pytest.approx({"setup": estimate.CASE_SETUP_S + idle.step_s,
                                        "steps": 10 * idle.step_s, "check": 0.0, "ideal": 0.0})
    assert idle.counts == (5, 5) and idle.ranks == 2
    # others on 1.6 cores beside the probe's thread: each rank (0.4 + 2 / 3) / 4 of a core
    # (above), the set-up 3.75 x
    fuller = estimate.case_estimate(ATTN, RUN, 2, 1.0, RATE, estimate.loaded(CPU, 1.6),
                                    has_ideal=False)
    assert fuller.case_s == pytest.approx(3.75 * estimate.CASE_SETUP_S + fuller.step_s * 12)
    # the ideal block on rank 0 alone, 1 / 4 of the problem (half the idle step) at 5 / 6
    # of a core, warmed up 2 and timed 5 times
    ideal = estimate.case_estimate(ATTN, RUN, 2, 1.0, RATE, busy_cpu, has_ideal=True)
    assert ideal.case_s - even.case_s == pytest.approx(idle.step_s / 2 / alone * (2 + 5))


def test_the_warm_up_the_settle_rule_is_expected_to_run():
    def steps(warmup, iters, seen=0.0):
        run = RunConfig(strategy=("zigzag",), warmup=warmup, iters=iters).resolved("cpu")
        return estimate.warmup_steps(run, estimate.loaded(CPU, seen))

    # idle: between the first it can stop at (3 settled steps) and its most, rounded up
    assert steps(2, 5) == 5  # (3 + 7) / 2
    assert steps(1, 3) == 4  # (3 + 4) / 2 = 3.5
    assert steps(5, 5) == 8  # (5 + 10) / 2 = 7.5
    assert steps(0, 5) == 0  # none asked: none run
    assert steps(2, 5, seen=0.2) == 6  # others on a tenth of the cores: (3 + 3 x 7) / 4
    assert steps(1, 3, seen=0.2) == 4  # (3 + 3 x 4) / 4 = 3.75
    assert steps(2, 5, seen=0.1) == 5  # under a tenth: idle


def test_the_busy_machine_is_said():
    assert estimate.loaded(CPU, 1.6).busy_text() == "others keep 1.6 of 2 cores busy"
    assert estimate.loaded(CPU, 0.1).busy_text() == ""  # under a tenth of the cores


class _Meter:
    def __init__(self, cores: float):
        self.load = Load(foreign_cpu_s=cores * 2.0, wall_s=2.0, cpus=2)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_planned_counts_start_up_and_the_load(monkeypatch):
    monkeypatch.setattr(estimate, "probe", lambda *a, **k: RATE)  # a fixed rate
    monkeypatch.setattr(estimate, "PLAN_METER_S", 0.0)  # the stub meter's reading at once
    pr = estimate.Problem(label="zigzag", attn=ATTN, ranks_per_problem=2, imbalance=1.0,
                          kernel="sdpa-cpu", has_ideal=False)
    run = dataclasses.replace(RUN, max_minutes=0)  # no limit: the estimate alone
    (est,) = eta.planned([pr], run, CPU, "self", meter=lambda: _Meter(1.6), age_s=3.0)
    # --nproc: this process's 3 s so far, and the forkserver's import as long again
    assert est.start_s == 6.0 and est.busy == "others keep 1.6 of 2 cores busy"
    # others on 1.6 of 2 cores: a rank (0.4 + 2 / 3) / 4 of a core (above), the probe's CPU
    # time a whole one
    idle = estimate.case_estimate(ATTN, RUN, 2, 1.0, RATE, CPU, has_ideal=False)
    assert est.step_s == pytest.approx(idle.step_s * 4 / (0.4 + 2 / 3))
    # the case: set-up and the first case's at a rank's part of a core, 3.75x, and
    # 6 + 5 + 1 steps (busy: warm-up 3 / 4 of the way from 3 to 7)
    assert est.case_s == pytest.approx(
        3.75 * (estimate.CASE_SETUP_S + estimate.FIRST_CASE_S + estimate.FIRST_STEPS_S)
        + 12 * est.step_s)
    line = eta.total_line([est])
    assert line.startswith(f"estimated {estimate.duration(6.0 + est.case_s)} in all (6 s of "
                           f"start-up; sdpa-cpu at 0.02 / 0.01 TFLOP/s")
    assert line.endswith("others keep 1.6 of 2 cores busy: estimated on what they leave)")


def test_the_plans_load_reading_lasts_its_least_window(monkeypatch):
    monkeypatch.setattr(estimate, "probe", lambda *a, **k: RATE)
    pr = estimate.Problem(label="zigzag", attn=ATTN, ranks_per_problem=2, imbalance=1.0,
                          kernel="sdpa-cpu", has_ideal=False)
    ticks = iter([0.0, 0.4, 0.8, 1.2, 99.0])  # the start, then each look at the clock
    got = estimate.under_load([pr], RUN, CPU, lambda: _Meter(0.5), least_s=1.0,
                              clock=lambda: next(ticks))
    assert got.others == 0.5 and next(ticks) == 99.0  # read until 1.2 s, not past


def test_start_up_is_this_processs_age():
    assert eta.process_age_s(now=lambda: 105.5, started=lambda: 100.0) == 5.5
    assert eta.startup_s(5.5, "self") == 11.0  # and the forkserver's import of torch
    assert eta.startup_s(5.5, "threads") == eta.startup_s(5.5, "torchrun") == 5.5
    assert eta.startup_s(None, "self") == 0.0  # no /proc: nothing to read


def _planned(*case_s: float) -> list[estimate.Estimate]:
    return [estimate.Estimate(step_s=s / 10, case_s=s, rate=RATE) for s in case_s]


def test_what_is_left_is_re_estimated_from_what_the_cases_took():
    tally = eta.Tally(_planned(10.0, 20.0, 30.0))
    assert tally.before(0).case_s == 10.0 and tally.left_s(0) == 60.0  # as planned
    first = tally.after(0, 15.0)  # took 1.5x its plan
    assert (first["case_s"], first["revised_s"], first["took_s"]) == (10.0, 10.0, 15.0)
    assert tally.before(1).case_s == 30.0 and tally.before(1).step_s == 3.0
    assert tally.left_s(1) == 75.0  # (20 + 30) x 1.5
    second = tally.after(1, 20.0)  # the cases so far: 35 s against 30 planned
    assert second["revised_s"] == 30.0 and second["scale"] == 1.5
    assert tally.before(2).case_s == pytest.approx(30.0 * 35 / 30)
    record: dict = {}
    assert tally.done(2, record, 33.0) == 33.0 and record["estimate"]["took_s"] == 33.0
    assert eta.Tally(()).before(0) is None and eta.Tally(()).after(0, 1.0) is None
    unplanned = eta.Tally(())  # the threads launcher's: every case after the first too
    assert [unplanned.after(i, 1.0, {"wall_s": 1.0, "foreign_cpu_s": 0.5}) for i in range(3)] \
        == [None, None, None]


def _priced(*case_s: float) -> list[estimate.Estimate]:
    return [estimate.Estimate(step_s=s / 10, case_s=s, rate=RATE, machine=CPU) for s in case_s]


def _load(cores: float, wall_s: float = 10.0) -> dict:
    return {"foreign_cpu_s": cores * wall_s, "wall_s": wall_s, "cpus": 2}


def test_each_later_case_is_priced_at_the_load_the_cases_met():
    tally = eta.Tally(_priced(10.0, 10.0, 10.0, 10.0))  # planned on 2 idle cores
    # the first met others on 1 of the 2 cores: each rank half a core, so its plan at that
    # load is 20 s; it took 20 s: the model's error 1
    tally.after(0, 20.0, _load(1.0))
    assert tally.scale() == 1.0
    # the next at the load the done cases met beside their ranks (not the plan's, read
    # beside one thread): 20 s
    assert tally.before(1).case_s == pytest.approx(20.0)
    # it met 1 core busy too, and took 30 s: planned 20 s at that load, so far 50 s
    # against 40 s: x 1.25; the median now 1: 20 s, x 1.25
    tally.after(1, 30.0, _load(1.0))
    assert tally.scale() == pytest.approx(1.25)
    assert tally.before(2).case_s == pytest.approx(25.0)
    assert tally.left_s(2) == pytest.approx(50.0)
    # a case met a burst (1.6 of 2 cores busy, 0.2 a rank): the median stays at 1; had
    # the re-estimate known that load, it would have said 10 / 0.2 x 1.25
    burst = tally.after(2, 60.0, _load(1.6))
    assert burst["revised_s"] == pytest.approx(25.0)
    assert burst["at_load_s"] == pytest.approx(50.0 * 1.25)
    assert tally.before(3).case_s == pytest.approx(
        20.0 * (50 + 60) / (20 + 20 + 10.0 / 0.2))  # its plan there: 10 / 0.2
    # no reading: the plan stands for that case
    other = eta.Tally(_priced(10.0, 10.0))
    other.after(0, 12.0, None)
    assert other.before(1).case_s == pytest.approx(12.0)


def test_the_detail_block_says_the_plan_the_re_estimate_and_what_it_took():
    from test_results import fake_record

    from cpbench import report

    rec = fake_record()
    tally = eta.Tally(_planned(10.0, 20.0))
    tally.after(0, 15.0)
    rec["estimate"] = {**tally.after(1, 27.0), "probe": "a probe"}
    assert ("  - Estimated Beforehand: 2 s a step, 20 s for the case; 30 s re-estimated after "
            "the cases before it, took 27 s (a probe)") in report.detail(rec)


def test_on_a_gpu_the_simulators_preset_prices_what_is_beyond_the_kernel(monkeypatch):
    from cpbench.sim import comm_estimate, hardware, model
    from cpbench.strategies.zigzag import Zigzag
    from cpbench.topology import Topology

    assert [comm_estimate.preset_for(n) for n in (
        "NVIDIA H200", "NVIDIA GB200", "NVIDIA B200", "NVIDIA A100-SXM4-80GB", "Tesla V100",
        None)] == ["h200-sxm", "gb200-nvl72", "b200", "a100-sxm", None, None]
    comm = comm_estimate.for_device("NVIDIA H800")
    attn = AttentionConfig(seqlen=65536, heads=32, kv_heads=8, head_dim=128, dtype="bf16")
    topo = Topology(world_size=8, ranks_per_node=8)
    p = model.predict("zigzag", Zigzag.Options(), attn, topo, hardware.load("h800-sxm"))
    assert comm("zigzag", Zigzag.Options(), attn, topo) == (p.fwd_s - p.fwd_compute_s,
                                                             p.bwd_s - p.bwd_compute_s)
    # the estimate's step: the kernel's share, then what the preset adds (fwd-only: its FWD)
    gpu = estimate.Machine(device="cuda", local_ranks=8, threads_per_rank=1, cpus=16)
    run = RunConfig(strategy=("zigzag",), warmup=2, iters=5).resolved("cuda")
    bare = estimate.case_estimate(attn, run, 8, 1.0, RATE, gpu, has_ideal=False)
    priced = estimate.case_estimate(attn, run, 8, 1.0, RATE, gpu, has_ideal=False,
                                    extra=(0.25, 0.5))
    assert priced.step_s == pytest.approx(bare.step_s + 0.75)
    # and the first line says which preset, or that none matched
    monkeypatch.setattr(estimate, "probe", lambda *a, **k: RATE)
    pr = estimate.Problem(label="zigzag", attn=attn, ranks_per_problem=8, imbalance=1.0,
                          kernel="sdpa", has_ideal=False, extra_s=(0.25, 0.5))
    run = RunConfig(strategy=("zigzag",), max_minutes=0).resolved("cuda")
    (named,) = eta.planned([pr], run, gpu, "torchrun", meter=lambda: _Meter(0.0), age_s=1.0,
                           comm=comm)
    assert "beyond the kernel: the simulator's h800-sxm preset" in eta.total_line([named])
    (none,) = eta.planned([pr], run, gpu, "torchrun", meter=lambda: _Meter(0.0), age_s=1.0)
    assert "beyond the kernel: not counted, no simulator preset" in eta.total_line([none])


def _parted(setup: float, ranks: int) -> estimate.Estimate:
    parts = {"setup": setup, "steps": 10.0, "check": 0.0, "ideal": 1.0}
    return estimate.Estimate(step_s=1.0, case_s=sum(parts.values()), rate=RATE, parts=parts,
                             counts=(5, 5), ranks=ranks)


def test_each_part_is_re_estimated_from_what_it_took():
    # planned: set-up 2 s (3 the first), 5 warm-up and 5 timed steps of 1 s, the ideal 1 s;
    # the second and the fourth one rank a problem (no communication in their steps)
    tally = eta.Tally([_parted(3.0, 2), _parted(2.0, 1), _parted(2.0, 2), _parted(2.0, 1)])
    record = {"estimate": {"parts_s": {"build": 0.5, "memory": 2.5, "warmup": 3.0,
                                       "timed": 10.0, "ideal": 2.0}},
              "timing": {"warmup": 3}}
    tally.done(0, record, 20.0)
    # what the marks did not see is "other": 20 - 18 = 2, the set-up's with build, memory
    assert record["estimate"]["parts_s"]["other"] == pytest.approx(2.0)
    # set-up 5 over 3: 5 / 3; steps 13 s for the 3 + 5 it ran, 8 planned: 1.625; ideal 2
    # the next at the mean of the plan's warm-up and the first's, (5 + 3) / 2: steps
    # 9 x 1.625; 2 x 5 / 3; 1 x 2
    nxt = tally.before(1)
    assert nxt.case_s == pytest.approx(9 * 1.625 + 2 * 5 / 3 + 2.0)
    assert nxt.step_s == pytest.approx(1.625)
    tally.done(1, {"estimate": {"parts_s": {"build": 1.0, "warmup": 5.0, "timed": 6.0,
                                            "ideal": 1.0}}, "timing": {"warmup": 5}}, 15.0)
    # the set-up from the second alone now (the first paid its first calls): 3 / 2; the
    # ideal (2 + 1) / (1 + 1); the warm-up the mean of 5, 3 and 5: 13 / 3 (+ 5 timed);
    # steps by the cases of as many ranks a problem: the third's by the first's, 13 / 8,
    # the fourth's by the second's, 11 s for 5 + 5 planned 10
    steps = 13 / 3 + 5
    assert tally.before(2).case_s == pytest.approx(steps * 13 / 8 + 2 * 1.5 + 1.5)
    assert tally.before(3).case_s == pytest.approx(steps * 11 / 10 + 2 * 1.5 + 1.5)
    assert tally.left_s(2) == pytest.approx(steps * (13 / 8 + 11 / 10) + 2 * (3 + 1.5))


def test_the_case_says_when_each_of_its_parts_began(monkeypatch):
    from cpbench.bench import steps

    clock = iter([10.5, 11.0, 11.0, 13.0, 14.0])  # each part's start; a step goes on one
    monkeypatch.setattr(steps.time, "monotonic", lambda: next(clock))
    pace = steps.Pace(None, t0=10.0)
    for text in ("building groups", "drawing this rank's inputs", "timing FWD and BWD",
                 "warm-up step 1 (at most 7, until the time settles)", "timed step 1/5",
                 "writing the record"):
        assert pace.mark(text) == text
    # "timing FWD and BWD" and its warm-up steps are one part; the end at 15
    assert pace.parts_s(15.0) == {"other": 0.5, "build": 0.5, "inputs": 0.0,
                                  "warmup": 2.0, "timed": 1.0, "record": 1.0}
    assert steps.part_of("timing the ideal block alone") == "ideal"
    assert steps.part_of("timing FWD alone (FWD+BWD ran out of memory)") == "timed"
    assert steps.part_of("something else") == "other"
