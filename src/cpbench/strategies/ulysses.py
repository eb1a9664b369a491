"""ulysses: DeepSpeed-Ulysses, all-to-all from sequence shards to head shards and back.

Rank r of N holds tokens [r·S/N, (r+1)·S/N) of every head. One all-to-all per tensor (q, k
and v separately, as DeepSpeed, yunchang and TransformerEngine send them) scatters heads and
gathers the sequence, so each rank then holds the whole sequence of heads/N heads and runs
plain (unsplit) attention on it; a fourth all-to-all returns the output to the sequence
layout. Backward is the same in reverse: dO goes to head shards, the kernel's dQ, dK, dV come
back, one all-to-all each. Communication per rank is O(S/N) whatever N is, but N can never
exceed the number of heads (heads % N == 0).

The log-sum-exp is sent back too only when the caller asks for it (``Strategy.need_lse``:
``--check`` does): the systems this is named after send ``out`` alone, so the timed path
does.

GQA: with kv_heads % N == 0 the K/V heads split like the query heads. With fewer K/V heads
than ranks each K/V head is replicated, as LoongTrain does, until there are lcm(kv_heads, N)
of them: every rank then receives exactly the K/V head its query heads read. The replicas'
gradients are summed (fp32) back onto the K/V head they copy.

The all-to-all and replication pieces below are shared with ``usp``, which runs a ring
strategy where this one runs the kernel.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from cpbench.comm import a2a_copied_bytes, all_to_all
from cpbench.errors import UsageError
from cpbench.merge import add_sink, sink_grad
from cpbench.strategies import register
from cpbench.strategies.base import BWD, FWD, Message, Step, Strategy, save_for_backward
from cpbench.strategies.layout import check_divisible, contiguous_index
from cpbench.topology import Group, divisors

# q, k, v and their heads' sinks (or None) → out, lse
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"],
                     tuple[torch.Tensor, torch.Tensor]]


def kv_replicas(kv_heads: int, n: int) -> int:
    """How many copies of each K/V head make the K/V head count divisible by ``n``."""
    return math.lcm(kv_heads, n) // kv_heads


class _AllToAll(torch.autograd.Function):
    """comm.all_to_all with its transpose (the same exchange, dims swapped) as backward."""

    @staticmethod
    def forward(ctx, x, group: Group, scatter_dim: int, gather_dim: int):
        ctx.args = group, scatter_dim, gather_dim
        return all_to_all(x, group, scatter_dim=scatter_dim, gather_dim=gather_dim)

    @staticmethod
    def backward(ctx, grad):
        group, scatter_dim, gather_dim = ctx.args
        grad_in = all_to_all(grad, group, scatter_dim=gather_dim, gather_dim=scatter_dim)
        return grad_in, None, None, None


class _RepeatKV(torch.autograd.Function):
    """Each K/V head repeated ``r`` times in place (head j -> heads j·r .. j·r+r-1)."""

    @staticmethod
    def forward(ctx, kv_bshd, r: int):
        ctx.r = r
        return kv_bshd.repeat_interleave(r, dim=2)

    @staticmethod
    def backward(ctx, grad_bshd):
        # every replica contributed to the loss: the owner's gradient is their sum, in fp32
        summed = grad_bshd.unflatten(2, (-1, ctx.r)).float().sum(3)
        return summed.to(grad_bshd.dtype), None


class _LocalAttention(torch.autograd.Function):
    """The kernel on the whole sequence of the local heads (no split left to merge)."""

    @staticmethod
    def forward(ctx, strat: Strategy, q, k, v, sinks):
        if strat.mask.plain:
            out, lse = strat.kernel_call("forward", q, k, v, causal=strat.attn.causal)
        else:
            out, lse = strat.masked_forward(q, k, v, ulysses_tiles(strat))
        # every key of these heads was in the one call: their sinks join once, here
        out, lse = add_sink(out, lse, sinks)
        out = out.to(q.dtype)
        save_for_backward(ctx, strat, q, k, v, out, lse, sinks, lse=lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        strat = ctx.strat
        if strat.mask.plain:
            dq, dk, dv = strat.kernel_call("backward", dout.contiguous(), q, k, v, out, lse,
                                           causal=strat.attn.causal)
        else:
            dq, dk, dv = strat.masked_backward(dout.contiguous(), q, k, v, out, lse,
                                               ulysses_tiles(strat))
        return (None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                sink_grad(out, dout, lse, sinks))


def ulysses_tiles(strat: Strategy):
    """Under a mask: the whole gathered sequence (the group's shards in member order)
    against itself, by global positions."""
    ranks = strat.groups["ulysses"].ranks  # the all-to-all gathers in member order
    pos = strat.positions(ranks)
    return strat.tiles("local", pos, pos)


def head_layout_bytes(strat: Strategy, phase: str, replicas: int) -> int:
    """What a Ulysses rank keeps from its forward for the backward: q, k, v and out in the
    head layout (as many bytes as the shards; K/V with their ``replicas``: those made for its
    Ulysses group, whose size is the CP size in ulysses, the Ulysses degree in usp)."""
    if phase == FWD:
        return 0
    s = strat.local_seqlen
    return strat.q_bytes(s) + strat.out_bytes(s) + replicas * strat.kv_bytes(s)


def local_attention(strat: Strategy) -> Attention:
    def attend(q, k, v, sinks=None):
        return _LocalAttention.apply(strat, q, k, v, sinks)

    return attend


def head_sinks(sinks: torch.Tensor | None, group: Group) -> torch.Tensor | None:
    """The sinks of the heads an all-to-all to head shards leaves this member (its chunk
    of the heads, in member order): its inner attention adds those."""
    return None if sinks is None else sinks.chunk(group.size)[group.index]


def ulysses_attention(q_bshd, k_bshd, v_bshd, group: Group, inner: Attention, replicas: int,
                      need_lse: bool = False, sinks: torch.Tensor | None = None):
    """Sequence shards → head shards, ``inner`` on them (with these heads' ``sinks``), and
    back: out, and lse when ``need_lse`` (else None)."""
    if replicas > 1:
        k_bshd, v_bshd = _RepeatKV.apply(k_bshd, replicas), _RepeatKV.apply(v_bshd, replicas)
    # scatter heads (dim 2), gather sequence (dim 1): q, k, v one all-to-all each
    q_full, k_full, v_full = (_AllToAll.apply(t, group, 2, 1) for t in (q_bshd, k_bshd, v_bshd))
    out_full, lse_full_bhs = inner(q_full, k_full, v_full, head_sinks(sinks, group))
    out = _AllToAll.apply(out_full, group, 1, 2)
    if not need_lse:
        return out, None
    return out, _AllToAll.apply(lse_full_bhs, group, 2, 1)  # (b, h/N, S') → (b, h, S'/N)


def ulysses_messages(strat: Strategy, group: Group, seqlen_local: int, kv_heads: int
                     ) -> dict[str, tuple[Message, ...]]:
    """The all-to-alls of ``ulysses_attention`` for a rank holding ``seqlen_local`` tokens
    (all heads; ``kv_heads`` after replication): before/after the inner attention, per phase.
    Nothing overlaps them: the inner attention needs their result."""
    n = group.size
    if n == 1:
        return {"fwd_in": (), "fwd_out": (), "bwd_in": (), "bwd_out": ()}
    a = strat.attn
    b, full, es = a.batch, seqlen_local * n, a.element_size

    def a2a(heads: int, width: int, to_heads: bool) -> Message:
        """Sequence shards to head shards (scatter heads: dim 2) or back (scatter the
        sequence: dim 1), of a (b, s, heads, width) tensor as ``all_to_all`` lays it."""
        shape = (b, seqlen_local, heads, width) if to_heads else (b, full, heads // n, width)
        nbytes = math.prod(shape) * es
        return Message("a2a", group.name, nbytes * (n - 1) // n, group.crosses_nodes,
                       overlapped=False,
                       copied=a2a_copied_bytes(shape, es, n, 2 if to_heads else 1))

    h, d, dv = a.heads, a.head_dim, a.dv  # V's own head dim
    return {"fwd_in": (a2a(h, d, True), a2a(kv_heads, d, True),  # q, k, v
                       a2a(kv_heads, dv, True)),
            "fwd_out": (a2a(h, dv, False),),  # out (the lse only for --check: not timed)
            "bwd_in": (a2a(h, dv, True),),  # dout
            "bwd_out": (a2a(h, d, False), a2a(kv_heads, d, False),  # dq, dk, dv
                        a2a(kv_heads, dv, False))}


@register
class Ulysses(Strategy):
    name = "ulysses"
    masks = frozenset({"documents", "window"})  # heads split: the mask never is
    takes_sinks = True
    description = ("DeepSpeed-Ulysses: all-to-all to head shards, full-sequence attention, "
                   "all-to-all back; K/V heads replicated when fewer than ranks (LoongTrain)")

    def validate(self) -> None:
        n, h = self.cp_size, self.attn.heads
        if h % n:
            # usp splits the same ranks into Ulysses groups of d (d | heads) × a ring
            degrees = [d for d in divisors(n) if h % d == 0]
            raise UsageError(f"ulysses over {n} ranks needs heads ({h}) divisible by {n}, or "
                             f"--strategy usp --ulysses-degree {max(degrees)}")
        check_divisible(self.attn.seqlen, n, f"ulysses over {n} ranks")

    def group_lists(self):
        return {"ulysses": self.cp_lists}

    def seq_index(self, rank: int) -> torch.Tensor:
        return contiguous_index(self.attn.seqlen, self.cp_size, self.cp_index(rank))

    @property
    def replicas(self) -> int:
        return kv_replicas(self.attn.num_kv_heads, self.cp_size)

    def area_per_rank(self) -> list[int]:
        # every rank computes the whole sequence's mask for 1/N of the heads
        every = torch.arange(self.attn.seqlen)
        return [self.mask.pairs(every, every) // self.cp_size] * self.world_size

    def accumulator_bytes(self, phase: str) -> int:
        return head_layout_bytes(self, phase, self.replicas)

    def late_accumulator_bytes(self, phase: str) -> int:
        return 0

    def finish_bytes(self, phase: str) -> int:
        return 0  # one kernel call; its results go back as they are

    def merges(self) -> bool:
        return False  # one kernel call, nothing to merge or sum

    def kernel_head_share(self) -> float:
        return 1 / self.cp_size

    def kernel_gqa(self) -> int:
        # K/V heads replicated when fewer than ranks: fewer query heads share each
        return max(1, self.attn.heads // (self.attn.num_kv_heads * self.replicas))

    def attention(self, q, k, v, sinks=None):
        return ulysses_attention(q, k, v, self.groups["ulysses"], local_attention(self),
                                 self.replicas, self.need_lse, sinks)

    def schedule(self) -> list[Step]:
        g = self.groups["ulysses"]
        n, s_full = g.size, self.attn.seqlen
        msgs = ulysses_messages(self, g, s_full // n, self.attn.num_kv_heads * self.replicas)
        steps = []
        area = None if self.mask.plain else self.area_per_rank()[0]
        for phase in (FWD, BWD):
            # each rank computes the whole sequence for 1/N of the heads
            kernel = self.kernel_step(phase, 1, s_full, s_full, self.attn.causal,
                                      head_share=n) if area is None else \
                self.pairs_step(phase, 1, area, (s_full, s_full), (), ulysses_tiles(self))
            steps += [Step(phase, 0, 0.0, msgs[f"{phase}_in"]), kernel,
                      Step(phase, 2, 0.0, msgs[f"{phase}_out"])]
        return steps
