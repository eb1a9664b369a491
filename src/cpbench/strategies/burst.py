"""burst: BurstAttention (arXiv 2403.09347; MayDomine/Burst-Attention, the paper's official
code: ``burst_attn/burst_attn_interface.py``, ``burst_attn/comm.py``, read in
docs/upstream/burst_attention.md).

Forward: the zigzag K/V ring, K and V as two messages. With ``double_ring`` (default) it is
the two-level ring of ``double-ring`` (shared code in ``_rings``: inner rings within a node,
the outer hop across nodes posted a whole inner ring ahead); without, one flat ring.
Backward turns the ring around: K and V stay on their owner and the *queries* travel, with
everything their gradient needs, four messages per hop in upstream's order: delta =
rowsum(O ⊙ dO) (``opt_bwd``: fp32, one per query row and head) or O itself, dO, Q, lse.
Each rank adds the dK/dV of its own keys locally (fp32). The dQ partial sum of the queries
a rank held at the previous step moves on before the step's kernel (after the bundle) and
is awaited after it, as upstream:
- in the activation dtype (``--dq-dtype fp32``: a cpbench variant);
- flat ring: on the query ring's own communicator, the two queueing on NCCL (``--dq-group
  separate``: a cpbench variant with both in flight at once); N hops, the last exposed;
- double ring: on groups of its own ("inner_dq", "outer_dq", as upstream's benchmark and
  test build them). At a window boundary the sum goes straight onto the outer ring from the
  rank that held the window's last step, and the new base queries' sum starts at zero; the
  sum that came across is added at the next boundary, just before it crosses again (W
  kernels to arrive in). After the last step: one outer hop, then one inner hop home, both
  exposed. So M(W-1)+1 inner and M outer hops per rank.
``opt_bwd`` (default, as upstream's benchmark): upstream hands delta to a patched
flash-attention (``softmax_d``) with an uninitialised O. cpbench's kernels cannot take delta
(``kernels.base``: ``backward`` takes O and derives delta = rowsum(O ⊙ dO) itself, as aten's
CPU flash backward and stock flash-attn do), so a receiver hands them the projection of O
onto dO, (delta / |dO|²)·dO, which has the same rowsum, built only for the rows the step's
kernel reads: a memory-bound pass over dO that upstream does not pay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpbench.comm import RingComm
from cpbench.errors import UsageError
from cpbench.merge import sink_grad
from cpbench.strategies import register
from cpbench.strategies._rings import (
    Rings,
    ZigzagRingsAttention,
    circulate,
    double_ring_lists,
    forward_schedule,
    fresh_sum,
    send_block,
)
from cpbench.strategies.base import BWD, FWD, Message, Step, Strategy, option
from cpbench.strategies.layout import ZigzagLayout, slice_len, zigzag_block
from cpbench.topology import Topology, node_local_block

DQ_DTYPES = ("activation", "fp32")
DQ_GROUPS = ("shared", "separate")


def _delta(out_bshd: torch.Tensor, dout_bshd: torch.Tensor) -> torch.Tensor:
    """rowsum(O ⊙ dO) in fp32, laid out like lse (b, h, s)."""
    return (out_bshd.float() * dout_bshd.float()).sum(-1).transpose(1, 2).contiguous()


def _out_seen_by_kernel(delta_bhs: torch.Tensor, dout_bshd: torch.Tensor) -> torch.Tensor:
    """An O with rowsum(O ⊙ dO) = delta: the projection of the true O onto dO."""
    do = dout_bshd.float()
    norm = (do * do).sum(-1)
    scale = torch.where(norm > 0, delta_bhs.transpose(1, 2) / norm, 0.0)
    return (scale.unsqueeze(-1) * do).to(dout_bshd.dtype)


class _DqHome:
    """Burst-Attention's dQ path: ``post`` before each step's kernel, ``add`` after it,
    ``result`` at the end (the module docstring says where each hop goes)."""

    def __init__(self, strat: "Burst", like: torch.Tensor):
        self.rings, self.like = strat.dq_rings, like
        self.dtype = torch.float32 if strat.opts.dq_dtype == "fp32" else like.dtype
        self.inner = (RingComm(self.rings.inner, queue_behind=strat.dq_shares_ring)
                      if self.rings.inner else None)
        self.outer = RingComm(self.rings.outer) if self.rings.outer else None
        # the running sum and what arrived from each ring: set as the steps go (asserted
        # where a step needs one: a hop on a ring of one rank is never asked for)
        self.acc: torch.Tensor | None = None
        self.from_inner: torch.Tensor | None = None
        self.from_outer: torch.Tensor | None = None

    def post(self, j: int, t: int) -> None:
        """Before (j, t)'s kernel: the sum of the queries held at the step before moves on."""
        if t > 0:
            assert self.inner is not None and self.acc is not None
            self.from_inner = send_block(self.inner, (self.acc,))[0]
        elif j > 0:  # a window boundary
            self._cross(j)
            self.acc = None

    def add(self, t: int, rows: slice, bq: torch.Tensor) -> None:
        """After the kernel: this rank's part of the held queries' dQ joins their sum."""
        if t > 0:
            assert self.inner is not None and self.from_inner is not None
            self.inner.wait()
            self.acc = self.from_inner
            self.acc[:, rows] += bq
        else:  # the first step, or a new base after a boundary: its sum starts here
            self.acc = fresh_sum(bq, rows, self.like, self.dtype)

    def _cross(self, j: int) -> None:
        """The sum goes onto the outer ring, with what crossed at the boundary before added."""
        assert self.outer is not None and self.acc is not None
        if j > 1:
            assert self.from_outer is not None
            self.outer.wait()
            self.acc += self.from_outer
        self.from_outer = send_block(self.outer, (self.acc,))[0]

    def result(self) -> torch.Tensor:
        """After the last step: one outer hop (if any), then one inner hop (if any), each
        awaited at once; each rank then holds its own queries' dQ."""
        total = self.acc
        if self.outer:
            self._cross(self.rings.windows)
            self.outer.wait()
            total = self.from_outer
        if self.inner:
            assert total is not None
            total = send_block(self.inner, (total,))[0]
            self.inner.wait()
        assert total is not None
        return total


