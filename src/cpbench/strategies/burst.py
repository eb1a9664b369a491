"""burst: BurstAttention (arXiv 2403.09347, OpenBMB/thunlp BurstAttention).

Forward: the zigzag K/V ring. With ``double_ring`` (default) it is the two-level ring of
``double-ring`` (shared code in ``_rings``: inner rings within a node, the outer hop across
nodes posted a whole inner ring ahead); without, one flat ring over the CP ranks.
Backward turns the ring around: K and V stay on their owner and the *queries* travel, with
everything their gradient needs: Q, dO, lse and delta = rowsum(O ⊙ dO). Each rank adds the
dK/dV of its own keys locally (fp32); the dQ partial sum of the queries it holds follows them
one hop behind and comes home like dK/dV do in double-ring (fp32), on its own groups
("inner_dq"/"outer_dq", flat: "ring_dq") so it never queues behind the query ring.
``opt_bwd`` (default): delta, one fp32 per query row, travels instead of O (a whole
activation), and nobody needs O again. Our kernels take O rather than delta but use it only
through rowsum(O ⊙ dO), so a receiver hands them the projection of O onto dO,
(delta / |dO|²)·dO, which has the same rowsum (upstream patches flash-attention to take
delta directly). Without ``opt_bwd`` O travels and each receiver's kernel derives delta.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
from cpbench.topology import Topology, node_local_block


def _pack(*parts: torch.Tensor) -> torch.Tensor:
    """Parts of mixed dtypes as one byte buffer, so the bundle travels as one message.
    fp32 parts go first, which keeps every part aligned for viewing it back."""
    return torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in parts])


def _unpack(buf: torch.Tensor, like: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    parts, at = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        parts.append(buf[at:at + n].view(t.dtype).view(t.shape))
        at += n
    return parts


def _delta(out_bshd: torch.Tensor, dout_bshd: torch.Tensor) -> torch.Tensor:
    """rowsum(O ⊙ dO) in fp32, laid out like lse (b, h, s)."""
    return (out_bshd.float() * dout_bshd.float()).sum(-1).transpose(1, 2)


def _out_seen_by_kernel(delta_bhs: torch.Tensor, dout_bshd: torch.Tensor) -> torch.Tensor:
    """An O with rowsum(O ⊙ dO) = delta: the projection of the true O onto dO."""
    do = dout_bshd.float()
    norm = (do * do).sum(-1)
    scale = torch.where(norm > 0, delta_bhs.transpose(1, 2) / norm, 0.0)
    return (scale.unsqueeze(-1) * do).to(dout_bshd.dtype)


class _BurstAttention(ZigzagRingsAttention):
    @staticmethod
    def backward(ctx, dout, _dlse):
        strat = ctx.strat
        rings, opt_bwd = strat.rings, strat.opts.opt_bwd
        q, k, v, out, lse = ctx.saved_tensors
        s = q.shape[1]
        dout = dout.contiguous()
        mine = (lse, _delta(out, dout), q, dout) if opt_bwd else (lse, q, dout, out)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        dq_home = HomeBound(strat.dq_rings)
        for j, t, bundle in circulate(rings, _pack(*mine)):
            if opt_bwd:
                their_lse, their_delta, their_q, their_dout = _unpack(bundle, mine)
                their_out = _out_seen_by_kernel(their_delta, their_dout)
            else:
                their_lse, their_q, their_dout, their_out = _unpack(bundle, mine)
            # the zigzag rule seen from the visiting queries' owner, against our keys
            blk = zigzag_block(rings.source(j, t), rings.position, s, strat.attn.causal)
            bq, bk, bv = strat.kernel_call("backward", their_dout[:, blk.q], their_q[:, blk.q],
                                           k[:, blk.kv], v[:, blk.kv], their_out[:, blk.q],
                                           their_lse[:, :, blk.q], causal=blk.causal)
            dk[:, blk.kv] += bk
            dv[:, blk.kv] += bv
            their_dq = torch.zeros_like(q, dtype=torch.float32)
            their_dq[:, blk.q] = bq.float()
            dq_home.add(j, t, their_dq)
        dq = dq_home.result()
        return None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@register
class Burst(ZigzagLayout, Strategy):
    name = "burst"
    description = ("BurstAttention: zigzag K/V (double) ring forward; backward keeps K/V home "
                   "and circulates Q, dO, lse, delta with dQ following")

    @dataclass(frozen=True, kw_only=True)
    class Options:
        double_ring: bool = option(True, "inner rings within a node and an outer ring across "
                                         "nodes (else one flat ring)")
        opt_bwd: bool = option(True, "backward sends delta = rowsum(O*dO) (fp32, one per "
                                     "query row) instead of O")

    @classmethod
    def variants(cls, topo: Topology) -> list:
        return [cls.Options(double_ring=True, opt_bwd=True),
                cls.Options(double_ring=False, opt_bwd=False)]

    @property
    def window(self) -> int:
        """Ranks per inner ring: those of a node with ``double_ring``, else the whole ring."""
        if self.opts.double_ring:
            return node_local_block(self.topo, self.cp_lists)
        return self.cp_size

    def resolved_options(self) -> dict:
        return {**super().resolved_options(), "window": self.window}

    def group_lists(self):
        if self.opts.double_ring:
            return double_ring_lists(self.cp_lists, self.window, home="dq")
        return {"ring": self.cp_lists, "ring_dq": self.cp_lists} if self.cp_size > 1 else {}

    @property
    def rings(self) -> Rings:
        """K/V forward, the query bundle backward."""
        if self.opts.double_ring:
            return Rings.of(self, self.window)
        return Rings.of(self, self.cp_size, ("ring", None))

    @property
    def dq_rings(self) -> Rings:
        if self.opts.double_ring:
            return Rings.of(self, self.window, ("inner_dq", "outer_dq"))
        return Rings.of(self, self.cp_size, ("ring_dq", None))

    def attention(self, q, k, v):
        return _BurstAttention.apply(self, q, k, v)

    def schedule(self) -> list[Step]:
        rings, home, s = self.rings, self.dq_rings, self.local_seqlen
        row = self.lse_bytes(s)  # lse, and delta: one fp32 per query row and head
        bundle = row + 2 * self.q_bytes(s) + (row if self.opts.opt_bwd else self.q_bytes(s))
        dq = self.q_bytes(s, element_size=4)
        steps = forward_schedule(self, rings)
        for index, (j, t) in enumerate(rings.steps()):
            blk = zigzag_block(rings.source(j, t), rings.position, s, self.attn.causal)
            msgs = rings.circulate_messages(j, t, bundle) + home.home_messages(j, t, dq)
            steps.append(self.kernel_step(BWD, index, slice_len(blk.q, s), slice_len(blk.kv, s),
                                          blk.causal, msgs))
        return steps
