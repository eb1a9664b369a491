"""Rank bodies for test_head_dims_run (module level so forkserver ranks can import them)."""

from __future__ import annotations

import torch

from cpbench import kernels
from cpbench.bench.check import check_strategy
from cpbench.strategies.ring import Ring
from cpbench.topology import Topology


class RingPaddingV(Ring):
    """A deliberately wrong ring: V zero-padded to the Q/K width (a buffer shaped like K, as
    a stacked K/V buffer would hold it) and read back at V's shape, row by row as a flat
    buffer, as a receiver that trusts V's shape but not its width would: no error, wrong
    values."""

    def attention(self, q, k, v):
        wide = torch.nn.functional.pad(v, (0, k.shape[-1] - v.shape[-1]))
        return super().attention(q, k, wide.reshape(-1)[:v.numel()].view(v.shape))


def check_padded_v(rank, world, rpn, attn) -> dict[str, bool]:
    """Each tensor's verdict of ``--check`` on the padding ring."""
    topo = Topology(world_size=world, ranks_per_node=rpn)
    st = RingPaddingV(attn, topo, rank, kernel=kernels.get("sdpa-cpu"))
    return {c.tensor: c.passed for c in check_strategy(st, seed=5)}
