"""ring: contiguous shards, K/V circulate around the ring (the imbalanced baseline).

Rank r holds tokens [r·S/N, (r+1)·S/N). Each of N steps computes the local queries against
the K/V block currently held, merging by LSE, while the next block is already in flight.
Under causal masking a block from a later rank is entirely in the future and is skipped,
so rank N-1 works N times as much as rank 0: the imbalance zigzag fixes.
Backward: K/V travel the same ring again; dK/dV partial sums travel with them (fp32) and
arrive home after N hops; dQ stays local.
"""

from __future__ import annotations

import torch

from cpbench.merge import OutLseAccumulator
from cpbench.comm import RingComm
from cpbench.strategies import register
from cpbench.strategies.base import BWD, FWD, Message, Step, Strategy
from cpbench.strategies.layout import check_divisible, contiguous_index


def _src(rank: int, step: int, n: int) -> int:
    """Ring position whose K/V block a rank holds at ``step`` (blocks move to the next rank)."""
    return (rank - step) % n


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, strat: "Ring", q, k, v):
        g = strat.groups["ring"]
        n, me = g.size, g.index
        b, s, h, d = q.shape
        acc = OutLseAccumulator(b, s, h, d, q.device)
        comm = RingComm(g)
        kv = torch.stack([k, v])  # one buffer so K and V travel as one message
        for step in range(n):
            if step + 1 < n:
                nxt = comm.send_recv(kv)
                comm.commit()
            src = _src(me, step, n)
            if not strat.attn.causal or src <= me:
                out, lse = strat.kernel_call("forward", q, kv[0], kv[1],
                                             causal=strat.attn.causal and src == me)
                acc.update(out, lse)
            if step + 1 < n:
                comm.wait()
                kv = nxt
        out, lse = acc.result(q.dtype)
        ctx.strat = strat
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        strat = ctx.strat
        q, k, v, out, lse = ctx.saved_tensors
        g = strat.groups["ring"]
        n, me = g.size, g.index
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v])
        kv_comm, dkv_comm = RingComm(g, tag=0), RingComm(g, tag=1)
        for step in range(n):
            if step + 1 < n:
                nxt_kv = kv_comm.send_recv(kv)
                kv_comm.commit()
            src = _src(me, step, n)
            # dK/dV partial sums of the block held travel with it, one hop behind (fp32).
            dkv = torch.zeros_like(kv, dtype=torch.float32)
            if not strat.attn.causal or src <= me:
                bq, bk, bv = strat.kernel_call("backward", dout, q, kv[0], kv[1], out, lse,
                                               causal=strat.attn.causal and src == me)
                dq += bq
                dkv[0] += bk
                dkv[1] += bv
            if step > 0:
                dkv_comm.wait()
                dkv += dkv_recv
            dkv_recv = dkv_comm.send_recv(dkv)
            dkv_comm.commit()
            if step + 1 < n:
                kv_comm.wait()
                kv = nxt_kv
        dkv_comm.wait()  # after n hops every block's dK/dV is back on its owner
        return None, dq.to(q.dtype), dkv_recv[0].to(k.dtype), dkv_recv[1].to(v.dtype)


@register
class Ring(Strategy):
    name = "ring"
    description = "contiguous shards, K/V ring; causal skips future blocks (imbalanced baseline)"

    def validate(self) -> None:
        check_divisible(self.attn.seqlen, self.cp_size, f"ring over {self.cp_size} ranks")

    def group_lists(self):
        return {"ring": self.cp_lists}

    def seq_index(self, rank: int) -> torch.Tensor:
        return contiguous_index(self.attn.seqlen, self.cp_size, self.cp_index(rank))

    def attention(self, q, k, v):
        return _RingAttention.apply(self, q, k, v)

    def schedule(self) -> list[Step]:
        g = self.groups["ring"]
        n, me, s = g.size, g.index, self.attn.seqlen // g.size
        causal = self.attn.causal
        kv = 2 * self.kv_bytes(s)
        dkv = 2 * self.kv_bytes(s) * 4 // self.attn.element_size
        steps = []
        for phase, mode in ((FWD, "fwd"), (BWD, "bwd")):
            for step in range(n):
                src = _src(me, step, n)
                busy = not causal or src <= me
                flops = self.block_flops(s, s, causal and src == me, mode) if busy else 0.0
                msgs = []
                if step + 1 < n:
                    msgs.append(Message("p2p", "ring", kv, g.crosses_nodes))
                if phase == BWD:
                    # the last dK/dV hop has nothing left to hide behind
                    msgs.append(Message("p2p", "ring", dkv, g.crosses_nodes,
                                        overlapped=step + 1 < n))
                steps.append(Step(phase, step, flops, tuple(msgs)))
        return steps
