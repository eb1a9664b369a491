"""Pure rank-list maths: nodes, contiguous / strided groups, double rings, USP placements."""

from __future__ import annotations

import pytest

from cpbench.errors import UsageError
from cpbench.topology import (
    HEAD_FIRST,
    RING_FIRST,
    Topology,
    contiguous_groups,
    double_ring_groups,
    new_groups,
    node_local_block,
    plan_group,
    strided_groups,
    usp_default_degree,
    usp_mesh,
)


def test_nodes():
    t = Topology(world_size=32, ranks_per_node=8)
    assert t.num_nodes == 4 and t.node_of(7) == 0 and t.node_of(8) == 1 and t.node_of(31) == 3
    assert t.crosses_nodes([0, 8]) and not t.crosses_nodes([8, 15])
    assert t.describe() == "4x8"


def test_ranks_per_node_must_divide_world():
    with pytest.raises(ValueError, match="use one of: 1, 2, 3, 6"):
        Topology(world_size=6, ranks_per_node=4)


def test_contiguous_and_strided():
    assert contiguous_groups(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert strided_groups(8, 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert strided_groups(8, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="does not divide world size 8; use one of: 1, 2, 4, 8"):
        contiguous_groups(8, 3)


def test_double_ring_inner_within_node_outer_across():
    topo = Topology(world_size=32, ranks_per_node=8)
    inner, outer = double_ring_groups(list(range(32)), window=8)
    assert inner == [list(range(s, s + 8)) for s in (0, 8, 16, 24)]
    assert outer[0] == [0, 8, 16, 24] and outer[7] == [7, 15, 23, 31]
    assert not any(topo.crosses_nodes(g) for g in inner)
    assert all(topo.crosses_nodes(g) for g in outer)
    # a strided ring (as USP head-first hands out) splits by ring order, not rank value
    inner, outer = double_ring_groups([1, 3, 5, 7], window=2)
    assert inner == [[1, 3], [5, 7]] and outer == [[1, 5], [3, 7]]
    with pytest.raises(UsageError,
                       match="window 3 does not divide ring size 8; use one of: 1, 2, 4, 8"):
        double_ring_groups(list(range(8)), window=3)


@pytest.mark.parametrize("nodes,per_node", [(2, 4), (4, 8)])
def test_usp_placements(nodes, per_node):
    world = nodes * per_node
    topo = Topology(world_size=world, ranks_per_node=per_node)
    uly, ring = usp_mesh(world, per_node, HEAD_FIRST)
    assert all(not topo.crosses_nodes(g) for g in uly)
    assert all(topo.crosses_nodes(g) for g in ring)
    uly, ring = usp_mesh(world, nodes, RING_FIRST)  # ring degree = per_node
    assert all(not topo.crosses_nodes(g) for g in ring)
    assert all(topo.crosses_nodes(g) for g in uly)
    for placement in (HEAD_FIRST, RING_FIRST):
        uly, ring = usp_mesh(world, 2, placement)
        # every rank is in exactly one group of each kind, and each pair meets exactly once
        assert sorted(r for g in uly for r in g) == list(range(world))
        assert sorted(r for g in ring for r in g) == list(range(world))
        assert all(len(set(u) & set(rg)) == 1 for u in uly for rg in ring)


def test_usp_invalid():
    with pytest.raises(ValueError, match="ulysses degree 3"):
        usp_mesh(8, 3, HEAD_FIRST)
    with pytest.raises(ValueError, match="unknown placement"):
        usp_mesh(8, 2, "diagonal")


def test_plan_group_neighbours():
    topo = Topology(world_size=8, ranks_per_node=4)
    g = plan_group(topo, "ring", 5, strided_groups(8, 4))
    assert g.ranks == (1, 3, 5, 7) and g.index == 2
    assert g.next_rank == 7 and g.prev_rank == 3 and g.crosses_nodes


def test_node_local_block():
    t = Topology(world_size=12, ranks_per_node=4)
    every = [list(range(12))]
    assert node_local_block(t, every) == 4
    # 3 divides 12 ranks and 6 heads, but the block [3, 4, 5] straddles two nodes
    assert node_local_block(t, every, also_divides=6) == 2
    assert node_local_block(t, every, also_divides=3) == 1
    # rings that visit one rank per node (USP head-first rings) have no in-node block
    assert node_local_block(t, strided_groups(12, 3)) == 1
    # rings of consecutive pairs (USP ring-first under u = 6) fit whole
    assert node_local_block(t, contiguous_groups(12, 2)) == 2
    assert node_local_block(Topology(world_size=8, ranks_per_node=8), [list(range(8))]) == 8


@pytest.fixture
def one_rank_world(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    yield Topology(world_size=1, ranks_per_node=1)
    dist.destroy_process_group()


def test_groups_are_per_role(one_rank_world):
    """Two roles over the same members get two ProcessGroups (NCCL ignores tags: rings in
    flight together need their own communicators); a role asked for again is reused."""
    ring = new_groups(one_rank_world, "ring", 0, [[0]])
    dkv = new_groups(one_rank_world, "ring_dkv", 0, [[0]])
    assert ring.pg is not None and dkv.pg is not None and ring.pg is not dkv.pg
    assert new_groups(one_rank_world, "ring", 0, [[0]]).pg is ring.pg
    assert (ring.name, dkv.name) == ("ring", "ring_dkv") and ring.ranks == dkv.ranks


def test_groups_do_not_outlive_their_world(tmp_path):
    import torch.distributed as dist

    pgs = []
    for i in range(2):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store{i}", rank=0,
                                world_size=1)
        pgs.append(new_groups(Topology(world_size=1, ranks_per_node=1), "ring", 0, [[0]]).pg)
        dist.destroy_process_group()
    assert pgs[0] is not pgs[1]


def test_ring_first_default_when_no_ring_dividing_the_heads_fits_a_node():
    """16 nodes of 8, 40 heads: rings of 16, 32, 64 or 128 leave a Ulysses degree dividing
    40, and every one crosses nodes: the largest ring (degree 1) rather than no answer."""
    topo = Topology(world_size=128, ranks_per_node=8)
    rings = [list(range(128))]
    assert usp_default_degree(topo, rings, heads=40, placement="ring-first") == 1
    # one that fits is still preferred: with 16 heads a ring of 8 (Ulysses 16) stays in a node
    assert usp_default_degree(topo, rings, heads=16, placement="ring-first") == 16


def test_set_timeout_reaches_torch_groups_through_its_setter(one_rank_world, monkeypatch):
    """torch's groups have a set_timeout of their own: they still take c10d's setter (the
    path cpbench has always used on gloo and NCCL); only cpbench.threadpg's keep their own."""
    from torch.distributed import distributed_c10d as c10d

    from cpbench import topology

    new_groups(one_rank_world, "ring", 0, [[0]])
    seen = []
    monkeypatch.setattr(c10d, "_set_pg_timeout", lambda timeout, pg: seen.append((timeout, pg)))
    topology.set_timeout(42)
    assert len(seen) == 2 and all(t.total_seconds() == 42 for t, _ in seen)
