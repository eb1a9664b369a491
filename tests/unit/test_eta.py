"""The estimate as a run goes (``bench.eta``) and on a machine others keep busy
(``bench.estimate.loaded``): every figure computed by hand, the load meter and the clocks
stubbed, so nothing here depends on how busy this machine is."""

from __future__ import annotations

import pytest

from cpbench.bench import estimate, eta
from cpbench.bench.load import Load
from cpbench.config import AttentionConfig, RunConfig

RATE = estimate.Rate(fwd=20e9, bwd=10e9, side=1024, kernel="sdpa-cpu", threads=1)
ATTN = AttentionConfig(batch=1, seqlen=8192, heads=8, head_dim=64, dtype="fp32", causal=True)
RUN = RunConfig(strategy=("zigzag",), warmup=2, iters=5).resolved("cpu")
CPU = estimate.Machine(device="cpu", local_ranks=2, threads_per_rank=1, cpus=2)


def test_others_demand_from_what_the_meter_saw_beside_the_probe():
    # 0.5 of 2 cores beside the probe's one thread: room for both, 0.5 asked
    assert estimate.loaded(CPU, 0.5).others == 0.5
    # 1.6 of 2: d threads shared the cores with the probe's, d * 2 / (d + 1) = 1.6: d = 4
    assert estimate.loaded(CPU, 1.6).others == pytest.approx(4.0)
    assert estimate.loaded(CPU, 2.5).others == 8.0  # all of them: capped at 4 x 2 cores
    assert estimate.loaded(CPU, None) == CPU  # no meter: nothing counted
    gpu = estimate.Machine(device="cuda", local_ranks=8, threads_per_rank=1, cpus=2)
    assert estimate.loaded(gpu, 1.6) == gpu  # a GPU's rate is not the cores'


def test_a_ranks_share_counts_others_threads():
    # idle: each of 2 ranks one of the 2 cores, as the probe had
    assert CPU.share(RATE) == 1.0
    # others ask for 2 cores: 4 threads on 2 cores, a rank 0.5; the probe had 2 / 3
    assert estimate.loaded(CPU, 4 / 3).share(RATE) == pytest.approx(0.5 / (2 / 3))
    # so a step is 4/3 the idle one's: its rate measured at 2/3 of a core, the rank's 1/2
    busy = estimate.case_estimate(ATTN, RUN, 2, 1.0, RATE, estimate.loaded(CPU, 4 / 3),
                                  has_ideal=False)
    idle = estimate.case_estimate(ATTN, RUN, 2, 1.0, RATE, CPU, has_ideal=False)
    assert busy.step_s == pytest.approx(idle.step_s * 4 / 3)


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
    pr = estimate.Problem(label="zigzag", attn=ATTN, ranks_per_problem=2, imbalance=1.0,
                          kernel="sdpa-cpu", has_ideal=False)
    (est,) = eta.planned([pr], RUN, CPU, "self", meter=lambda: _Meter(1.6), age_s=3.0)
    # --nproc: this process's 3 s so far, and the forkserver's import as long again
    assert est.start_s == 6.0 and est.busy == "others keep 1.6 of 2 cores busy"
    # others ask for 4 threads: a rank 2 / 6 of a core, the probe had 2 / 5: step x 6/5
    idle = estimate.case_estimate(ATTN, RUN, 2, 1.0, RATE, CPU, has_ideal=False)
    assert est.step_s == pytest.approx(idle.step_s * (2 / 5) / (2 / 6))
    line = eta.total_line([est])
    assert line.startswith(f"estimated {estimate.duration(6.0 + est.case_s)} in all (6 s of "
                           f"start-up; sdpa-cpu at 0.02 / 0.01 TFLOP/s")
    assert line.endswith("others keep 1.6 of 2 cores busy: estimated on what they leave)")


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
