"""llama3: all-gather K/V across the CP group, then attention of the local queries (the
Llama 3 paper's context parallelism; ring-flash-attn's ``llama3_flash_attn_varlen_func``;
TransformerEngine's ``all_gather`` CP type).

Ring position r holds tokens [r·S/N, (r+1)·S/N). Forward: K and V are gathered from every
rank (two all-gathers), and the local queries attend to every key they see under the mask:
no ring steps, so nothing to balance but the queries themselves, and no step is ever empty.
Backward: K and V are gathered again (not kept: the point of the method is memory), the
local queries' dQ stays here, and the dK/dV of the whole sequence are reduce-scattered back
to their owners (fp32 sums, as the K/V ring sends its dK/dV).
``--heads-k-stride H``: gather (and reduce-scatter) H K/V heads at a time, capping the
gathered buffers at H/kv_heads of the sequence's K/V (ring-flash-attn's ``heads_k_stride``);
0 gathers every head at once.
The gathers are exposed: the local attention needs their result (ring-flash-attn overlaps
the next head chunk's gather with this one's kernel; cpbench's is the plain algorithm).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpbench.comm import all_gather_seq, reduce_scatter_seq
from cpbench.errors import UsageError
from cpbench.strategies import register
from cpbench.strategies.base import BWD, FWD, Message, Step, Strategy, option, \
    save_for_backward
from cpbench.strategies.layout import check_divisible, contiguous_index


class _Llama3Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, strat, q, k, v):
        g, tiles = strat.groups["cp"], strat.gathered_tiles()
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32,
                          device=q.device)
        for qh, kh in strat.head_chunks():
            k_all, v_all = all_gather_seq(k[:, :, kh], g), all_gather_seq(v[:, :, kh], g)
            o, lse[:, qh] = strat.masked_forward(q[:, :, qh], k_all, v_all, tiles)
            out[:, :, qh] = o.to(q.dtype)
        save_for_backward(ctx, strat, q, k, v, out, lse, lse=lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        strat = ctx.strat
        q, k, v, out, lse = ctx.saved_tensors
        g, tiles = strat.groups["cp"], strat.gathered_tiles()
        dout = dout.contiguous()
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        for qh, kh in strat.head_chunks():
            k_all, v_all = all_gather_seq(k[:, :, kh], g), all_gather_seq(v[:, :, kh], g)
            dq_c, dk_all, dv_all = strat.masked_backward(
                dout[:, :, qh], q[:, :, qh], k_all, v_all, out[:, :, qh], lse[:, qh], tiles)
            dq[:, :, qh] = dq_c.to(q.dtype)
            dk[:, :, kh] = reduce_scatter_seq(dk_all, g).to(k.dtype)
            dv[:, :, kh] = reduce_scatter_seq(dv_all, g).to(v.dtype)
        return None, dq, dk, dv


@register
class Llama3(Strategy):
    name = "llama3"
    description = ("all-gather K/V, local queries attend to the whole sequence; dK/dV "
                   "reduce-scattered (Llama 3's CP)")
    masks = frozenset({"documents", "window"})

    @dataclass(frozen=True, kw_only=True)
    class Options:
        heads_k_stride: int = option(0, "K/V heads gathered at a time (0: all at once); "
                                     "fewer caps the gathered buffers")

    def validate(self) -> None:
        check_divisible(self.attn.seqlen, self.cp_size, f"{self.name} over {self.cp_size} "
                        f"ranks")
        stride, hk = self.opts.heads_k_stride, self.attn.num_kv_heads
        if stride < 0 or (stride and hk % stride):
            ok = ", ".join(str(d) for d in range(1, hk + 1) if hk % d == 0)
            raise UsageError(f"--heads-k-stride {stride} must divide the {hk} K/V heads; "
                             f"use 0 (all at once) or one of: {ok}")

    def group_lists(self):
        return {"cp": self.cp_lists}

    def seq_index(self, rank: int) -> torch.Tensor:
        return contiguous_index(self.attn.seqlen, self.cp_size, self.cp_index(rank))

    def resolved_options(self) -> dict:
        return {"heads_k_stride": self.stride}

    @property
    def stride(self) -> int:
        return self.opts.heads_k_stride or self.attn.num_kv_heads

    def head_chunks(self) -> list[tuple[slice, slice]]:
        """(query heads, K/V heads) of each gather."""
        group = self.attn.heads // self.attn.num_kv_heads
        return [(slice(h * group, (h + self.stride) * group), slice(h, h + self.stride))
                for h in range(0, self.attn.num_kv_heads, self.stride)]

    def gathered_tiles(self):
        """The local queries against the gathered sequence (member order: global order)."""
        ranks = next(lst for lst in self.cp_lists if self.rank in lst)
        every = torch.cat([self.seq_index(r) for r in sorted(ranks)])
        return self.tiles("gathered", self.seq_index(self.rank), every)

    def attention(self, q, k, v):
        return _Llama3Attention.apply(self, q, k, v)

    def schedule(self) -> list[Step]:
        g, s = self.groups["cp"], self.local_seqlen
        n, chunks = g.size, len(self.head_chunks())
        kv = self.kv_bytes(s) * self.stride // self.attn.num_kv_heads
        steps: list[Step] = []
        for phase in (FWD, BWD):
            for _ in range(chunks):
                msgs = [Message("ag", g.name, kv * (n - 1), g.crosses_nodes,
                                overlapped=False)] * 2 if n > 1 else []
                if phase == BWD and n > 1:  # fp32 sums of the whole sequence's dK/dV
                    dkv = kv * 4 // self.attn.element_size * (n - 1)
                    msgs += [Message("rs", g.name, dkv, g.crosses_nodes, overlapped=False,
                                     after_compute=True)] * 2
                steps += self._chunk_steps(phase, len(steps), chunks, msgs)
        return steps

    def _chunk_steps(self, phase: str, index: int, chunks: int, msgs) -> list[Step]:
        """One head chunk's kernel work: under a mask, its attended pairs; plain causal,
        the earlier ranks' keys in full and the diagonal block causal (the formula's
        convention, as the rings count it); full, every key."""
        s, me = self.local_seqlen, self.groups["cp"].index
        if not self.mask.plain:
            mine = self.mask.pairs(self.seq_index(self.rank), torch.arange(self.attn.seqlen))
            pairs = mine / chunks
            return [self.pairs_step(phase, index, pairs, (s, self.attn.seqlen), msgs)]
        if not self.attn.causal:
            return [self.kernel_step(phase, index, s, self.attn.seqlen, False, msgs,
                                     head_share=chunks)]
        diagonal = self.kernel_step(phase, index + 1, s, s, True, head_share=chunks)
        if me == 0:
            return [Step(phase, index, 0.0, tuple(msgs)), diagonal]
        return [self.kernel_step(phase, index, s, me * s, False, msgs, head_share=chunks),
                diagonal]
