"""The two-level ring shared by ``double-ring`` and ``burst``: LoongTrain's DoubleRing, which
Burst-Attention's double ring matches hop for hop (docs/upstream/loongtrain_double_ring.md,
docs/upstream/burst_attention.md).

A CP ring of N positions is cut into M windows of W consecutive positions. Each window is an
*inner* ring (by default the ranks of one node); the members at the same place of every
window form an *outer* ring (across nodes). A flat ring is the case M = 1.

``circulate`` moves a block around both levels: the block a rank holds at the start of
outer step j (its window's "base") is posted to the next window at once and only awaited
after the window's last kernel, so the slow inter-node hop hides behind W inner steps;
meanwhile the block circulates the inner ring. At (j, t) position w·W+i holds the block of
position ((w-j) mod M)·W + (i-t) mod W. Over N = M·W steps every position sees every block
once, sending N-1 blocks like a flat ring, of which only M-1 cross nodes. A block is several
tensors, each its own message of one batch, as both upstreams send them (K and V; burst's
backward bundle of four).

The partial sums that go home behind the blocks (double-ring's dK/dV, burst's dQ) take each
upstream's own path, so each strategy keeps its own next to its schedule.
Under documents or a window (``cpbench.mask``, double-ring only) a step computes exactly what
the local queries see of the held block by their global positions (``kernels.masked``), not
the zigzag rule; a step that sees nothing computes nothing, and the blocks still travel.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from cpbench.comm import RingComm
from cpbench.merge import OutLseAccumulator, add_sink
from cpbench.strategies.base import FWD, Message, Step, Strategy, save_for_backward
from cpbench.strategies.layout import Block, slice_len, zigzag_block
from cpbench.topology import Group, double_ring_groups


def double_ring_lists(cp_lists: list[list[int]], window: int, *, home: str
                      ) -> dict[str, list[list[int]]]:
    """The inner and outer rank lists of every CP ring, once for the blocks that circulate
    ("inner", "outer") and once for the partial sums going home ("inner_<home>",
    "outer_<home>"): both upstreams give those their own communicators. Rings of one rank
    are left out (upstream sends to itself there: no byte leaves the rank)."""
    inner, outer = [], []
    for ring in cp_lists:
        ring_inner, ring_outer = double_ring_groups(ring, window)
        inner += ring_inner
        outer += ring_outer
    lists = {}
    if window > 1:
        lists["inner"] = inner
    if len(cp_lists[0]) > window:
        lists["outer"] = outer
    return {**lists, **{f"{role}_{home}": ranks for role, ranks in lists.items()}}


@dataclass(frozen=True)
class Rings:
    """One rank's view of a CP ring split into ``windows`` inner rings of ``window``
    positions. ``inner``/``outer`` are None where that ring is a single rank."""

    position: int
    window: int
    windows: int
    inner: Group | None
    outer: Group | None

    @classmethod
    def of(cls, strat: Strategy, window: int, roles: tuple[str, str | None] = ("inner", "outer")
           ) -> "Rings":
        """``strat``'s rank on the groups named ``roles`` (inner, outer), in windows of
        ``window``; ``window`` = the CP size is one flat ring."""
        inner, outer = (strat.groups.get(role) if role else None for role in roles)
        return cls(strat.cp_index(strat.rank), window, strat.cp_size // window, inner, outer)

    def steps(self):
        return [(j, t) for j in range(self.windows) for t in range(self.window)]

    @property
    def last(self) -> tuple[int, int]:
        return self.windows - 1, self.window - 1

    def source(self, j: int, t: int) -> int:
        """Ring position whose block this rank holds at outer step j, inner step t."""
        w, i = divmod(self.position, self.window)
        return ((w - j) % self.windows) * self.window + (i - t) % self.window

    def circulate_messages(self, j: int, t: int, sizes: tuple[int, ...]) -> list[Message]:
        """What ``circulate`` sends at (j, t): one message per tensor of the block."""
        msgs: list[Message] = []
        if t == 0 and j + 1 < self.windows:  # awaited after the window's last kernel
            assert self.outer is not None, "more than one window has an outer ring"
            msgs += _hops(self.outer.name, self.outer.crosses_nodes, sizes, self.window)
        if t + 1 < self.window:
            assert self.inner is not None, "a window of more than one rank has an inner ring"
            msgs += _hops(self.inner.name, self.inner.crosses_nodes, sizes, 1)
        return msgs


@lru_cache(maxsize=4096)
def _hops(group: str, crosses_nodes: bool, sizes: tuple[int, ...], overlap_steps: int
          ) -> tuple[Message, ...]:
    """One p2p message per size (immutable: every step and rank of a schedule shares them)."""
    return tuple(Message("p2p", group, n, crosses_nodes, overlap_steps=overlap_steps)
                 for n in sizes)


def send_block(comm: RingComm, block: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Each tensor of ``block`` to the next rank, one message each, posted as one batch."""
    got = tuple(comm.send_recv(x) for x in block)
    comm.commit()
    return got


