"""megatron-cp-a2a+p2p: TransformerEngine's hierarchical context parallelism
(``cp_comm_type="a2a+p2p"``; Megatron-LM's ``hierarchical_context_parallel_sizes``), read at
TE v2.18, ``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``
(CP below; transcribed with line numbers in tests/unit/test_parity_te.py).

TE takes the CP group as two levels, ``[cp_group_a2a, cp_group_p2p]`` (CP L1409-1415), and
numbers a rank cp_rank = A·p2p_rank + a2a_rank (L1418-1419): level-1 groups are A consecutive
ranks (meant to be a node, over NVLink), a level-2 ring links the ranks with the same a2a_rank
(across nodes): USP's head-first mesh, with ``megatron-cp`` (AttnFuncWithCPAndKVP2P, the same
function) on the rings. What it sends, all in the activation dtype, none overlapped:
- forward: three all-to-alls, q, k, v in that order (``flash_attn_a2a_communicate``,
  L1486-1510, L421-473), the P2P ring over heads/A, then one of ``out`` (L2032-2049);
- backward: one of ``dout`` (L2407-2421), the reversed ring, then dq, dk, dv in that order
  (L2889-2915). The lse is never sent (cpbench sends it only for ``--check``). ``out`` is not
  re-sent: since v2.15 (commit 8e73f54f) the forward saves the post-all-to-all ``out``; up to
  v2.14.1 the backward all-to-alled ``[out, dout]``.

Layout, as TE: rank cp_rank holds chunks cp_rank and 2N-1-cp_rank of 2N (the dual-chunk zigzag
of the GLOBAL cp rank). After the all-to-all a rank holds its group's A ranks' chunks in member
order, and TE reorders them (``get_seq_chunk_ids_for_reordering_before_attn``, L236-252) so p2p
rank p holds super-chunks p and 2P-1-p of 2P — the zigzag the ring expects; the inverse order
(L254-268) goes back before the ``out`` (and dq, dk, dv) all-to-all.

Not reproduced: TE posts the three all-to-alls asynchronously and reorders each on its
``cp_stream`` while the next travels (L421-452); cpbench's all-to-all is synchronous, so the
same messages run one after another with the reorders between them.

Not TE: with K/V heads not divisible by A, TE cannot run (``x.view(..., A, h // A, ...)``,
L463-468); cpbench then replicates K/V heads as ``usp`` does. The default A divides the K/V
heads, as the ``te-a2a+p2p`` twin's, so by default nothing is replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cpbench.comm import all_to_all
from cpbench.errors import Skipped
from cpbench.strategies import register
from cpbench.strategies.base import option
from cpbench.strategies.layout import check_divisible, zigzag_index
from cpbench.strategies.ulysses import head_sinks, local_attention
from cpbench.strategies.usp import Usp
from cpbench.topology import HEAD_FIRST, Group, node_local_block


def chunks_to_ring(a: int, device=None) -> torch.Tensor:
    """TE's chunk ids before attention (CP L236-252): of the 2A chunks an all-to-all gathers
    (member j's two in turn), the first halves in member order, then the second halves in
    reverse member order, so the ring position's super-chunks come out contiguous."""
    r = torch.arange(a, device=device)
    return torch.cat([2 * r, 2 * a - 2 * r - 1])


def chunks_to_members(a: int, device=None) -> torch.Tensor:
    """TE's chunk ids after attention (CP L254-268): the inverse of ``chunks_to_ring``."""
    r = torch.arange(a, device=device)
    return torch.stack([r, 2 * a - r - 1], 1).flatten()


def reorder(x: torch.Tensor, dim: int, ids: torch.Tensor) -> torch.Tensor:
    """``x``'s sequence ``dim`` cut into len(ids) equal chunks, taken in the order ``ids``."""
    if len(ids) == 2:  # one member: both orders are the identity
        return x
    parts = x.unflatten(dim, (len(ids), -1))
    return parts.index_select(dim, ids).flatten(dim, dim + 1)


class _ToHeads(torch.autograd.Function):
    """q, k, v: one all-to-all each, in that order, then TE's reorder; backward: dq, dk, dv
    reordered back, then one all-to-all each in that order (CP L2889-2915)."""

    @staticmethod
    def forward(ctx, group: Group, order: tuple, q, k, v):
        ctx.group, ctx.order = group, order
        return tuple(reorder(all_to_all(t, group, scatter_dim=2, gather_dim=1), 1, order[0])
                     for t in (q, k, v))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *(all_to_all(reorder(g.contiguous(), 1, ctx.order[1]), ctx.group,
                                         scatter_dim=1, gather_dim=2) for g in grads))


