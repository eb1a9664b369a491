"""Ranks → nodes, and every rank list / process group a strategy needs.

This is the only module that knows how ranks map onto nodes and groups. Strategies ask it for
rank lists by role (a ring, inner/outer rings, a ulysses × ring mesh) and get ``Group`` objects
back; they never compute peers from global rank arithmetic themselves.

Placement semantics (the USP mesh of ``ulysses_degree`` × ``ring_degree``):
- head-first: Ulysses groups are contiguous ranks, so with ulysses_degree <= ranks per node
  the all-to-alls stay inside a node and the ring crosses nodes;
- ring-first: ring groups are contiguous ranks, so the ring stays inside a node and the
  Ulysses all-to-alls cross nodes (the slow USP row of seed 001).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from functools import lru_cache
from typing import Any, Callable, Sequence

from cpbench import ranklocal
from cpbench.errors import UsageError

HEAD_FIRST = "head-first"
RING_FIRST = "ring-first"
PLACEMENTS = (HEAD_FIRST, RING_FIRST)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, kw_only=True)
class Topology:
    """``world_size`` ranks on nodes of ``ranks_per_node`` consecutive ranks."""

    world_size: int
    ranks_per_node: int
    # Timeout of the groups strategies create. torch's new_group() does not inherit the world
    # group's: unset, it falls back to torch's defaults (30 min on gloo, 10 min on NCCL).
    group_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise UsageError(f"world size must be >= 1, got {self.world_size}")
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            ok = ", ".join(map(str, divisors(self.world_size)))
            raise UsageError(
                f"ranks per node {self.ranks_per_node} does not divide world size "
                f"{self.world_size}; use one of: {ok}"
            )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def crosses_nodes(self, ranks: Sequence[int]) -> bool:
        return len({self.node_of(r) for r in ranks}) > 1

    def describe(self) -> str:
        return f"{self.num_nodes}x{self.ranks_per_node}"


@dataclass(frozen=True)
class Group:
    """A process group seen from one member: its role name, members in ring order, and
    the torch ProcessGroup (None where only the plan is needed, e.g. schedules)."""

    name: str
    ranks: tuple[int, ...]
    index: int  # this rank's position in ``ranks``
    crosses_nodes: bool
    pg: Any = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.index + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.index - 1) % self.size]


# -- rank lists (pure) ------------------------------------------------------------------------

def contiguous_groups(world_size: int, size: int) -> list[list[int]]:
    """[[0..size-1], [size..2*size-1], ...]."""
    _check_divides(size, world_size, "group size", "world size")
    return [list(range(s, s + size)) for s in range(0, world_size, size)]


def strided_groups(world_size: int, size: int) -> list[list[int]]:
    """Groups of ``size`` ranks spaced world_size/size apart: [[0, w/s, ...], [1, ...], ...]."""
    _check_divides(size, world_size, "group size", "world size")
    stride = world_size // size
    return [list(range(start, world_size, stride)) for start in range(stride)]


def double_ring_groups(ring: Sequence[int], window: int) -> tuple[list[list[int]], list[list[int]]]:
    """Split a ring into inner rings of ``window`` consecutive members, and outer rings that
    link the members at the same position of every window (LoongTrain's DoubleRing)."""
    _check_divides(window, len(ring), "window", "ring size")
    inner = [list(ring[s:s + window]) for s in range(0, len(ring), window)]
    outer = [[inner_ring[i] for inner_ring in inner] for i in range(window)]
    return inner, outer


def usp_mesh(world_size: int, ulysses_degree: int, placement: str
             ) -> tuple[list[list[int]], list[list[int]]]:
    """(ulysses groups, ring groups) of a ulysses_degree × ring_degree mesh."""
    if placement not in PLACEMENTS:
        raise UsageError(f"unknown placement {placement!r}; choose one of: {', '.join(PLACEMENTS)}")
    _check_divides(ulysses_degree, world_size, "ulysses degree", "world size")
    ring_degree = world_size // ulysses_degree
    if placement == HEAD_FIRST:
        return (contiguous_groups(world_size, ulysses_degree),
                strided_groups(world_size, ring_degree))
    return strided_groups(world_size, ulysses_degree), contiguous_groups(world_size, ring_degree)


def group_of(rank: int, rank_lists: Sequence[Sequence[int]]) -> list[int]:
    for ranks in rank_lists:
        if rank in ranks:
            return list(ranks)
    raise AssertionError(f"rank {rank} is in none of {rank_lists}")


def node_local_block(topo: Topology, rings: Sequence[Sequence[int]], *,
                     also_divides: int | None = None) -> int:
    """The largest d dividing the ring length (and ``also_divides``, e.g. the head count)
    such that cutting every ring into blocks of d consecutive members leaves each block
    inside one node; 1 always qualifies.

    For a ring of consecutive ranks that is the largest such d dividing ranks per node (a
    block of 3 on nodes of 4 would straddle ranks 3|4); for a ring that visits one rank per
    node it is 1. USP head-first uses it as its default Ulysses degree (all-to-alls inside a
    node), DoubleRing as its default window (inner rings inside a node).
    """
    return _node_local_block(topo, tuple(map(tuple, rings)), also_divides)


@lru_cache(maxsize=4096)
def _node_local_block(topo: Topology, rings: tuple[tuple[int, ...], ...],
                      also_divides: int | None) -> int:
    # every rank of a simulated strategy asks this of the same rings, per step: once each
    n = len(rings[0])
    return max(d for d in divisors(n)
               if (also_divides is None or also_divides % d == 0)
               and not any(topo.crosses_nodes(ring[s:s + d])
                           for ring in rings for s in range(0, n, d)))


def usp_default_degree(topo: Topology, rings: Sequence[Sequence[int]], heads: int,
                       placement: str) -> int:
    """The default Ulysses degree of a USP mesh over ``rings`` (each a CP list): the dimension
    placed first fills a node. Head-first: the largest degree dividing ``heads`` whose
    consecutive Ulysses groups stay in a node. Ring-first: the largest ring whose consecutive
    groups stay in a node, among those leaving a Ulysses degree that divides ``heads`` (where
    none stays in a node, the largest of those rings)."""
    if placement == HEAD_FIRST:
        return node_local_block(topo, rings, also_divides=heads)
    n = len(rings[0])
    valid = [r for r in divisors(n) if heads % (n // r) == 0]  # r = n: Ulysses degree 1
    # no ring that divides the heads fits in a node (16 nodes of 8, 40 heads): the largest
    # ring, which crosses nodes least often
    fits = [r for r in valid if not any(
        topo.crosses_nodes(ring[s:s + r]) for ring in rings for s in range(0, n, r))] or valid
    return n // max(fits)


def _check_divides(part: int, whole: int, part_name: str, whole_name: str) -> None:
    if part < 1 or whole % part:
        ok = ", ".join(map(str, divisors(whole)))
        raise UsageError(f"{part_name} {part} does not divide {whole_name} {whole}; use one of: "
                         f"{ok}")


# -- groups ------------------------------------------------------------------------------------

def _pg_cache() -> dict[tuple[str, tuple[int, ...]], tuple[Any, Any]]:
    """This rank's groups (``ranklocal``): (role, members) → (the default group it was
    created under, the group); a group made before a destroy_process_group() is never handed
    out again."""
    cache: dict[tuple[str, tuple[int, ...]], tuple[Any, Any]] = \
        ranklocal.slot("topology.pg_cache", dict)
    return cache


def plan_group(topo: Topology, name: str, rank: int, rank_lists: Sequence[Sequence[int]]) -> Group:
    """This rank's group among ``rank_lists`` without creating a ProcessGroup."""
    ranks = group_of(rank, rank_lists)
    return Group(name, tuple(ranks), ranks.index(rank), topo.crosses_nodes(ranks))


def new_groups(topo: Topology, name: str, rank: int, rank_lists: Sequence[Sequence[int]]) -> Group:
    """Create a ProcessGroup for every list (a collective: every rank must call this with the
    same lists in the same order) and return this rank's ``Group``.

    Every role ``name`` gets its own ProcessGroups, even over the same members as another
    role: two rings in flight at once (K/V and dK/dV) need two communicators, because NCCL
    ignores p2p tags and would serialize them on one. Groups are reused across strategies in
    one job by (role, members): creating a group is a collective with its own connections.
    """
    import torch.distributed as dist

    mine = plan_group(topo, name, rank, rank_lists)
    for ranks in rank_lists:
        pg = cached_group(name, ranks, topo.group_timeout_s, dist.new_group)
        if rank in ranks:
            mine = Group(mine.name, mine.ranks, mine.index, mine.crosses_nodes, pg)
    return mine


def cached_group(name: str, ranks: Sequence[int], timeout_s: float | None,
                 create: Callable[..., Any]) -> Any:
    """The ProcessGroup of role ``name`` over ``ranks`` under the current world: made once
    with ``create(ranks, timeout=...)`` (``dist.new_group``; a collective), then reused, and
    under ``set_timeout`` like every group here. Also how a library that makes its own groups
    (yunchang) gets them (strategies.yunchang_usp)."""
    import torch.distributed as dist

    members = tuple(sorted(ranks))
    cache = _pg_cache()
    world, pg = cache.get((name, members), (None, None))
    if world is not dist.group.WORLD:
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        pg = create(list(members), timeout=timeout)
        cache[(name, members)] = (dist.group.WORLD, pg)
    return pg


def set_timeout(seconds: float) -> None:
    """Make ``seconds`` the timeout of the default group and of every group created under it
    (the driver's per-case wait: a case's collectives wait about as long as it can take)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    setter = getattr(c10d, "_set_pg_timeout", None)  # private: no public setter to date
    timeout = timedelta(seconds=seconds)

    def set_on(pg: Any) -> None:
        # a group that keeps its own (cpbench.threadpg); torch's groups have a set_timeout
        # too, and keep the private setter they have always had here
        if getattr(type(pg), "keeps_own_timeout", False):
            pg.set_timeout(timeout)
        elif setter is not None:  # else every group keeps the timeout it was made with
            setter(timeout, pg)

    set_on(dist.group.WORLD)
    for world, pg in _pg_cache().values():
        # a group this rank is not in is a placeholder (GroupMember.NON_GROUP_MEMBER)
        if world is dist.group.WORLD and isinstance(pg, dist.ProcessGroup):
            set_on(pg)


def forget_groups() -> None:
    """Drop every cached group, before the groups are destroyed: a reference kept here would
    keep a gloo group's connections open, and its peers blocked on them."""
    _pg_cache().clear()