def circulate(rings: Rings, block: tuple[torch.Tensor, ...], *, queue_behind: bool = False):
    """Yield (j, t, block held) for every step; the block comes from rings.source(j, t).

    The next transfers are already posted when a step is yielded, so the caller's compute
    overlaps them (the held block is in flight: read it, never write it); they are awaited
    when the caller asks for the next step. ``queue_behind``: the inner ring shares its
    communicator with another ring on purpose (burst's flat dQ ring, as upstream).
    """
    inner = RingComm(rings.inner, queue_behind=queue_behind) if rings.inner else None
    outer = RingComm(rings.outer) if rings.outer else None
    base = next_base = block
    # a ring of more than one window has an outer comm, a window of more than one an inner
    for j in range(rings.windows):
        if j > 0:
            assert outer is not None
            outer.wait()
            base = next_base
        if j + 1 < rings.windows:
            assert outer is not None
            next_base = send_block(outer, base)
        held = base
        for t in range(rings.window):
            if t + 1 < rings.window:
                assert inner is not None
                nxt = send_block(inner, held)
            yield j, t, held
            if t + 1 < rings.window:
                assert inner is not None
                inner.wait()
                held = nxt


def fresh_sum(part: torch.Tensor, rows: slice, like: torch.Tensor, dtype: torch.dtype
              ) -> torch.Tensor:
    """A new partial sum shaped like ``like`` holding ``part`` at ``rows`` (dim 1): the
    kernel's own output when it covers every row (no zero-fill), else zeros around it."""
    if slice_len(rows, like.shape[1]) == like.shape[1]:
        return part.to(dtype)
    out = torch.zeros_like(like, dtype=dtype)
    out[:, rows] = part
    return out


EVERY = Block(slice(None), slice(None), False)  # a masked step: all local rows and keys


def zigzag_forward(strat: Strategy, rings: Rings, q, k, v, sinks=None):
    """Local out, lse: K and V circulate the rings; each step computes the zigzag rule
    (layout.zigzag_block) of the block's source position, or under a mask what it lets
    through, merged by LSE in fp32."""
    b, s, h, _ = q.shape
    acc = OutLseAccumulator(b, s, h, v.shape[-1], q.device)  # out: V's width
    for j, t, (bk, bv) in circulate(rings, (k, v)):
        if not strat.mask.plain:
            tiles = strat.ring_tiles(rings.source(j, t))
            if tiles:  # an empty block is skipped, not computed as masked zeros
                acc.update(*strat.masked_forward(q, bk, bv, tiles))
            continue
        blk = zigzag_block(rings.position, rings.source(j, t), s, strat.attn.causal)
        out, lse = strat.kernel_call("forward", q[:, blk.q], bk[:, blk.kv], bv[:, blk.kv],
                                     causal=blk.causal)
        acc.update(out, lse, blk.q)
    out, lse = add_sink(*acc.result(torch.float32), sinks)  # once, after every step
    return out.to(q.dtype), lse


class ZigzagRingsAttention(torch.autograd.Function):
    """The forward double-ring and burst share (``zigzag_forward`` on ``strat.rings``); each
    subclasses it with its own backward."""

    @staticmethod
    def forward(ctx, strat, q, k, v, sinks):
        out, lse = zigzag_forward(strat, strat.rings, q, k, v, sinks)
        save_for_backward(ctx, strat, q, k, v, out, lse, sinks, lse=lse)
        return out, lse


def ring_step(strat: Strategy, rings: Rings, phase: str, index: int, j: int, t: int,
              msgs) -> Step:
    """Step (j, t)'s kernel work: the zigzag rule of its block's source, or the pairs the
    mask lets through."""
    s, src = strat.local_seqlen, rings.source(j, t)
    if not strat.mask.plain:
        tiles = strat.ring_tiles(src)
        return strat.pairs_step(phase, index, tiles.pairs, (s, s), msgs, tiles)
    blk = zigzag_block(rings.position, src, s, strat.attn.causal)
    return strat.kernel_step(phase, index, slice_len(blk.q, s), slice_len(blk.kv, s),
                             blk.causal, msgs)


def ring_areas(strat: Strategy, window: int) -> list[list[int]]:
    """Per rank, the attended pairs of each step, in the rings' order (the layout and the
    mask)."""
    out = []
    for r in range(strat.world_size):
        ring = next(lst for lst in strat.cp_lists if r in lst)
        rings = Rings(ring.index(r), window, len(ring) // window, None, None)
        mine = strat.seq_index(r)
        out.append([strat.mask.pairs(mine, strat.seq_index(ring[rings.source(j, t)]))
                    for j, t in rings.steps()])
    return out


def forward_schedule(strat: Strategy, rings: Rings) -> list[Step]:
    """The steps of ``zigzag_forward``: K and V, one message each."""
    kv = strat.k_bytes(strat.local_seqlen), strat.v_bytes(strat.local_seqlen)
    return [ring_step(strat, rings, FWD, index, j, t, rings.circulate_messages(j, t, kv))
            for index, (j, t) in enumerate(rings.steps())]
