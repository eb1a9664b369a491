"""Rank bodies of the sink tests (module level so forkserver ranks can import them)."""

from __future__ import annotations

from cpbench import kernels, strategies
from cpbench.bench.check import check_strategy, global_inputs
from cpbench.merge import OutLseAccumulator, add_sink
from cpbench.strategies import _kv_ring
from cpbench.topology import Topology


def per_block_sink_check(rank, world, rpn, attn, seed):
    """``ring`` with its sink added to every block's result before the merge (and not after
    it): the negative control. Returns the check's verdicts per tensor."""
    sinks = global_inputs(attn, seed)["sinks"]

    class PerBlock(OutLseAccumulator):
        def update(self, block_out, block_lse, seq=None):
            super().update(*add_sink(block_out, block_lse, sinks), seq)

    saved = _kv_ring.OutLseAccumulator, _kv_ring.add_sink
    _kv_ring.OutLseAccumulator = PerBlock
    _kv_ring.add_sink = lambda out, lse, sinks: (out, lse)  # no sink once per query
    try:
        st = strategies.get("ring")(attn, Topology(world_size=world, ranks_per_node=rpn), rank,
                                    kernel=kernels.get("sdpa-cpu"))
        return {c.tensor: c.passed for c in check_strategy(st, seed=seed)}
    finally:
        _kv_ring.OutLseAccumulator, _kv_ring.add_sink = saved