class _BurstAttention(ZigzagRingsAttention):
    @staticmethod
    def backward(ctx, dout, _dlse):
        strat = ctx.strat
        rings, opt_bwd = strat.rings, strat.opts.opt_bwd
        q, k, v, out, lse, sinks = ctx.saved_tensors
        s = q.shape[1]
        dout = dout.contiguous()
        mine = (_delta(out, dout) if opt_bwd else out, dout, q, lse)
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        dq = _DqHome(strat, q)
        for j, t, (their_d, their_dout, their_q, their_lse) in circulate(
                rings, mine, queue_behind=strat.dq_shares_ring):
            dq.post(j, t)
            # the zigzag rule seen from the visiting queries' owner, against our keys
            blk = zigzag_block(rings.source(j, t), rings.position, s, strat.attn.causal)
            rows_dout = their_dout[:, blk.q]
            their_out = (_out_seen_by_kernel(their_d[:, :, blk.q], rows_dout) if opt_bwd
                         else their_d[:, blk.q])
            bq, bk, bv = strat.kernel_call("backward", rows_dout, their_q[:, blk.q],
                                           k[:, blk.kv], v[:, blk.kv], their_out,
                                           their_lse[:, :, blk.q], causal=blk.causal)
            dk[:, blk.kv] += bk
            dv[:, blk.kv] += bv
            dq.add(t, blk.q, bq)
        return (None, dq.result().to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                sink_grad(out, dout, lse, sinks))


