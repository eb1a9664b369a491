"""The simulator's step terms change a prediction exactly as their formulas say: the merge and
gradient sums around each kernel (every preset), and the CPU's (``cpbench calibrate``
measures them; GPU presets have none):
an overlapped message that adds instead of hiding, and a node's idle ranks leaving it to the
busy ones (processor sharing)."""

from __future__ import annotations

import pytest

from cpbench import strategies
from cpbench.config import AttentionConfig
from cpbench.errors import UsageError
from cpbench.metrics import attention_flops
from cpbench.sim import hardware, model, sharing
from cpbench.topology import Topology

FAST = 1e15
H, D = 2, 64


def machine(**extra) -> hardware.Hardware:
    flat = [[1, 100.0], [2, 100.0]]
    return hardware.from_dict({
        "name": "test cpu", "gpus_per_node": 2, "nodes": 1, "memory_gib": 8.0,
        "peak_tflops_bf16": 1000.0, "dtypes": ["fp32"],
        "kernel": {"fwd": flat, "bwd": flat},
        "intra_node": {"bandwidth_gbs": 1.0, "latency_us": 100.0},
        "inter_node": {"bandwidth_gbs_per_gpu": 1.0, "node_bandwidth_gbs": 1.0,
                       "latency_us": 100.0}, **extra})


def attn(seqlen=4096) -> AttentionConfig:
    return AttentionConfig(batch=1, seqlen=seqlen, heads=H, head_dim=D, dtype="fp32",
                           causal=True)


def predict(name, hw, ranks_per_node=2, seqlen=4096):
    return model.predict(name, strategies.get(name).Options(), attn(seqlen),
                         Topology(world_size=2, ranks_per_node=ranks_per_node), hw)


def test_merge_and_sums_add_per_kernel_step_by_the_block_elements():
    """local on 2 ranks: one step each phase on the whole S x H x D; the forward merges its
    rows once, the backward adds dq (S rows) and dk, dv (S rows each)."""
    base = predict("local", machine())
    hw = machine(merge={"fixed_us": 10.0, "ns_per_element": 2.0},
                 accumulate={"fixed_us": 1.0, "ns_per_element": 0.5})
    p = predict("local", hw)
    elements = 4096 * H * D
    assert p.fwd_s - base.fwd_s == pytest.approx(10e-6 + 2e-9 * elements, rel=1e-9)
    assert p.bwd_s - base.bwd_s == pytest.approx(3 * (1e-6 + 0.5e-9 * elements), rel=1e-9)


def test_an_overlapped_message_adds_its_measured_multiple_instead_of_hiding():
    """zigzag on 2 ranks: two forward steps of half a rank's work each, the first posting the
    one K/V hop; on a GPU preset the hop (longer) hides the first kernel, on a measured CPU
    one it adds ``overlapped`` times its time alone on the link."""
    slow_link = {"bandwidth_gbs": 0.001, "latency_us": 0.0}
    gpu = machine(intra_node=slow_link, inter_node={"bandwidth_gbs_per_gpu": 0.001,
                                                   "node_bandwidth_gbs": 0.001,
                                                   "latency_us": 0.0})
    cpu = machine(intra_node=slow_link, inter_node={"bandwidth_gbs_per_gpu": 0.001,
                                                   "node_bandwidth_gbs": 0.001,
                                                   "latency_us": 0.0}, overlapped=1.5)
    kv_bytes = 2 * 2048 * H * D * 4
    hop = kv_bytes / 1e6  # seconds at 1 MB/s
    compute = attention_flops(batch=1, seqlen_q=4096, seqlen_k=4096, heads=H, head_dim=D,
                              causal=True) / 2 / 100e12
    assert predict("zigzag", gpu, ranks_per_node=1).fwd_s == pytest.approx(
        hop + compute / 2, rel=1e-6)
    assert predict("zigzag", cpu, ranks_per_node=1).fwd_s == pytest.approx(
        compute + 1.5 * hop, rel=1e-6)


def test_processor_sharing_speeds_up_the_rank_left_alone():
    """Two ranks of one node, works 1 and 3 (all-busy seconds), 2x alone: both run at 1x
    until the first ends at 1, the second does its last 2 at 2x: ends at 2."""
    assert sharing.shared_compute([1.0, 3.0], ((1, 1),), 2.0) == pytest.approx([1.0, 2.0])
    # three ranks, the first two alike: the third is alone after t=1 (speed 2 with 1 of 3)
    assert sharing.shared_compute([1.0, 3.0], ((2, 1),), 2.0) == pytest.approx([1.0, 2.0])
    assert sharing.shared_compute([1.0, 3.0], ((1, 1),), 1.0) == [1.0, 3.0]


def test_ring_on_a_cpu_whose_idle_rank_frees_the_busy_one_gets_faster():
    """ring's rank 0 computes nothing at its second step: with idle_speedup its rank 1's
    block runs faster than lock-step alone predicts; zigzag, balanced, does not change."""
    shared, alone = predict("ring", machine(idle_speedup=1.5)), predict("ring", machine())
    assert shared.fwd_s < alone.fwd_s
    # the reported kernel time is the one the step ran: never above the phase it is part of
    assert shared.fwd_compute_s < alone.fwd_compute_s and shared.fwd_compute_s <= shared.fwd_s
    assert shared.bwd_compute_s <= shared.bwd_s
    assert predict("zigzag", machine(idle_speedup=1.5)).fwd_s == pytest.approx(
        predict("zigzag", machine()).fwd_s, rel=1e-9)


@pytest.mark.parametrize("extra, says", [
    ({"idle_speedup": 0.5}, "idle_speedup"),
    ({"overlapped": -1}, "overlapped"),
    ({"merge": {"fixed_us": -1, "ns_per_element": 1}}, "merge"),
    ({"accumulate": {"fixed_us": 1}}, "ns_per_element"),
    ({"probe": {"side": 2048, "heads": 2, "head_dim": 64, "busy_ms": 0, "alone_ms": 1}},
     "probe"),
])
def test_bad_cpu_terms_are_refused_with_the_field(extra, says):
    with pytest.raises(UsageError, match=says):
        machine(**extra)


def test_gpu_presets_have_none_of_the_cpu_sharing_terms():
    """GPU presets share nothing between ranks (a device each); their memory passes are
    bytes per element over the HBM bandwidth."""
    for name in hardware.names():
        hw = hardware.load(name)
        assert hw.overlapped is None and hw.idle_speedup == 1.0 and hw.probe is None
        assert hw.memory_bandwidth_gbs and hw.merge.fixed_us == hw.accumulate.fixed_us == 0
        assert hw.merge.ns_per_element * hw.memory_bandwidth_gbs == pytest.approx(22)
        assert hw.accumulate.ns_per_element * hw.memory_bandwidth_gbs == pytest.approx(8.8)
