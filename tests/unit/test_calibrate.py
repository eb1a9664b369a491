"""cpbench calibrate's pieces without processes: the link fit, the partners, the preset it
writes (loaded by the simulator), and causal curves in the model."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from cpbench import metrics
from cpbench.config import AttentionConfig
from cpbench.sim import hardware, model, preset_file
from cpbench.sim.calibrate import TINY, Spec, _partners, fit_line
from cpbench.topology import Topology

SPEC = Spec(device="cpu", dtype="fp32", heads=8, head_dim=64, sides=(256, 1024),
            ranks_per_node=2)


def test_fit_line_recovers_latency_and_bandwidth():
    lat_us, gbs = 50.0, 2.0
    points = [(n, lat_us / 1e3 + n / (gbs * 1e9) * 1e3) for n in (4096, 65536, 1 << 20, 16 << 20)]
    got_lat, got_gbs = fit_line(points)
    assert got_lat == pytest.approx(lat_us, rel=1e-6) and got_gbs == pytest.approx(gbs, rel=1e-6)


def test_partners_pair_inside_a_node_and_across_nodes():
    assert _partners(0, 2, 2) == (1, None)  # one node of two
    assert _partners(1, 2, 1) == (None, 0)  # two nodes of one
    assert [_partners(r, 8, 4) for r in (0, 3, 5)] == [(1, 4), (2, 7), (4, 1)]
    assert _partners(2, 3, 3) == (None, None)  # the odd one out waits


def _measured(overhead_ms=0.1, fwd_rate=50e9):
    def times(causal):
        out = {} if causal else {TINY: (overhead_ms, 3 * overhead_ms)}
        for side in SPEC.sides:
            f = metrics.attention_flops(batch=1, seqlen_q=side, seqlen_k=side, heads=8,
                                        head_dim=64, causal=causal)
            out[side] = (overhead_ms + f / fwd_rate * 1e3,
                         overhead_ms + 2.5 * f / fwd_rate * 1e3)  # FWD, BWD alone
        return out

    link = [(n, 0.05 + n / 1e9 * 1e3) for n in (4096, 1 << 20, 16 << 20)]
    env = {"utc": "2026-01-01T00:00:00Z", "hostnames": ["h"], "torch": "2.x",
           "device_name": "test cpu"}
    return {"kernel_ms": {False: times(False), True: times(True)},
            "links_ms": {"intra": link, "all_to_all": link}, "env": env, "world": 2,
            "probe_ms": {"before": (20.0, 19.0), "after": (21.0, 20.0), "tries": 1,
                         "steady": True},
            "sharing": {"overlapped": 1.3, "idle_speedup": 1.1, "clamped": {}},
            "load": {"share": 0.012, "wall_s": 41.0, "limit": 0.1, "busy": False},
            "passes_ms": {"merge": link, "accumulate": link},
            "threads_per_rank": 1}


def test_the_written_preset_loads_and_says_what_was_measured(tmp_path):
    text = preset_file.render(_measured(), SPEC, memory_gib=8.0)
    path = tmp_path / "cpu.yaml"
    path.write_text(text)
    hw = hardware.load(str(path))
    assert hw.dtypes == ("fp32",) and hw.step_overhead_us == pytest.approx(100.0)
    # the curve is the rate of what is left after the overhead: the rate the times were made at
    assert hw.kernel_fwd.tflops(1024) == pytest.approx(0.05, rel=1e-3)
    assert hw.kernel_bwd.tflops(256) == pytest.approx(0.05, rel=1e-3)
    assert hw.kernel("fwd", causal=True) is hw.kernel_fwd_causal
    assert hw.intra.bandwidth_gbs == pytest.approx(1.0, rel=1e-2)
    assert hw.intra.latency_us == pytest.approx(50.0, rel=1e-2)
    assert "not measured (one node)" in text  # the inter-node figures are said to be copies
    data = yaml.safe_load(text)
    assert set(data) >= {"kernel", "intra_node", "inter_node", "memory_gib", "name"}
    assert text.count("measured 2026-01-01T00:00:00Z") >= 4
    # the header says the statistic the code takes (the fastest), not a median
    header = "".join(line for line in text.splitlines() if line.startswith("#"))
    assert "fastest" in header and "median" not in header
    assert "of sides 256,1024" in header
    assert data["load"] == {"share": 0.012, "wall_s": 41, "limit": 0.1, "busy": False}
    assert hw.calibration_load == pytest.approx(0.012) and "BUSY" not in text


def test_a_busy_calibration_and_a_clamped_reading_are_said_in_the_preset(tmp_path):
    measured = _measured()
    measured["load"] = {"share": 0.31, "wall_s": 40.0, "limit": 0.1, "busy": True}
    measured["sharing"] = {"overlapped": 0.0, "idle_speedup": 1.0,
                           "clamped": {"overlapped": -0.42, "idle_speedup": 0.93}}
    text = preset_file.render(measured, SPEC, memory_gib=8.0)
    path = tmp_path / "busy.yaml"
    path.write_text(text)
    assert hardware.load(str(path)).calibration_load == pytest.approx(0.31)
    assert "BUSY: above calibrate's limit; the self-check refuses a share above its own" in text
    line = next(x for x in text.splitlines() if x.startswith("overlapped:"))
    assert "CLAMPED: measured -0.42, the model takes >= 0" in line
    line = next(x for x in text.splitlines() if x.startswith("idle_speedup:"))
    assert "CLAMPED: measured 0.93, the model takes >= 1" in line
    assert preset_file.clamp_lines(measured) == [
        "overlapped measured -0.42, written as 0 (the model's range); a reading outside it "
        "says the machine was not steady",
        "idle_speedup measured 0.93, written as 1 (the model's range); a reading outside it "
        "says the machine was not steady"]


def test_the_simulator_predicts_a_cpu_problem_with_a_measured_preset(tmp_path):
    path = tmp_path / "cpu.yaml"
    path.write_text(preset_file.render(_measured(), SPEC, memory_gib=8.0))
    hw = hardware.load(str(path))
    attn = AttentionConfig(seqlen=2048, heads=8, head_dim=64, dtype="fp32", causal=True)
    p = model.predict("zigzag", _options("zigzag"), attn,
                      Topology(world_size=2, ranks_per_node=1), hw)
    # by hand from the model's formula and _measured's figures (0.05 TFLOP/s on every curve,
    # 0.1 ms a step, links 50 us + bytes at 1 GB/s, passes 50 us + 1 ns an element,
    # overlapped 1.3; one rank a node: no idle speed-up). Zigzag on 2 ranks at 2048: each
    # rank holds 1024 tokens (8 heads x 64: 524288 elements, 2 MiB of K and of V in fp32).
    # Step 0: its causal diagonal, 1024 x 1024 / 2 pairs = 2^30 FLOPs, and K, V to the next
    # rank (both neighbours on the other node) while it computes; step 1: a 512 x 1024 block,
    # the rank holding 1024 query rows merges all of them.
    kernel = 2 ** 30 / 0.05e12 * 1e3 + 0.1  # ms
    merge = 0.05 + 1024 * 8 * 64 * 1e-6
    exchange = 2 * 2 * 2 ** 20 / 1e9 * 1e3 + 0.05
    assert p.fwd_s * 1e3 == pytest.approx((kernel + merge + 1.3 * exchange) + (kernel + merge),
                                          rel=1e-9)
    # the no-CP baseline on a block the curve measured gives back the time measured there
    # (_measured: 0.1 ms + FLOPs at 0.05 TFLOP/s), plus its merge / gradient passes
    full = dataclasses.replace(attn, seqlen=1024, causal=False)
    p = model.predict("local", _options("local"), full,
                      Topology(world_size=2, ranks_per_node=1), hw)
    fwd_ms, bwd_ms = _measured()["kernel_ms"][False][1024]
    assert p.fwd_s * 1e3 == pytest.approx(fwd_ms + merge, rel=1e-9)
    assert p.bwd_s * 1e3 == pytest.approx(bwd_ms + 3 * merge, rel=1e-9)  # dq, dk, dv sums


def _options(name):
    from cpbench import strategies

    return strategies.get(name).Options()


def test_a_slower_causal_curve_slows_only_diagonal_blocks():
    base = hardware.load("a800-sxm")
    half = hardware.KernelCurve(tuple((s, t / 2) for s, t in base.kernel_fwd.points))
    slow = dataclasses.replace(base, kernel_fwd_causal=half)
    topo = Topology(world_size=8, ranks_per_node=8)
    causal = AttentionConfig(seqlen=65536, heads=40, head_dim=128, dtype="bf16", causal=True)
    full = dataclasses.replace(causal, causal=False)
    for attn, slower in ((causal, True), (full, False)):
        a = model.predict("zigzag", _options("zigzag"), attn, topo, base)
        b = model.predict("zigzag", _options("zigzag"), attn, topo, slow)
        assert (b.fwd_s > a.fwd_s * 1.01) is slower and b.bwd_s == pytest.approx(a.bwd_s)


@pytest.mark.parametrize("nproc,grid", [(2, (256, 384, 768, 1536, 3072, 6144)),
                                         (4, (384, 768, 1536, 3072, 6144))])
def test_the_default_cpu_curve_holds_no_side_of_the_self_checks_blocks(nproc, grid):
    """calibrate's default grid (CPU) and the self-check's blocks at its default lengths are
    apart, each block at least 5 % from every point: the check is scored out of sample (on 4
    ranks its blocks of 256 tokens drop that point)."""
    from cpbench.cli.calibrate import _cpu_sides
    from cpbench.config import CPU_ATTENTION
    from cpbench.sim import selfcheck
    from cpbench.sim.calibrate import _probe_sides

    blocks = selfcheck.block_sides({**CPU_ATTENTION, "heads": selfcheck.HEADS},
                                   selfcheck.SEQLENS, nproc)
    assert len(blocks) >= 10 and _cpu_sides(nproc) == grid
    assert all(abs(b / s - 1) >= 0.05 for b in blocks for s in grid), blocks
    assert _probe_sides(dataclasses.replace(SPEC, sides=grid)) == (768, 1536, 3072)


def test_calibrate_says_on_stderr_when_the_preset_is_busy_or_unread():
    from cpbench.cli.calibrate import _load_warning

    assert _load_warning({"share": 0.05, "wall_s": 30.0, "limit": 0.1, "busy": False}) == []
    (busy,) = _load_warning({"share": 0.31, "wall_s": 30.0, "limit": 0.1, "busy": True})
    assert busy.startswith("other processes used 31 % of the cores while it measured (limit "
                           "10 %, --load-limit): the preset is marked busy")
    (unread,) = _load_warning(None)
    assert "no load reading" in unread