class _ToSequence(torch.autograd.Function):
    """out reordered to member order, then one all-to-all back (CP L2032-2049); backward: the
    dout all-to-all, then TE's reorder (L2407-2421)."""

    @staticmethod
    def forward(ctx, group: Group, order: tuple, out):
        ctx.group, ctx.order = group, order
        return all_to_all(reorder(out, 1, order[1]), group, scatter_dim=1, gather_dim=2)

    @staticmethod
    def backward(ctx, dout):
        full = all_to_all(dout.contiguous(), ctx.group, scatter_dim=2, gather_dim=1)
        return None, None, reorder(full, 1, ctx.order[0])


def a2a_degree_option():
    return option(0, "level-1 (all-to-all) group size; 0: the largest divisor of the heads "
                  "and kv heads whose groups stay in a node")


def default_a2a_degree(strat) -> int:
    """The all-to-all size unless given (here and in te-a2a+p2p): TE does not replicate K/V
    heads, so it divides them too."""
    heads = math.gcd(strat.attn.heads, strat.attn.num_kv_heads)
    return node_local_block(strat.topo, strat.cp_lists, also_divides=heads)


@register
class MegatronCPA2AP2P(Usp):
    name = "megatron-cp-a2a+p2p"
    # a window through its ring (megatron-cp), as usp; documents would need TE's THD chunk order
    # (each document in 2N chunks) carried through the all-to-all, not reproduced: refused
    masks = frozenset({"window"})
    description = ("TE cp_comm_type a2a+p2p: q/k/v all-to-alls inside a node, megatron-cp K/V "
                   "ring across nodes, TE's global zigzag layout")

    @dataclass(frozen=True, kw_only=True)
    class Options:
        a2a_degree: int = a2a_degree_option()

    @classmethod
    def variants(cls, topo):
        return [cls.Options()]

    def _plan(self) -> tuple[int, str, str]:
        return self.opts.a2a_degree or default_a2a_degree(self), HEAD_FIRST, "megatron-cp"

    def validate(self) -> None:
        super().validate()
        n = self.cp_size
        check_divisible(self.attn.seqlen, 2 * n,
                        f"{self.name} over {n} ranks (TE's zigzag: 2 chunks per rank)")
        if self.ring_degree == 1 and not self.mask.plain:
            # the local kernel would read the gathered positions in member order, not TE's
            raise Skipped(f"{self.name} with a2a_degree {n} (no ring) does not take a window "
                          f"here; use a smaller --a2a-degree")

    def resolved_options(self) -> dict:
        return {"a2a_degree": self.ulysses_degree, "p2p_degree": self.ring_degree}

    def seq_index(self, rank: int) -> torch.Tensor:
        """TE's layout: the zigzag of the global cp rank (= A·p2p_rank + a2a_rank)."""
        return zigzag_index(self.attn.seqlen, self.cp_size, self.cp_index(rank))

    def chunk_order(self, a: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(to ring order, to member order) on ``device``, made at the first call and kept,
        as TE keeps them per (cp_size, device) (_seq_chunk_ids_cache_for_reordering_before /
        after_attn, CP L236-268): no host copy in the timed steps (cpbench dryrun found one
        per step here)."""
        cache = self.__dict__.setdefault("_chunk_order", {})
        if device not in cache:
            cache[device] = (chunks_to_ring(a, device), chunks_to_members(a, device))
        return cache[device]

    def attention(self, q, k, v, sinks=None):
        g = self.groups["ulysses"]
        if self.replicas > 1:  # not TE (see the docstring): replicas' gradients summed in fp32
            k, v = (t.float().repeat_interleave(self.replicas, 2).to(t.dtype) for t in (k, v))
        order = self.chunk_order(g.size, q.device)
        q_full, k_full, v_full = _ToHeads.apply(g, order, q, k, v)
        inner = local_attention(self) if self.ring is None else self.ring.attention
        out_full, lse_full = inner(q_full, k_full, v_full, head_sinks(sinks, g))
        out = _ToSequence.apply(g, order, out_full)
        if not self.need_lse:
            return out, None
        # for a check only, never on the timed path: (b, h/A, S') → (b, h, S'/A)
        lse = reorder(lse_full, 2, order[1])
        return out, all_to_all(lse.contiguous(), g, scatter_dim=2, gather_dim=1)
