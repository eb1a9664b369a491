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

import dataclasses
from dataclasses import dataclass

import torch

from cpbench.comm import all_gather_seq, reduce_scatter_seq
from cpbench.errors import UsageError
from cpbench.merge import OutLseAccumulator
from cpbench.strategies import register
from cpbench.strategies.base import BWD, FWD, Message, Step, Strategy, option, save_for_backward
from cpbench.strategies.layout import check_divisible, contiguous_index, slice_len


class _Llama3Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, strat, q, k, v):
        g = strat.groups["cp"]
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32,
                          device=q.device)
        for qh, kh in strat.head_chunks():
            k_all, v_all = all_gather_seq(k[:, :, kh], g), all_gather_seq(v[:, :, kh], g)
            o, lse[:, qh] = _attend(strat, q[:, :, qh], k_all, v_all)
            out[:, :, qh] = o.to(q.dtype)
        save_for_backward(ctx, strat, q, k, v, out, lse, lse=lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        strat = ctx.strat
        q, k, v, out, lse = ctx.saved_tensors
        g = strat.groups["cp"]
        dout = dout.contiguous()
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        for qh, kh in strat.head_chunks():
            k_all, v_all = all_gather_seq(k[:, :, kh], g), all_gather_seq(v[:, :, kh], g)
            dq_c, dk_all, dv_all = _attend_grads(strat, dout[:, :, qh], q[:, :, qh], k_all,
                                                 v_all, out[:, :, qh], lse[:, qh])
            dq[:, :, qh] = dq_c.to(q.dtype)
            dk[:, :, kh] = reduce_scatter_seq(dk_all, g).to(k.dtype)
            dv[:, :, kh] = reduce_scatter_seq(dv_all, g).to(v.dtype)
        return None, dq, dk, dv


def _attend(strat, q, k_all, v_all):
    """The local queries against the gathered keys: (out fp32, lse)."""
    if not strat.mask.plain:
        return strat.masked_forward(q, k_all, v_all, strat.gathered_tiles())
    acc = OutLseAccumulator(*q.shape, q.device)
    for keys, causal in strat.plain_parts():
        acc.update(*strat.kernel_call("forward", q, k_all[:, keys], v_all[:, keys],
                                      causal=causal))
    return acc.out, acc.lse


def _attend_grads(strat, dout, q, k_all, v_all, out, lse):
    """(dq, dk, dv of the whole gathered sequence), fp32, against the final out / lse."""
    if not strat.mask.plain:
        return strat.masked_backward(dout, q, k_all, v_all, out, lse, strat.gathered_tiles())
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k_all.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for keys, causal in strat.plain_parts():
        bq, bk, bv = strat.kernel_call("backward", dout, q, k_all[:, keys], v_all[:, keys],
                                       out, lse, causal=causal)
        dq += bq
        dk[:, keys] += bk
        dv[:, keys] += bv
    return dq, dk, dv


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

    def late_accumulator_bytes(self, phase: str) -> int:
        return 0  # its sums exist before the first call

    def accumulator_bytes(self, phase: str) -> int:
        """out / dq, dk, dv filled chunk by chunk, and one chunk's fp32 sums: out in the
        forward; dq and the gathered sequence's dK, dV in the backward."""
        s, share = self.local_seqlen, self.stride / self.attn.num_kv_heads
        q32, kv32 = self.q_bytes(s, element_size=4), 4 * self.kv_bytes(s) // self.attn.element_size
        # under a mask the masked kernels return the fp32 sums (their results)
        plain = self.mask.plain
        if phase == FWD:
            return self.q_bytes(s) + self.lse_bytes(s) + int(plain * share * q32)
        gathered = 2 * self.cp_size * kv32
        return self.q_bytes(s) + 2 * self.kv_bytes(s) + int(plain * share * (q32 + gathered))

    def head_chunks(self) -> list[tuple[slice, slice]]:
        """(query heads, K/V heads) of each gather."""
        group = self.attn.heads // self.attn.num_kv_heads
        return [(slice(h * group, (h + self.stride) * group), slice(h, h + self.stride))
                for h in range(0, self.attn.num_kv_heads, self.stride)]

    def plain_parts(self) -> list[tuple[slice, bool]]:
        """Without documents or a window: the earlier ranks' keys in full, then the diagonal
        block causal (the kernels' fast paths); full attention: every key."""
        s, me = self.local_seqlen, self.groups["cp"].index
        if not self.attn.causal:
            return [(slice(0, self.attn.seqlen), False)]
        return ([(slice(0, me * s), False)] if me else []) + [(slice(me * s, (me + 1) * s),
                                                               True)]

    def gathered_tiles(self):
        """The local queries against the gathered sequence (member order: global order)."""
        ranks = next(lst for lst in self.cp_lists if self.rank in lst)
        return self.tiles("gathered", self.seq_index(self.rank), self.positions(sorted(ranks)))

    def attention(self, q, k, v):
        return _Llama3Attention.apply(self, q, k, v)

    def schedule(self) -> list[Step]:
        g, s = self.groups["cp"], self.local_seqlen
        n, chunks = g.size, len(self.head_chunks())
        kv = self.kv_bytes(s) * self.stride // self.attn.num_kv_heads
        steps: list[Step] = []
        for phase in (FWD, BWD):
            for _ in range(chunks):
                gather = [Message("ag", g.name, kv * (n - 1), g.crosses_nodes,
                                  overlapped=False)] * 2 if n > 1 else []
                scatter = []
                if phase == BWD and n > 1:  # fp32 sums of the whole sequence's dK/dV
                    dkv = kv * 4 // self.attn.element_size * (n - 1)
                    scatter = [Message("rs", g.name, dkv, g.crosses_nodes, overlapped=False,
                                       after_compute=True)] * 2
                steps += self._chunk_steps(phase, len(steps), chunks, gather, scatter)
        return steps

    def _chunk_steps(self, phase: str, index: int, chunks: int, gather, scatter
                     ) -> list[Step]:
        """One head chunk: the gathers before its first kernel, the reduce-scatters after
        its last; under a mask one kernel of its attended pairs, else ``plain_parts``."""
        s = self.local_seqlen
        if not self.mask.plain:
            mine = self.mask.pairs(self.seq_index(self.rank), torch.arange(self.attn.seqlen))
            return [self.pairs_step(phase, index, mine / chunks, (s, self.attn.seqlen),
                                    gather + scatter)]
        parts = self.plain_parts()
        steps = [self.kernel_step(phase, index + i, s, slice_len(keys, self.attn.seqlen),
                                  causal, head_share=chunks)
                 for i, (keys, causal) in enumerate(parts)]
        if self.attn.causal and len(parts) == 1:  # rank 0 has no earlier keys: an empty
            # step in their place, so every rank has as many steps (the simulator's rule)
            steps = [Step(phase, index, 0.0), dataclasses.replace(steps[0], index=index + 1)]
        steps[0] = dataclasses.replace(steps[0], messages=tuple(gather))
        steps[-1] = dataclasses.replace(steps[-1], messages=steps[-1].messages + tuple(scatter))
        return steps
