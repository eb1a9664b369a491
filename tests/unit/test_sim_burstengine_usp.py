"""The simulator prices ``usp --burstengine-dkv-hop``'s extra dK/dV hop: a step of its own after
the ring's backward, exposed (nothing hides it, whatever the kernels cost), on the ring's
links: across nodes head-first (every GPU of a node sends it at once, sharing the node's
NICs), inside a node ring-first. Against the same one-window double ring without it."""

from __future__ import annotations

import pytest

from cpbench import strategies
from cpbench.config import AttentionConfig
from cpbench.sim import hardware, model
from cpbench.topology import Topology

FAST = 1e15  # GB/s or TFLOP/s: too fast to matter
B, S, H, D = 1, 4096, 8, 64


def machine(*, tflops, intra=FAST, inter=FAST, node=FAST, latency_us=5.0):
    flat = [[1, tflops], [2, tflops]]
    return hardware.from_dict({
        "name": "test", "gpus_per_node": 2, "nodes": 4, "memory_gib": 80.0,
        "peak_tflops_bf16": 2 * FAST,
        "kernel": {"fwd": flat, "bwd": flat, "step_overhead_us": 0.0},
        "intra_node": {"bandwidth_gbs": intra, "latency_us": latency_us},
        "inter_node": {"bandwidth_gbs_per_gpu": inter, "node_bandwidth_gbs": node,
                       "latency_us": latency_us}})


def _pair(placement: str, hw, ring: int):
    """(with the hop, without it) on 4 nodes x 2, the double ring one window of ``ring``."""
    attn = AttentionConfig(batch=B, seqlen=S, heads=H, head_dim=D, dtype="bf16")
    topo, opts = Topology(world_size=8, ranks_per_node=2), strategies.get("usp").Options
    common = dict(placement=placement, ring_impl="double-ring")
    model.clear_cache()
    return (model.predict("usp", opts(**common, burstengine_dkv_hop=True), attn, topo, hw),
            model.predict("usp", opts(**common, ring_window=ring), attn, topo, hw))


@pytest.mark.parametrize("tflops", [FAST, 50.0])
def test_head_first_the_hop_crosses_nodes_exposed(tflops):
    # u = 2 (a node), rings of R = 4 across the nodes; the hop: dK and dV of S/R tokens of
    # H/u heads, bf16, to the next node, both GPUs of every node at once over its NICs
    hop_bytes = 2 * B * (S // 4) * (H // 2) * D * 2
    with_hop, without = _pair("head-first", machine(tflops=tflops, inter=10.0, node=10.0), 4)
    assert with_hop.fwd_s == without.fwd_s
    assert with_hop.bwd_s - without.bwd_s == pytest.approx(2 * hop_bytes / 10e9 + 5e-6,
                                                           rel=1e-9)


def test_ring_first_the_hop_stays_in_a_node():
    # u = 4 across nodes, rings of R = 2 inside a node: the hop is priced on NVLink
    hop_bytes = 2 * B * (S // 2) * (H // 4) * D * 2
    with_hop, without = _pair("ring-first", machine(tflops=50.0, intra=40.0, inter=1.0,
                                                    node=1.0), 2)
    assert with_hop.bwd_s - without.bwd_s == pytest.approx(hop_bytes / 40e9 + 5e-6, rel=1e-9)
