"""double-ring: LoongTrain's DoubleRing attention (arXiv 2406.18485; InternEvo
``zigzag_ring_flash_attn_with_sliding_window.py``, read in docs/upstream/loongtrain_double_ring.md).

The CP ring is cut into windows of ``window`` consecutive positions: inner rings (by default
the ranks of one node) and outer rings linking the same place of every window (across
nodes). Layout: zigzag over the whole CP ring.
Forward: K and V (two messages) circulate both levels (``_rings.circulate``): a window's
block is posted across nodes at the start of the window and awaited after its last kernel,
so the inter-node hop hides behind a whole inner ring; each step computes the zigzag rule of
the block's source.
Backward: K/V go round again. Each block's dK/dV partial sums (dK and dV, two messages) follow
it one inner hop behind, posted after each kernel and awaited after the next; the last inner
hop of a window is awaited at once, bringing the window's sum back to its base holder, which
sends it across nodes. The dK/dV rings are their own groups ("inner_dkv", "outer_dkv"), as
LoongTrain's are. dQ stays local (fp32).
As upstream by default: the dK/dV sums are fp32 inside the first window and travel in the
activation dtype from the first outer hop on (the outer hops, and the inner hops of later
windows, which carry the running total: upstream casts each window's result to the
activation dtype); an outer hop is awaited after the first kernel of the next window, whose
sum starts from it. Variants: ``--dkv-dtype fp32`` keeps every partial sum in fp32;
``--dkv-await window-end`` awaits the outer hop only at the end of the next window (a whole
window to hide it in), adding it to that window's own sum there.
Documents and windows: each step computes exactly what the mask lets the local queries see
of the held block (``kernels.masked``); an empty step computes nothing, but the K/V and the
dK/dV sums still travel their hops (the schedule does not change with the mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpbench.comm import RingComm
from cpbench.errors import UsageError
from cpbench.merge import sink_grad
from cpbench.strategies import register
from cpbench.strategies._rings import (
    EVERY,
    Rings,
    ZigzagRingsAttention,
    circulate,
    double_ring_lists,
    forward_schedule,
    fresh_sum,
    ring_areas,
    ring_step,
    send_block,
)
from cpbench.strategies.base import BWD, FWD, Message, Step, Strategy, option
from cpbench.strategies.layout import Block, ZigzagLayout, zigzag_block
from cpbench.topology import Topology, divisors, node_local_block

DKV_DTYPES = ("mixed", "fp32")
DKV_AWAITS = ("first-kernel", "window-end")


class _DkvHome:
    """dK/dV partial sums on their way home (``add`` after each step's kernel, ``result`` at
    the end), on the "inner_dkv"/"outer_dkv" rings."""

    def __init__(self, strat: "DoubleRing", like: tuple[torch.Tensor, torch.Tensor]):
        self.rings, self.strat, self.like = strat.dkv_rings, strat, like  # K and V
        self.inner = RingComm(self.rings.inner) if self.rings.inner else None
        self.outer = RingComm(self.rings.outer) if self.rings.outer else None
        self.late = strat.opts.dkv_await == "window-end"
        # (dK, dV) sums: the running one, what arrived from each ring, the final one
        self.acc: tuple[torch.Tensor, ...] | None = None
        self.from_inner: tuple[torch.Tensor, ...] | None = None
        self.from_outer: tuple[torch.Tensor, ...] | None = None
        self.total: tuple[torch.Tensor, ...] | None = None

    def add(self, j: int, t: int, rows: slice, bk: torch.Tensor, bv: torch.Tensor) -> None:
        """Add this rank's block gradients to the sums of the block it holds at (j, t) and
        pass them on."""
        if t > 0:
            assert self.inner is not None, "a window of more than one rank has an inner ring"
            self.inner.wait()
            self.acc = self.from_inner
        else:
            # a window's sum starts from the earlier windows' (awaited after its first kernel)
            self.acc = self._wait_outer() if j > 0 and not self.late else None
        if self.acc is None:
            dtype = self.strat.dkv_dtype(j)
            self.acc = tuple(fresh_sum(g, rows, x, dtype) for g, x in zip((bk, bv), self.like))
        else:
            self.acc[0][:, rows] += bk
            self.acc[1][:, rows] += bv
        if self.inner:
            self.from_inner = send_block(self.inner, self.acc)
        if t + 1 == self.rings.window:
            self._window_done(j)

    def _wait_outer(self) -> tuple[torch.Tensor, ...]:
        assert self.outer is not None and self.from_outer is not None, "a hop was sent"
        self.outer.wait()
        return self.from_outer

    def _window_done(self, j: int) -> None:
        if self.inner:  # the last inner hop: nothing left to hide it behind
            self.inner.wait()
            self.acc = self.from_inner
        assert self.acc is not None, "add() ran at this window's steps"
        if self.late and j > 0:
            self.acc = tuple(a + b for a, b in zip(self.acc, self._wait_outer()))
        crossing = self.strat.dkv_dtype(j + 1)  # upstream: the window's result, cast
        self.acc = tuple(a.to(crossing) for a in self.acc)
        if self.outer:
            self.from_outer = send_block(self.outer, self.acc)
        else:
            self.total = self.acc

    def result(self) -> tuple[torch.Tensor, ...]:
        total = self._wait_outer() if self.outer else self.total
        assert total is not None, "the last window is done"
        return total


def _block_grads(strat, src: int, s: int, dout, q, k, v, out, lse):
    """(block, dq, dk, dv) of the local queries against ring position ``src``'s K/V; a block
    the mask hides gives empty rows (nothing computed)."""
    if not strat.mask.plain:
        tiles = strat.ring_tiles(src)
        if not tiles:
            none = Block(slice(0, 0), slice(0, 0), False)
            return none, q[:, :0].float(), k[:, :0].float(), v[:, :0].float()
        return EVERY, *strat.masked_backward(dout, q, k, v, out, lse, tiles)
    blk = zigzag_block(strat.rings.position, src, s, strat.attn.causal)
    # the kernel needs the final out/lse rows of exactly the queries it sees
    return blk, *strat.kernel_call("backward", dout[:, blk.q], q[:, blk.q], k[:, blk.kv],
                                   v[:, blk.kv], out[:, blk.q], lse[:, :, blk.q],
                                   causal=blk.causal)


class _DoubleRingAttention(ZigzagRingsAttention):
    @staticmethod
    def backward(ctx, dout, _dlse):
        strat = ctx.strat
        rings = strat.rings
        q, k, v, out, lse, sinks = ctx.saved_tensors
        s = q.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        home = _DkvHome(strat, (k, v))
        for j, t, (bk_in, bv_in) in circulate(rings, (k, v)):
            blk, bq, bk, bv = _block_grads(strat, rings.source(j, t), s, dout, q, bk_in,
                                           bv_in, out, lse)
            dq[:, blk.q] += bq
            home.add(j, t, blk.kv, bk, bv)  # an empty block's sums go on all the same
        dk, dv = home.result()
        return (None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                sink_grad(out, dout, lse, sinks))


@register
class DoubleRing(ZigzagLayout, Strategy):
    name = "double-ring"
    masks = frozenset({"documents", "window"})
    takes_sinks = True
    description = ("LoongTrain DoubleRing: zigzag K/V inner rings within a node, "
                   "outer hop across nodes hidden behind a whole inner ring")

    @dataclass(frozen=True, kw_only=True)
    class Options:
        window: int = option(0, "ranks per inner ring; 0: ranks per node (the largest "
                                "divisor of the CP ring whose inner rings stay in a node)")
        dkv_dtype: str = option("mixed", "dtype of the dK/dV partial sums on the wire: mixed "
                                "(LoongTrain: fp32 inside the first window, then the "
                                "activation dtype) or fp32 (a cpbench variant)", DKV_DTYPES)
        dkv_await: str = option("first-kernel", "when the outer dK/dV hop is awaited: after "
                                "the first kernel of the next window (LoongTrain) or at its "
                                "end (a cpbench variant: a whole window to hide it)",
                                DKV_AWAITS)

    @classmethod
    def variants(cls, topo: Topology) -> list:
        # ranks per node: on >= 2 nodes that is >= 2 inner rings and real outer hops
        return [cls.Options(window=node_local_block(topo, [list(range(topo.world_size))]))]

    @property
    def window(self) -> int:
        return self.opts.window or node_local_block(self.topo, self.cp_lists)

    def resolved_options(self) -> dict:
        return {"window": self.window}

    def validate(self) -> None:
        n, w = self.cp_size, self.opts.window
        if w < 0 or (w and n % w):
            raise UsageError(f"double-ring --window {w} does not divide {n} ranks; use "
                             f"{', '.join(map(str, divisors(n)))} or 0 (ranks per node)")
        super().validate()

    def dkv_dtype(self, j: int) -> torch.dtype:
        """The dtype of the dK/dV sums in window ``j`` (its inner hops; window j+1's dtype is
        that of the outer hop closing window j)."""
        if self.opts.dkv_dtype == "fp32" or j == 0:
            return torch.float32
        return self.attn.torch_dtype

    def group_lists(self):
        return double_ring_lists(self.cp_lists, self.window, home="dkv")

    @property
    def rings(self) -> Rings:
        return Rings.of(self, self.window)

    @property
    def dkv_rings(self) -> Rings:
        return Rings.of(self, self.window, ("inner_dkv", "outer_dkv"))

    def late_accumulator_bytes(self, phase: str) -> int:
        # under a mask the masked kernel's fp32 dK/dV of a whole block start the sums as they
        # are (fresh_sum keeps them), cast to the activation dtype after the first window
        # (mixed): a copy of that size only
        if self.mask.plain or phase == FWD:
            return super().late_accumulator_bytes(phase)
        return 0 if self.opts.dkv_dtype == "fp32" else self.kv_bytes(self.local_seqlen)

    def attention(self, q, k, v, sinks=None):
        return _DoubleRingAttention.apply(self, q, k, v, sinks)

    def schedule(self) -> list[Step]:
        rings = self.rings
        kv = self.k_bytes(self.local_seqlen), self.v_bytes(self.local_seqlen)
        steps, home = forward_schedule(self, rings), self.dkv_rings
        for index, (j, t) in enumerate(rings.steps()):
            msgs = rings.circulate_messages(j, t, kv) + self._dkv_messages(j, t, home)
            steps.append(ring_step(self, rings, BWD, index, j, t, msgs))
        return steps

    def area_per_step(self) -> list[list[int]]:
        return ring_areas(self, self.window)

    def _dkv_messages(self, j: int, t: int, home: Rings) -> list[Message]:
        """What ``_DkvHome.add`` sends at (j, t), after the step's kernel: dK and dV
        (``home``: ``dkv_rings``)."""
        s = self.local_seqlen

        def sizes(dtype: torch.dtype) -> tuple[int, int]:  # dK, dV: each its own width
            return self.k_bytes(s, dtype.itemsize), self.v_bytes(s, dtype.itemsize)

        msgs = []
        if home.inner:  # the last of a window is awaited at once
            msgs += [Message("p2p", home.inner.name, n, home.inner.crosses_nodes,
                             overlapped=t + 1 < home.window, after_compute=True)
                     for n in sizes(self.dkv_dtype(j))]
        if home.outer and t + 1 == home.window:  # the last one ends the backward
            wait = home.window if self.opts.dkv_await == "window-end" else 1
            msgs += [Message("p2p", home.outer.name, n, home.outer.crosses_nodes,
                             overlapped=j + 1 < home.windows, overlap_steps=wait,
                             after_compute=True) for n in sizes(self.dkv_dtype(j + 1))]
        return msgs
