"""The two-level ring shared by ``double-ring`` and ``burst`` (LoongTrain's DoubleRing).

A CP ring of N positions is cut into M windows of W consecutive positions. Each window is an
*inner* ring (by default the ranks of one node); the members at the same place of every
window form an *outer* ring (across nodes). A flat ring is the case M = 1.

``circulate`` moves a block around both levels: the block a rank holds at the start of
outer step j (its window's "base") is posted to the next window at once and only awaited at
the start of step j+1, so the slow inter-node hop hides behind W inner steps; meanwhile the
block circulates the inner ring. At (j, t) position w·W+i holds the block of position
((w-j) mod M)·W + (i-t) mod W. Over N = M·W steps every position sees every block once,
sending N-1 blocks like a flat ring, of which only M-1 cross nodes.

``HomeBound`` sends partial sums (dK/dV in double-ring, dQ in burst) home behind the blocks
they belong to, on a second set of groups with the same members: both rings are in flight
at once, and NCCL ignores p2p tags, so on one communicator they would serialize.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpbench.comm import RingComm
from cpbench.merge import OutLseAccumulator
from cpbench.strategies.base import FWD, Message, Step, Strategy, save_for_backward
from cpbench.strategies.layout import slice_len, zigzag_block
from cpbench.topology import Group, double_ring_groups


def double_ring_lists(cp_lists: list[list[int]], window: int, *, home: str
                      ) -> dict[str, list[list[int]]]:
    """The inner and outer rank lists of every CP ring, once for the blocks that circulate
    ("inner", "outer") and once for the partial sums going home ("inner_<home>",
    "outer_<home>"). Rings of one rank are left out (they would only send to themselves)."""
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

    def source(self, j: int, t: int) -> int:
        """Ring position whose block this rank holds at outer step j, inner step t."""
        w, i = divmod(self.position, self.window)
        return ((w - j) % self.windows) * self.window + (i - t) % self.window

    def circulate_messages(self, j: int, t: int, nbytes: int) -> list[Message]:
        """What ``circulate`` sends at (j, t)."""
        msgs = []
        if t == 0 and j + 1 < self.windows:  # awaited when the next window starts
            msgs.append(Message("p2p", self.outer.name, nbytes, self.outer.crosses_nodes,
                                overlap_steps=self.window))
        if t + 1 < self.window:
            msgs.append(Message("p2p", self.inner.name, nbytes, self.inner.crosses_nodes))
        return msgs

    def home_messages(self, j: int, t: int, nbytes: int) -> list[Message]:
        """What ``HomeBound.add`` sends at (j, t) on these rings. The last inner hop of a
        window is awaited at once (the outer hop needs it) and the last outer hop ends the
        pass: both exposed. The other outer hops are awaited a window later."""
        msgs = []  # add() runs after the step's kernel
        if self.window > 1:
            msgs.append(Message("p2p", self.inner.name, nbytes, self.inner.crosses_nodes,
                                overlapped=t + 1 < self.window, after_compute=True))
        if t + 1 == self.window and self.windows > 1:
            msgs.append(Message("p2p", self.outer.name, nbytes, self.outer.crosses_nodes,
                                overlapped=j + 1 < self.windows, overlap_steps=self.window,
                                after_compute=True))
        return msgs


def circulate(rings: Rings, block: torch.Tensor):
    """Yield (j, t, block held) for every step; the block comes from rings.source(j, t).

    The next transfers are already posted when a step is yielded, so the caller's compute
    overlaps them (the held block is in flight: read it, never write it); they are awaited
    when the caller asks for the next step.
    """
    inner = RingComm(rings.inner) if rings.inner else None
    outer = RingComm(rings.outer) if rings.outer else None
    base = next_base = block
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
    """Partial sums (fp32) of the block held at each step of ``circulate``, sent home on
    ``rings`` (the same positions as the circulating rings, other groups).

    A block's partial follows it one inner hop behind; after W hops it is back with the
    window's base holder, which passes it along the outer ring as the base went. After the
    last window it arrives at the block's owner: ``result()``.
    """

    def __init__(self, rings: Rings):
        self.rings = rings
        self.inner = RingComm(rings.inner) if rings.inner else None
        self.outer = RingComm(rings.outer) if rings.outer else None

    def add(self, j: int, t: int, partial: torch.Tensor) -> None:
        """This rank's contribution to the block it holds at (j, t); ``partial`` is consumed."""
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
            if j > 0:
                # what earlier windows summed for the same base block: added only now, so
                # its outer hop had this whole window to arrive in
                self.outer.wait()
                partial += self.from_outer
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
    """Local out, lse: K/V circulate the rings; each step computes the zigzag rule
    (layout.zigzag_block) of the block's source position, merged by LSE in fp32."""
    b, s, h, d = q.shape
    acc = OutLseAccumulator(b, s, h, d, q.device)
    # one buffer so K and V travel as one message
    for j, t, kv in circulate(rings, torch.stack([k, v])):
        blk = zigzag_block(rings.position, rings.source(j, t), s, strat.attn.causal)
        out, lse = strat.kernel_call("forward", q[:, blk.q], kv[0][:, blk.kv],
                                     kv[1][:, blk.kv], causal=blk.causal)
        acc.update(out, lse, blk.q)
    return acc.result(q.dtype)


class ZigzagRingsAttention(torch.autograd.Function):
    """The forward double-ring and burst share (``zigzag_forward`` on ``strat.rings``); each
    subclasses it with its own backward."""

    @staticmethod
    def forward(ctx, strat, q, k, v):
        out, lse = zigzag_forward(strat, strat.rings, q, k, v)
        save_for_backward(ctx, strat, q, k, v, out, lse, lse=lse)
        return out, lse


def forward_schedule(strat: Strategy, rings: Rings) -> list[Step]:
    """The steps of ``zigzag_forward``."""
    s = strat.local_seqlen
    kv = 2 * strat.kv_bytes(s)
    steps = []
    for index, (j, t) in enumerate(rings.steps()):
        blk = zigzag_block(rings.position, rings.source(j, t), s, strat.attn.causal)
        steps.append(strat.kernel_step(FWD, index, slice_len(blk.q, s), slice_len(blk.kv, s),
                                       blk.causal, rings.circulate_messages(j, t, kv)))
    return steps
