"""double-ring: LoongTrain's DoubleRing attention (arXiv 2406.18485, InternEvo).

The CP ring of N positions is cut into M windows of W consecutive positions. Each window is
an *inner* ring (by default the ranks of one node); the members at the same place of every
window form an *outer* ring (across nodes). Layout: zigzag over the whole CP ring.

Forward, for each of the M outer steps j: the K/V block a rank holds at the start of the
step (its window's "base") is posted to the next window at once and only awaited at the start
of step j+1, so the slow inter-node hop hides behind W inner steps; meanwhile K/V circulate
the inner ring. At (j, t) position w·W+i holds the block of position ((w-j) mod M)·W + (i-t)
mod W, and the zigzag rule (layout.zigzag_block) of that source position says which half
meets which. Over N = M·W steps every position sees every block once, sending (N-1) blocks
like a flat ring, of which only M-1 cross nodes.
Backward: K/V go round again; each block's dK/dV partial sum follows it one inner hop
behind, comes back to the window's base holder after W hops, and then takes the outer hop
with the base, arriving home after M windows (fp32, same groups, other tags). dQ is local.

``circulate``, ``HomeBound`` and ``zigzag_forward`` are shared with ``burst``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpbench.comm import RingComm
from cpbench.merge import OutLseAccumulator
from cpbench.strategies import register
from cpbench.strategies.base import BWD, FWD, Message, Step, Strategy, option
from cpbench.strategies.layout import check_divisible, zigzag_block, zigzag_index
from cpbench.topology import Group, Topology, divisors, double_ring_groups


def node_window(topo: Topology, cp_lists: list[list[int]]) -> int:
    """The largest window whose inner rings never leave a node: ranks per node for a ring of
    consecutive ranks, 1 for a ring that visits one rank per node (e.g. USP head-first)."""
    n = len(cp_lists[0])
    return max(w for w in divisors(n)
               if not any(topo.crosses_nodes(ring[s:s + w])
                          for ring in cp_lists for s in range(0, n, w)))


def double_ring_lists(cp_lists: list[list[int]], window: int) -> dict[str, list[list[int]]]:
    """The inner and outer rank lists of every CP ring; rings of one rank are left out (they
    would only send to themselves)."""
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
    return lists


def _len(part: slice, total: int) -> int:
    return len(range(total)[part])


@dataclass(frozen=True)
class Rings:
    """One rank's view of a CP ring split into ``windows`` inner rings of ``window``
    positions. ``inner``/``outer`` are None where that ring is a single rank."""

    position: int
    window: int
    windows: int
    inner: Group | None
    outer: Group | None

    def steps(self):
        return [(j, t) for j in range(self.windows) for t in range(self.window)]

    def source(self, j: int, t: int) -> int:
        """Ring position whose block this rank holds at outer step j, inner step t."""
        w, i = divmod(self.position, self.window)
        return ((w - j) % self.windows) * self.window + (i - t) % self.window

    def circulate_messages(self, j: int, t: int, nbytes: int) -> list[Message]:
        """What ``circulate`` sends at (j, t)."""
        msgs = []
        if t == 0 and j + 1 < self.windows:
            msgs.append(Message("p2p", self.outer.name, nbytes, self.outer.crosses_nodes))
        if t + 1 < self.window:
            msgs.append(Message("p2p", self.inner.name, nbytes, self.inner.crosses_nodes))
        return msgs

    def home_messages(self, j: int, t: int, nbytes: int) -> list[Message]:
        """What ``HomeBound.add`` sends at (j, t). The last inner hop of a window is awaited
        at once (the outer hop needs it) and the last outer hop ends the pass: both exposed."""
        msgs = []
        if self.window > 1:
            msgs.append(Message("p2p", self.inner.name, nbytes, self.inner.crosses_nodes,
                                overlapped=t + 1 < self.window))
        if t + 1 == self.window and self.windows > 1:
            msgs.append(Message("p2p", self.outer.name, nbytes, self.outer.crosses_nodes,
                                overlapped=j + 1 < self.windows))
        return msgs


def circulate(rings: Rings, block: torch.Tensor, tag: int = 0):
    """Yield (j, t, block held) for every step; the block comes from rings.source(j, t).

    The next transfers are already posted when a step is yielded, so the caller's compute
    overlaps them (the held block is in flight: read it, never write it); they are awaited
    when the caller asks for the next step.
    """
    inner = RingComm(rings.inner, tag=tag) if rings.inner else None
    outer = RingComm(rings.outer, tag=tag) if rings.outer else None
    base = block
    for j in range(rings.windows):
        if j > 0:
            outer.wait()
            base = next_base
        if j + 1 < rings.windows:
            next_base = outer.send_recv(base)
            outer.commit()
        held = base
        for t in range(rings.window):
            if t + 1 < rings.window:
                nxt = inner.send_recv(held)
                inner.commit()
            yield j, t, held
            if t + 1 < rings.window:
                inner.wait()
                held = nxt


class HomeBound:
    """Partial sums (fp32) of the block held at each step of ``circulate``, sent home.

    A block's partial follows it one inner hop behind; after W hops it is back with the
    window's base holder, which passes it along the outer ring as the base went. After the
    last window it arrives at the block's owner: ``result()``.
    """

    def __init__(self, rings: Rings, tag: int):
        self.rings = rings
        self.inner = RingComm(rings.inner, tag=tag) if rings.inner else None
        self.outer = RingComm(rings.outer, tag=tag) if rings.outer else None

    def add(self, j: int, t: int, partial: torch.Tensor) -> None:
        """This rank's contribution to the block it holds at (j, t); ``partial`` is consumed."""
        if t == 0 and j > 0:  # what earlier windows summed for this window's base
            self.outer.wait()
            partial += self.from_outer
        if t > 0:
            self.inner.wait()
            partial += self.from_inner
        if self.inner:
            self.from_inner = self.inner.send_recv(partial)
            self.inner.commit()
        if t + 1 == self.rings.window:
            if self.inner:
                self.inner.wait()
                partial = self.from_inner  # the whole window's sum for our base block
            if self.outer:
                self.from_outer = self.outer.send_recv(partial)
                self.outer.commit()
            else:
                self.total = partial

    def result(self) -> torch.Tensor:
        if self.outer:
            self.outer.wait()
            return self.from_outer
        return self.total


