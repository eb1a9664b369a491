"""double-ring: LoongTrain's DoubleRing attention (arXiv 2406.18485, InternEvo).

The CP ring is cut into windows of ``window`` consecutive positions: inner rings (by default
the ranks of one node) and outer rings linking the same place of every window (across
nodes). Layout: zigzag over the whole CP ring.
Forward: K/V circulate both levels (``_rings.circulate``): a window's block is posted across
nodes at the start of the window and awaited at the start of the next, so the inter-node hop
hides behind a whole inner ring; each step computes the zigzag rule of the block's source.
Backward: K/V go round again; each block's dK/dV partial sum (fp32) follows it one inner hop
behind, returns to the window's base holder after ``window`` hops, then takes the outer hop
with the base, arriving home after the last window (``_rings.HomeBound``). The dK/dV rings
are their own groups ("inner_dkv", "outer_dkv"), as LoongTrain's are. dQ is local.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpbench.errors import UsageError
from cpbench.strategies import register
from cpbench.strategies._rings import (
    HomeBound,
    Rings,
    ZigzagRingsAttention,
    circulate,
    double_ring_lists,
    forward_schedule,
)
from cpbench.strategies.base import BWD, Step, Strategy, option
from cpbench.strategies.layout import ZigzagLayout, slice_len, zigzag_block
from cpbench.topology import Topology, divisors, node_local_block


class _DoubleRingAttention(ZigzagRingsAttention):
    @staticmethod
    def backward(ctx, dout, _dlse):
        strat = ctx.strat
        rings = strat.rings
        q, k, v, out, lse = ctx.saved_tensors
        s = q.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv_home = HomeBound(strat.dkv_rings)
        for j, t, kv in circulate(rings, torch.stack([k, v])):
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
class DoubleRing(ZigzagLayout, Strategy):
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
        return [cls.Options(window=node_local_block(topo, [list(range(topo.world_size))]))]

    @property
    def window(self) -> int:
        return self.opts.window or node_local_block(self.topo, self.cp_lists)

    def resolved_options(self) -> dict:
        return {"window": self.window}

    def validate(self) -> None:
        n, w = self.cp_size, self.opts.window
        if w < 0 or (w and n % w):
            raise UsageError(f"double-ring --window {w} does not divide the CP ring of {n} "
                             f"ranks; use one of: {', '.join(map(str, divisors(n)))} "
                             f"(0: ranks per node)")
        super().validate()

    def group_lists(self):
        return double_ring_lists(self.cp_lists, self.window, home="dkv")

    @property
    def rings(self) -> Rings:
        return Rings.of(self, self.window)

    @property
    def dkv_rings(self) -> Rings:
        return Rings.of(self, self.window, ("inner_dkv", "outer_dkv"))

    def attention(self, q, k, v):
        return _DoubleRingAttention.apply(self, q, k, v)

    def schedule(self) -> list[Step]:
        rings, home, s = self.rings, self.dkv_rings, self.local_seqlen
        kv = 2 * self.kv_bytes(s)
        dkv = 2 * self.kv_bytes(s) * 4 // self.attn.element_size
        steps = forward_schedule(self, rings)
        for index, (j, t) in enumerate(rings.steps()):
            blk = zigzag_block(rings.position, rings.source(j, t), s, self.attn.causal)
            msgs = rings.circulate_messages(j, t, kv) + home.home_messages(j, t, dkv)
            steps.append(self.kernel_step(BWD, index, slice_len(blk.q, s), slice_len(blk.kv, s),
                                          blk.causal, msgs))
        return steps
