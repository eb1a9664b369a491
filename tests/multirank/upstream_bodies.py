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
    attn = AttentionConfig(batch=1, seqlen=96, heads=8, head_dim=16, dtype="bf16")
    cls = strategies.get("yunchang-usp")
    st = cls(attn, Topology(world_size=world, ranks_per_node=rpn), rank,
             kernel=kernels.get("sdpa-cpu"), options=cls.Options(**options))
    import yunchang  # after the strategy: it installs flash-attn's interface first, as a run

    positions = torch.arange(attn.seqlen).view(1, -1, 1)
    helper = yunchang.EXTRACT_FUNC_DICT[options["ring_impl"]]
    got = helper(positions, rank, world, st.ring_degree, st.ulysses_degree).flatten()
    return got.tolist(), st.seq_index(rank).tolist()


def yunchang_groups_across_builds(rank, world):
    """Build yunchang-usp three times (as three cases do): (process groups torch holds after
    each build, whether yunchang got the same groups each time, whether they are the groups
    cpbench's cache holds, under which the per-case timeout is set)."""
    import torch.distributed as dist

    from cpbench import topology

    attn = AttentionConfig(batch=1, seqlen=64, heads=4, head_dim=16, dtype="bf16")
    cls = strategies.get("yunchang-usp")
    counts, pgs = [], []
    for timeout in (40.0, 50.0, 70.0):  # each case its own timeout (the driver's)
        topo = Topology(world_size=world, ranks_per_node=world, group_timeout_s=timeout)
        topology.set_timeout(timeout)
        cls(attn, topo, rank, kernel=kernels.get("sdpa-cpu"),
            options=cls.Options(ulysses_degree=2, ring_impl="zigzag"))
        counts.append(dist.get_pg_count())
        # imported after the first build, which installs flash-attn's interface first
        from yunchang.globals import PROCESS_GROUP

        pgs.append((PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG))
    cached = {id(pg) for _, pg in topology._pg_cache().values()}
    return counts, all(p == pgs[0] for p in pgs), all(id(pg) in cached for pg in pgs[0])