def zigzag_forward(strat: Strategy, rings: Rings, q, k, v):
    """Local out, lse: the zigzag K/V double ring (shared with burst)."""
    b, s, h, d = q.shape
    acc = OutLseAccumulator(b, s, h, d, q.device)
    # one buffer so K and V travel as one message
    for j, t, kv in circulate(rings, torch.stack([k, v])):
        blk = zigzag_block(rings.position, rings.source(j, t), s, strat.attn.causal)
        out, lse = strat.kernel_call("forward", q[:, blk.q], kv[0][:, blk.kv],
                                     kv[1][:, blk.kv], causal=blk.causal)
        acc.update(out, lse, blk.q)
    return acc.result(q.dtype)


def forward_schedule(strat: Strategy, rings: Rings) -> list[Step]:
    """The steps of ``zigzag_forward``."""
    s = strat.local_seqlen
    kv = 2 * strat.kv_bytes(s)
    steps = []
    for index, (j, t) in enumerate(rings.steps()):
        blk = zigzag_block(rings.position, rings.source(j, t), s, strat.attn.causal)
        flops = strat.block_flops(_len(blk.q, s), _len(blk.kv, s), blk.causal, FWD)
        steps.append(Step(FWD, index, flops, tuple(rings.circulate_messages(j, t, kv))))
    return steps


class _DoubleRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, strat: "DoubleRing", q, k, v):
        out, lse = zigzag_forward(strat, strat.rings, q, k, v)
        ctx.strat = strat
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        strat = ctx.strat
        rings = strat.rings
        q, k, v, out, lse = ctx.saved_tensors
        s = q.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv_home = HomeBound(rings, tag=1)  # tag 0 is the K/V ring on the same groups
        for j, t, kv in circulate(rings, torch.stack([k, v]), tag=0):
            blk = zigzag_block(rings.position, rings.source(j, t), s, strat.attn.causal)
            # the kernel needs the final out/lse rows of exactly the queries it sees
            bq, bk, bv = strat.kernel_call("backward", dout[:, blk.q], q[:, blk.q],
                                           kv[0][:, blk.kv], kv[1][:, blk.kv],
                                           out[:, blk.q], lse[:, :, blk.q], causal=blk.causal)
            dq[:, blk.q] += bq
            dkv = torch.zeros_like(kv, dtype=torch.float32)
            dkv[0][:, blk.kv] = bk.float()
            dkv[1][:, blk.kv] = bv.float()
            dkv_home.add(j, t, dkv)
        dkv = dkv_home.result()
        return None, dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


@register
class DoubleRing(Strategy):
    name = "double-ring"
    description = ("LoongTrain DoubleRing: zigzag K/V inner rings within a node, "
                   "outer hop across nodes hidden behind a whole inner ring")

    @dataclass(frozen=True, kw_only=True)
    class Options:
        window: int = option(0, "ranks per inner ring; 0: ranks per node (the largest "
                                "divisor of the CP ring whose inner rings stay in a node)")

    @classmethod
    def variants(cls, topo: Topology) -> list:
        # ranks per node: on >= 2 nodes that is >= 2 inner rings and real outer hops
        return [cls.Options(window=node_window(topo, [list(range(topo.world_size))]))]

    @property
    def window(self) -> int:
        return self.opts.window or node_window(self.topo, self.cp_lists)

    def validate(self) -> None:
        n, w = self.cp_size, self.opts.window
        if w < 0 or (w and n % w):
            raise ValueError(f"double-ring --window {w} does not divide the CP ring of {n} "
                             f"ranks; use one of: {', '.join(map(str, divisors(n)))} "
                             f"(0: ranks per node)")
        check_divisible(self.attn.seqlen, 2 * n, f"zigzag over {n} ranks (2 chunks per rank)")

    def group_lists(self):
        return double_ring_lists(self.cp_lists, self.window)

    @property
    def rings(self) -> Rings:
        return Rings(self.cp_index(self.rank), self.window, self.cp_size // self.window,
                     self.groups.get("inner"), self.groups.get("outer"))

    def seq_index(self, rank: int) -> torch.Tensor:
        return zigzag_index(self.attn.seqlen, self.cp_size, self.cp_index(rank))

    def attention(self, q, k, v):
        return _DoubleRingAttention.apply(self, q, k, v)

    def schedule(self) -> list[Step]:
        rings, s = self.rings, self.local_seqlen
        kv = 2 * self.kv_bytes(s)
        dkv = 2 * self.kv_bytes(s) * 4 // self.attn.element_size
        steps = forward_schedule(self, rings)
        for index, (j, t) in enumerate(rings.steps()):
            blk = zigzag_block(rings.position, rings.source(j, t), s, self.attn.causal)
            flops = self.block_flops(_len(blk.q, s), _len(blk.kv, s), blk.causal, BWD)
            msgs = rings.circulate_messages(j, t, kv) + rings.home_messages(j, t, dkv)
            steps.append(Step(BWD, index, flops, tuple(msgs)))
        return steps
