"""The simulator's timing and memory model against hand-computed cases: a machine whose links
are free prices only the kernels, one whose kernels are free prices only the messages, and
the NIC sharing, overlap windows, lock-step imbalance and re-scaling rules of
``cpbench.sim.model`` each change the prediction exactly as the formulas say."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cpbench import strategies
from cpbench.config import AttentionConfig
from cpbench.metrics import attention_flops
from cpbench.sim import hardware, model, schedule
from cpbench.topology import Topology

FAST = 1e15  # GB/s or TFLOP/s: too fast to matter

H, D = 8, 64


def machine(*, tflops=FAST, intra=FAST, inter=FAST, node=FAST, overhead_us=0.0,
            latency_us=0.0, memory_gib=80.0, fwd=None, bwd=None) -> hardware.Hardware:
    flat = [[1, tflops], [2, tflops]]
    return hardware.from_dict({
        "name": "test", "gpus_per_node": 4, "nodes": 2, "memory_gib": memory_gib,
        "peak_tflops_bf16": 2 * FAST,
        "kernel": {"fwd": fwd or flat, "bwd": bwd or flat, "step_overhead_us": overhead_us},
        "intra_node": {"bandwidth_gbs": intra, "latency_us": latency_us},
        "inter_node": {"bandwidth_gbs_per_gpu": inter, "node_bandwidth_gbs": node,
                       "latency_us": latency_us}})


def problem(seqlen=4096, causal=True, **kw) -> AttentionConfig:
    return AttentionConfig(**{**dict(batch=1, seqlen=seqlen, heads=H, head_dim=D,
                                     dtype="bf16", causal=causal), **kw})


def predict(name, attn, world, rpn, hw, **opts):
    cls = strategies.get(name)
    return model.predict(name, cls.Options(**opts), attn, Topology(world_size=world,
                                                                   ranks_per_node=rpn), hw)


def flops(attn, mode="fwd"):
    return attention_flops(batch=attn.batch, seqlen_q=attn.seqlen, seqlen_k=attn.seqlen,
                           heads=attn.heads, head_dim=attn.head_dim, causal=attn.causal,
                           mode=mode)


@pytest.fixture(autouse=True)
def cold():
    model.clear_cache()
    yield
    model.clear_cache()


def test_kernel_curve_is_log_linear_between_points_and_flat_beyond():
    c = hardware.KernelCurve(((1024.0, 100.0), (4096.0, 200.0)))
    assert c.tflops(1024) == 100 and c.tflops(4096) == 200
    assert c.tflops(2048) == pytest.approx(150)  # halfway in log2
    assert c.tflops(10) == 100 and c.tflops(1e6) == 200
    with pytest.raises(ValueError, match="increasing"):
        hardware.KernelCurve(((4096.0, 1.0), (1024.0, 2.0)))


def test_every_preset_loads_and_an_unknown_one_points_to_the_list():
    for name in hardware.names():
        hw = hardware.load(name)
        assert hw.kernel_fwd.tflops(1e9) <= hw.peak_tflops
    assert {"a100-sxm", "a800-sxm", "b200", "gb200-nvl72", "h100-sxm", "h200-sxm",
            "h800-sxm"} <= set(hardware.names())
    with pytest.raises(ValueError, match="unknown preset 'tpu-v9'.*--list-hardware lists them"):
        hardware.load("tpu-v9")  # the names pass 120 columns: the list is where they are
    with pytest.raises(ValueError, match="did you mean h100-sxm"):
        hardware.load("h10-sxm")


def test_a_kernel_faster_than_the_peak_is_rejected():
    with pytest.raises(ValueError, match="above the peak"):
        machine(fwd=[[1, 3 * FAST], [2, 3 * FAST]])


@pytest.mark.parametrize("name", ["zigzag", "megatron-cp", "double-ring", "burst"])
def test_free_links_balanced_strategies_cost_their_share_of_the_flops(name):
    """Zigzag-layout strategies give every rank 1/N of the work at every step."""
    attn, rate = problem(), 100.0
    p = predict(name, attn, 8, 4, machine(tflops=rate))
    assert p.fwd_s == pytest.approx(flops(attn) / 8 / (rate * 1e12), rel=1e-9)
    assert p.bwd_s == pytest.approx(flops(attn, "bwd") / 8 / (rate * 1e12), rel=1e-9)


def test_free_links_ring_pays_its_causal_imbalance_in_lock_step():
    """The last ring position computes a full block at every step (its own: half): N - 1/2
    blocks of (S/N)² against the balanced share of N/2 blocks."""
    attn, rate, n = problem(), 100.0, 8
    p = predict("ring", attn, n, 4, machine(tflops=rate))
    block = flops(problem(seqlen=attn.seqlen // n, causal=False))
    assert p.fwd_s == pytest.approx((n - 1 + 0.5) * block / (rate * 1e12), rel=1e-9)


def test_step_overhead_is_paid_once_per_kernel_step():
    attn = problem()
    base = predict("zigzag", attn, 8, 4, machine(tflops=100.0))
    slow = predict("zigzag", attn, 8, 4, machine(tflops=100.0, overhead_us=50.0))
    assert slow.fwd_s - base.fwd_s == pytest.approx(8 * 50e-6, rel=1e-9)


def test_free_kernels_a_flat_ring_costs_its_slowest_hop():
    """2 nodes of 4: one hop per node crosses. Forward: N-1 K/V blocks, each at the
    inter-node rate (plus latency) on the ranks next to a node boundary."""
    attn, n = problem(), 8
    kv = 2 * (attn.seqlen // n) * H * D * 2
    p = predict("zigzag", attn, n, 4, machine(inter=10.0, latency_us=5.0))
    assert p.fwd_s == pytest.approx((n - 1) * (kv / 10e9 + 5e-6), rel=1e-9)


def test_nic_sharing_binds_when_every_gpu_of_a_node_crosses():
    """USP head-first with 2 × 4: Ulysses groups are the nodes, every ring hop crosses, so
    four GPUs share the node's NICs: per hop 4 · bytes over the node rate. A flat ring has
    one crossing hop per node, which the node rate does not slow."""
    attn = problem()
    kv = 2 * (attn.seqlen // 2) * (H // 4) * D * 2  # a ring position's K/V, heads/4
    shared = predict("usp", attn, 8, 4, machine(inter=10.0, node=20.0), placement="head-first")
    # a ring of 2 has one forward hop; the node's 4 GPUs make it at once over 20 GB/s (each
    # alone could do 10 GB/s); the all-to-alls stay inside the node, free here
    assert shared.fwd_s == pytest.approx(4 * kv / 20e9, rel=1e-9)
    flat = predict("zigzag", attn, 8, 4, machine(inter=10.0, node=20.0))
    alone = predict("zigzag", attn, 8, 4, machine(inter=10.0, node=FAST))
    assert flat.fwd_s == pytest.approx(alone.fwd_s, rel=1e-12)


def test_an_outer_hop_is_spread_over_its_window():
    """double-ring on 2 × 4: the forward's one outer hop has the whole inner window (4 steps)
    to arrive in. When 4 steps' compute covers it, nothing is exposed; at half that rate the
    forward is the hop's time. All 4 GPUs of a node send their outer hop at once."""
    attn = problem()
    step = predict("double-ring", attn, 8, 4, machine(tflops=100.0)).fwd_s / 8
    kv = 2 * (attn.seqlen // 8) * H * D * 2
    just_hidden = kv / (4 * step) / 1e9 * 1.01  # GB/s that moves it in 4 steps' compute
    p = predict("double-ring", attn, 8, 4, machine(tflops=100.0, inter=just_hidden,
                                                   node=4 * just_hidden))
    assert p.fwd_s == pytest.approx(8 * step, rel=1e-9)
    half = just_hidden / 2
    slower = predict("double-ring", attn, 8, 4, machine(tflops=100.0, inter=half,
                                                        node=4 * half))
    # the window's 4 steps each carry a quarter of the hop; the second window has none
    assert slower.fwd_s == pytest.approx(kv / (half * 1e9) + 4 * step, rel=1e-9)


def test_exposed_all_to_alls_add_to_the_compute():
    """Ulysses over 2 nodes of 2: every all-to-all is exposed; with compute free, the
    forward is its all-to-alls (q, k, v in; out back) at the rates they cross."""
    attn = problem(heads=4)
    n, s = 4, attn.seqlen // 4
    q = s * 4 * D * 2
    part = (n - 1) / n
    remote = 2 / 3  # of the 3 others, 2 are on the other node
    into = (3 * q) * part
    back = q * part
    hw = machine(intra=50.0, inter=10.0)
    p = predict("ulysses", attn, n, 2, hw)
    want = sum(max(b * (1 - remote) / 50e9, b * remote / 10e9) for b in (into, back))
    assert p.fwd_s == pytest.approx(want, rel=1e-9)


def test_an_all_gather_over_nodes_runs_as_rings_over_every_nic():
    """llama3 over 2 nodes of 4, kernels free: the forward is its K and V all-gathers, each
    (N-1)/N of the gathered sequence. NCCL's rings carry the whole message into each node
    once, spread over the node's 4 NICs (1/4 each), the rest over NVLink, at once; not each
    GPU's remote share through its own NIC (an all-to-all's rule, 4/7 here)."""
    attn = problem(kv_heads=2)
    n, s = 8, attn.seqlen // 8
    kv = s * 2 * D * 2 * (n - 1)  # K (or V) a rank receives
    p = predict("llama3", attn, n, 4, machine(intra=40.0, inter=10.0, node=40.0))
    want = 2 * max(kv * 3 / 4 / 40e9, kv / 4 / 10e9)
    assert p.fwd_s == pytest.approx(want, rel=1e-9)
    # one node: NVLink only
    one = predict("llama3", attn, n, 8, machine(intra=40.0, inter=10.0, node=40.0))
    assert one.fwd_s == pytest.approx(2 * kv / 40e9, rel=1e-9)


@pytest.mark.parametrize("name,opts", [("zigzag", {}), ("usp", {"placement": "ring-first"}),
                                       ("burst", {}), ("megatron-cp", {}), ("ring", {}),
                                       ("ulysses", {}), ("usp", {"ulysses_degree": 4}),
                                       ("megatron-cp-a2a+p2p", {})])
@pytest.mark.parametrize("batch", [1, 3])
def test_rescaled_schedules_equal_ones_built_at_the_size(name, opts, batch):
    """Predictions come from a schedule built at a small sequence length and re-scaled; that
    is exact: they equal the same model evaluated on a schedule built at the real size."""
    hw = hardware.load("a800-sxm")
    big = problem(seqlen=16384, batch=batch)
    options = strategies.get(name).Options(**opts)
    topo = Topology(world_size=8, ranks_per_node=4)
    scaled = model.predict(name, options, big, topo, hw)
    assert model.compiled_for(name, options, big, topo).seqlen < big.seqlen  # really scaled
    at_size = model.evaluate(model.compile_schedule(name, options, big, topo), big, hw)
    for field in ("fwd_s", "bwd_s", "memory_bytes", "fwd_compute_s", "bwd_compute_s"):
        assert getattr(scaled, field) == pytest.approx(getattr(at_size, field), rel=1e-9), field


def _leaving_per_node(name, world, rpn, attn) -> list[float]:
    """Bytes the simulator has leaving each node, both phases, from its own per-rank loads."""
    topo = Topology(world_size=world, ranks_per_node=rpn)
    cls = strategies.get(name)
    out = [0.0] * topo.num_nodes
    for rank in range(world):
        st = model.build(name, cls.Options(), attn, topo, rank)
        loads = schedule._rank_loads(st, st.schedule(), topo)
        out[topo.node_of(rank)] += sum(ov + exp for ov, exp in loads.leaving)
    return out


def test_bytes_leaving_a_node_match_the_hand_count():
    """2 nodes × 4, GQA bf16 (the closed forms of test_comm_volume): zigzag's flat ring
    crosses each node boundary once per hop — (N-1)·kv both passes plus N fp32 dK/dV hops
    leave a node; double-ring (window 4): only outer hops leave, all 4 ranks of a node taking
    one K/V hop per pass and 2 dK/dV hops, in the activation dtype as LoongTrain sends them
    across (InternEvo zigzag_ring_flash_attn_with_sliding_window.py: each window's sums are
    cast to the activation dtype before the outer hop)."""
    attn = problem(heads=8, kv_heads=2)
    n, s = 8, attn.seqlen // 8
    kv, dkv = 2 * s * 2 * D * 2, 2 * s * 2 * D * 4
    assert _leaving_per_node("zigzag", n, 4, attn) == [2 * (n - 1) * kv + n * dkv] * 2
    assert _leaving_per_node("double-ring", n, 4, attn) == [4 * (2 * kv + 2 * kv)] * 2


def test_memory_counts_what_a_rank_holds_and_oom_is_over_capacity():
    attn = problem(seqlen=1 << 20, heads=32, head_dim=128)
    s = attn.seqlen // 8
    q = kv = s * 32 * 128 * 2  # one of q / out / dout / dq, one of k / v / dk / dv (MHA)
    lse = 32 * s * 4
    zig = predict("zigzag", attn, 8, 4, machine(memory_gib=80.0))
    # worst step (backward), on ranks 1-7 right after the diagonal: q, dout, out, k, v; fp32
    # dQ and the held block's fp32 dK/dV; the K/V block computed on (and forwarded) and the
    # one arriving; the fp32 dK/dV arriving; this step's dQ, dK, dV (every local row against
    # half the keys) beside the diagonal's; and what FlashAttention-2's backward holds inside
    # the call for its s rows: an fp32 dQ accumulator and fp32 row sums (kernels.fa2_workspace;
    # without them rank 0's second step, of half the rows, was the worst)
    inputs = 5 * q + lse
    sums = 2 * q + 2 * 2 * kv
    flight = 2 * 2 * kv + 2 * 2 * kv
    calls = (q + 2 * kv // 2) + (q + 2 * kv)
    fa2 = s * 32 * (128 + 1) * 4
    assert zig.memory_bytes == inputs + sums + flight + calls + fa2
    assert not zig.oom
    # megatron-cp: it keeps every received K/V block and every step's output and lse to the
    # end of the forward, where it sums the outputs (two rescaled in fp32, into out). Ring
    # position 7 keeps the most: all 8 steps see every local query (the diagonal, then 7
    # earlier positions' first halves)
    mcp = predict("megatron-cp", attn, 8, 4, machine(memory_gib=80.0))
    held = 7 * 2 * kv + 8 * (q + lse) + 2 * kv  # its own K/V stacked as the first buffer
    call = q + lse
    middle = 2 * 2 * kv + 2 * call  # K/V blocks computed on and arriving; two calls' outputs
    end = call + 2 * 2 * q + q
    assert mcp.memory_bytes == 2 * q + 2 * kv + held + max(middle, end)
    tight = predict("zigzag", attn, 8, 4, machine(memory_gib=zig.memory_bytes / 2**30 * 0.99))
    assert tight.oom


def test_fa2s_backward_buffers_count_in_bf16_not_in_fp32():
    """FlashAttention-2 runs bf16 / fp16 only: an fp32 prediction (the CPU's kernels) holds
    none of its buffers, a bf16 one holds them (GQA: dK, dV expanded too)."""
    topo = Topology(world_size=8, ranks_per_node=4)
    for dtype in ("bf16", "fp32"):
        attn = problem(seqlen=1 << 16, kv_heads=2, dtype=dtype)
        hw = dataclasses.replace(machine(), dtypes=("fp32", "bf16"))  # a CPU's calibration
        got = predict("ring", attn, 8, 4, hw).memory_bytes
        bare = model.memory_estimate("ring", strategies.get("ring").Options(), attn, topo,
                                     kernel_buffers=False)
        full = model.memory_estimate("ring", strategies.get("ring").Options(), attn, topo)
        assert full > bare
        assert got == (full if dtype == "bf16" else bare)


def test_a_config_a_strategy_rejects_is_a_value_error():
    with pytest.raises(ValueError, match="divisible"):
        predict("ulysses", problem(heads=6), 8, 4, machine())
    with pytest.raises(ValueError, match="models bf16/fp16"):
        predict("zigzag", problem(dtype="fp32"), 8, 4, machine())


@pytest.mark.parametrize("change", [dict(kv_heads=2), dict(causal=False), dict(head_dim=128),
                                    dict(heads=16), dict(dtype="fp16", seqlen=8192, batch=2)])
def test_a_warm_cache_gives_what_a_cold_one_does(change):
    """Schedules are shared between problems that differ only in seqlen, batch and a dtype of
    the same size: a problem differing in anything else gets its own."""
    hw = hardware.load("a800-sxm")
    for name in ("zigzag", "usp", "megatron-cp"):
        predict(name, problem(), 8, 4, hw)  # warms the cache with the base problem
        warm = predict(name, problem(**change), 8, 4, hw)
        model.clear_cache()
        cold = predict(name, problem(**change), 8, 4, hw)
        for field in ("fwd_s", "bwd_s", "fwd_compute_s", "bwd_compute_s", "memory_bytes"):
            assert getattr(warm, field) == pytest.approx(getattr(cold, field), rel=1e-12), name
        assert warm.resolved == cold.resolved


def test_bf16_and_fp16_share_one_compile():
    hw = machine(tflops=100.0)
    a = predict("zigzag", problem(dtype="bf16"), 8, 4, hw)
    b = predict("zigzag", problem(dtype="fp16"), 8, 4, hw)
    assert model._compiled.cache_info().currsize == 1
    assert dataclasses.astuple(a) == dataclasses.astuple(b)
    assert math.isfinite(a.fwd_s)