@register
class Burst(ZigzagLayout, Strategy):
    name = "burst"
    takes_sinks = True
    description = ("BurstAttention: zigzag K/V (double) ring forward; backward keeps K/V home "
                   "and circulates Q, dO, lse, delta with dQ following")

    @dataclass(frozen=True, kw_only=True)
    class Options:
        double_ring: bool = option(True, "inner rings within a node and an outer ring across "
                                         "nodes (else one flat ring)")
        opt_bwd: bool = option(True, "backward sends delta = rowsum(O*dO) (fp32, one per "
                                     "query row) instead of O")
        dq_dtype: str = option("activation", "dtype of the dQ partial sums on the wire: the "
                               "activation dtype (Burst-Attention) or fp32 (a cpbench "
                               "variant)", DQ_DTYPES)
        dq_group: str = option("shared", "flat ring only: dQ on the query ring's "
                               "communicator (Burst-Attention) or a separate one (a cpbench "
                               "variant: both in flight at once); the double ring's dQ "
                               "always has its own groups, as upstream's", DQ_GROUPS)

    @classmethod
    def variants(cls, topo: Topology) -> list:
        return [cls.Options(double_ring=True, opt_bwd=True),
                cls.Options(double_ring=False, opt_bwd=False)]

    def validate(self) -> None:
        if self.opts.double_ring and self.opts.dq_group != "shared":
            raise UsageError("burst --dq-group separate applies to the flat ring "
                             "(--no-double-ring): the double ring's dQ always has its own "
                             "inner and outer groups")
        super().validate()

    @property
    def window(self) -> int:
        """Ranks per inner ring: those of a node with ``double_ring``, else the whole ring."""
        if self.opts.double_ring:
            return node_local_block(self.topo, self.cp_lists)
        return self.cp_size

    @property
    def dq_shares_ring(self) -> bool:
        """dQ rides the query ring's own communicator (the flat ring, as upstream)."""
        return not self.opts.double_ring and self.opts.dq_group == "shared"

    def resolved_options(self) -> dict:
        return {**super().resolved_options(), "window": self.window}

    def group_lists(self):
        if self.opts.double_ring:
            return double_ring_lists(self.cp_lists, self.window, home="dq")
        if self.cp_size == 1:
            return {}
        return {"ring": self.cp_lists, **({} if self.dq_shares_ring else
                                          {"ring_dq": self.cp_lists})}

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
        return Rings.of(self, self.cp_size, ("ring" if self.dq_shares_ring else "ring_dq", None))

    def late_accumulator_bytes(self, phase: str) -> int:
        return 0  # its sums exist before the first call

    def accumulator_bytes(self, phase: str) -> int:
        if phase == FWD:
            return super().accumulator_bytes(phase)
        # K/V stay home: their fp32 dK, dV; dQ is the partial sum that travels
        s = self.local_seqlen
        dq = self.q_bytes(s, element_size=4 if self.opts.dq_dtype == "fp32" else None)
        return self.kv_bytes(s) * 4 // self.attn.element_size + dq

    def call_setup_bytes(self, phase: str) -> tuple[int, int]:
        """With delta on the wire, each backward step rebuilds an O for the kernel
        (_out_seen_by_kernel: from dO and the scaled dO in fp32)."""
        if phase == FWD or not self.opts.opt_bwd:
            return 0, 0
        s = self.local_seqlen  # .float() of fp32 is no copy
        return self.out_bytes(s), 2 * self.out_bytes(s, element_size=4) * (
            self.attn.element_size < 4)

    def attention(self, q, k, v, sinks=None):
        return _BurstAttention.apply(self, q, k, v, sinks)

    def schedule(self) -> list[Step]:
        rings, s = self.rings, self.local_seqlen
        row, out = self.lse_bytes(s), self.out_bytes(s)  # lse / delta: one fp32 per row, head
        bundle = (row if self.opts.opt_bwd else out, out, self.q_bytes(s), row)  # delta or O,
        # dO (V's width), Q, lse
        steps, home = forward_schedule(self, rings), self.dq_rings
        for index, (j, t) in enumerate(rings.steps()):
            blk = zigzag_block(rings.source(j, t), rings.position, s, self.attn.causal)
            msgs = rings.circulate_messages(j, t, bundle) + self._dq_messages(j, t, home)
            steps.append(self.kernel_step(BWD, index, slice_len(blk.q, s), slice_len(blk.kv, s),
                                          blk.causal, msgs))
        return steps

    def _dq_messages(self, j: int, t: int, home: Rings) -> list[Message]:
        """What ``_DqHome`` sends at (j, t) (``home``: ``dq_rings``): a hop before the kernel,
        the last two after."""
        n = self.q_bytes(self.local_seqlen, 4 if self.opts.dq_dtype == "fp32" else None)
        msgs = []
        if t > 0:
            assert home.inner is not None
            msgs.append(Message("p2p", home.inner.name, n, home.inner.crosses_nodes))
        elif j > 0:  # awaited at the next boundary, or at the end: a window later
            assert home.outer is not None
            msgs.append(Message("p2p", home.outer.name, n, home.outer.crosses_nodes,
                                overlap_steps=home.window))
        if (j, t) == home.last:
            msgs += [Message("p2p", g.name, n, g.crosses_nodes, overlapped=False,
                             after_compute=True) for g in (home.outer, home.inner) if g]
        return msgs
