"""USP placement and layout, pure: head-first keeps Ulysses groups in a node, ring-first keeps
ring groups in a node; every rank's tokens together cover the sequence exactly once, and a
Ulysses group's pieces concatenate to its ring position's token set in the ring's order."""

from __future__ import annotations

import pytest
import torch
from schedule_helpers import plan

from cpbench.config import AttentionConfig
from cpbench.topology import HEAD_FIRST, RING_FIRST, group_of


def _all_ranks(world, rpn, name="usp", heads=8, seqlen=None, **opts):
    attn = AttentionConfig(batch=1, seqlen=seqlen or 4 * world, heads=heads, head_dim=8)
    return [plan(name, world, rpn, r, attn, **opts) for r in range(world)]


@pytest.mark.parametrize("nodes,per_node", [(2, 4), (4, 8)])
def test_head_first_keeps_ulysses_in_a_node(nodes, per_node):
    world = nodes * per_node
    sts = _all_ranks(world, per_node, heads=world, placement=HEAD_FIRST)  # default degree
    assert all(st.ulysses_degree == per_node for st in sts)
    assert not any(st.groups["ulysses"].crosses_nodes for st in sts)
    assert all(st.groups["ring"].crosses_nodes for st in sts)
    assert all(len({r // per_node for r in g}) == 1 for g in sts[0].ulysses_lists)


@pytest.mark.parametrize("nodes,per_node", [(2, 4), (4, 8)])
@pytest.mark.parametrize("degree", ["nodes", "default"])
def test_ring_first_keeps_rings_in_a_node(nodes, per_node, degree):
    world = nodes * per_node
    u = nodes if degree == "nodes" else 0  # default: per_node, leaving rings of `nodes` ranks
    sts = _all_ranks(world, per_node, heads=world, placement=RING_FIRST, ulysses_degree=u)
    assert not any(st.groups["ring"].crosses_nodes for st in sts)
    assert all(st.groups["ulysses"].crosses_nodes for st in sts)
    assert all(len({r // per_node for r in g}) == 1 for g in sts[0].ring_lists)
    if degree == "nodes":  # ring degree = ranks per node: each ring is exactly one node
        assert sorted(map(sorted, sts[0].ring_lists)) == [
            list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)]


def test_default_degree_never_straddles_nodes():
    # 12 ranks on nodes of 4, 6 heads: 3 divides both, but [3, 4, 5] would cross a node
    sts = _all_ranks(12, 4, heads=6, seqlen=96)
    assert {st.ulysses_degree for st in sts} == {2}
    assert not any(st.groups["ulysses"].crosses_nodes for st in sts)


SPLITS = [  # (world, rpn, options)
    (8, 4, dict(ulysses_degree=4, placement=HEAD_FIRST, ring_impl="ring")),
    (8, 4, dict(ulysses_degree=4, placement=RING_FIRST, ring_impl="zigzag")),
    (8, 2, dict(ulysses_degree=2, placement=RING_FIRST, ring_impl="ring")),
    (8, 2, dict(ulysses_degree=2, placement=HEAD_FIRST, ring_impl="zigzag")),
    (8, 4, dict(ulysses_degree=2, placement=HEAD_FIRST, ring_impl="double-ring")),
    (8, 4, dict(ulysses_degree=1, ring_impl="zigzag")),
    (8, 4, dict(ulysses_degree=8)),
    (16, 4, dict(ulysses_degree=4, placement=RING_FIRST, ring_impl="zigzag")),
    (16, 4, dict(ulysses_degree=2, placement=RING_FIRST, ring_impl="double-ring")),
]


@pytest.mark.parametrize("world,rpn,opts", SPLITS, ids=str)
def test_layout_covers_sequence_once(world, rpn, opts):
    S = 8 * world
    sts = _all_ranks(world, rpn, seqlen=S, **opts)
    st = sts[0]
    held = torch.cat([st.seq_index(r) for r in range(world)])
    assert sorted(held.tolist()) == list(range(S))
    assert all(len(st.seq_index(r)) == S // world for r in range(world))
    # what the all-to-all gathers (member order) is what the ring strategy expects to hold
    for r in range(world):
        uly = group_of(r, st.ulysses_lists)
        gathered = torch.cat([st.seq_index(m) for m in uly])
        want = (st.ring.seq_index(r) if st.ring is not None else torch.arange(S))
        assert torch.equal(gathered, want)
    # every rank agrees on every rank's layout
    assert all(torch.equal(o.seq_index(r), st.seq_index(r)) for o in sts for r in range(world))


def test_a2a_p2p_layout_covers_sequence_once():
    sts = _all_ranks(8, 4, name="megatron-cp-a2a+p2p", seqlen=64)
    held = torch.cat([sts[0].seq_index(r) for r in range(8)])
    assert sorted(held.tolist()) == list(range(64))
    assert not any(st.groups["ulysses"].crosses_nodes for st in sts)


@pytest.mark.parametrize("name", ["usp", "yunchang-usp"])
def test_default_degrees_fill_a_node_with_the_dimension_placed_first(name):
    """InternEvo, yunchang and BurstEngine mean by ring-first that the ring groups are
    consecutive ranks filling a node: on 4 nodes x 8 a ring of 8 in each node and Ulysses 4
    across (one rank per node); head-first, Ulysses 8 in each node and a ring of 4 across."""
    from cpbench import kernels, strategies
    from cpbench.config import AttentionConfig
    from cpbench.topology import Topology

    cls = strategies.get(name)
    attn = AttentionConfig(seqlen=2 ** 12, heads=32, head_dim=64, dtype="bf16")
    topo = Topology(world_size=32, ranks_per_node=8)
    for placement, (u, r) in (("head-first", (8, 4)), ("ring-first", (4, 8))):
        st = cls(attn, topo, 0, kernel=kernels.get("sdpa-cpu"), create_groups=False,
                 options=cls.Options(placement=placement, ring_impl="zigzag"))
        assert (st.ulysses_degree, st.ring_degree) == (u, r), placement
        ring = next(g for g in st.ring_lists if 0 in g)
        assert not topo.crosses_nodes(ring) if placement == "ring-first" else \
            topo.crosses_nodes(ring)
