"""Rank bodies of the slow-reference test (module level so forkserver ranks can import them)."""

from __future__ import annotations

import time

from cpbench import kernels, reference, strategies, topology
from cpbench.bench.check import check_strategy
from cpbench.config import AttentionConfig
from cpbench.topology import Topology


def check_with_slow_reference(rank, world, heads, head_s, timeout_s):
    """``ring``'s check with each head of rank 0's reference taking ``head_s`` more, under a
    collective timeout of ``timeout_s``: the verdicts per tensor. A timeout raises, so the
    test pool drops a world whose pairs it closed."""
    attn = AttentionConfig(batch=1, seqlen=64, heads=heads, head_dim=8, causal=True,
                           dtype="fp32")
    saved = reference.reference_attention

    def slow(*args, **kwargs):
        time.sleep(head_s)
        return saved(*args, **kwargs)

    reference.reference_attention = slow
    topology.set_timeout(timeout_s)
    try:
        st = strategies.get("ring")(attn, Topology(world_size=world, ranks_per_node=world),
                                    rank, kernel=kernels.get("sdpa-cpu"))
        return {c.tensor: c.passed for c in check_strategy(st, seed=3)}
    finally:
        reference.reference_attention = saved
