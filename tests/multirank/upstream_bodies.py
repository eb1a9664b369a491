"""Rank bodies for the upstream strategies' tests (module level: forkserver ranks import them)."""

from __future__ import annotations

import torch

from cpbench import kernels, strategies
from cpbench.config import AttentionConfig
from cpbench.topology import Topology


def yunchang_layout_matches_its_helpers(rank, world, rpn, options):
    """yunchang's own EXTRACT_FUNC_DICT helper on a tensor of positions, with the groups
    yunchang-usp set up (set_seq_parallel_pg), against the strategy's seq_index: the indices
    a rank holds, or the helper's when they differ."""
    import yunchang

    attn = AttentionConfig(batch=1, seqlen=96, heads=8, head_dim=16, dtype="bf16")
    cls = strategies.get("yunchang-usp")
    st = cls(attn, Topology(world_size=world, ranks_per_node=rpn), rank,
             kernel=kernels.get("sdpa-cpu"), options=cls.Options(**options))
    positions = torch.arange(attn.seqlen).view(1, -1, 1)
    helper = yunchang.EXTRACT_FUNC_DICT[options["ring_impl"]]
    got = helper(positions, rank, world, st.ring_degree, st.ulysses_degree).flatten()
    return got.tolist(), st.seq_index(rank).tolist()
