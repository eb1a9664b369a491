"""megatron-cp: TransformerEngine's p2p context parallelism (``cp_comm_type="p2p"``), the CP
attention Megatron-LM runs (AttnFuncWithCPAndKVP2P in TE's context_parallel.py).

Reproduced from TE's algorithm, for bshd/sbhd inputs without FP8:
- layout: 2N chunks, rank r holds chunks r and 2N-1-r (get_batch_on_this_cp_rank);
- forward: K and V packed in one buffer, sent to the next rank, received from the previous;
  causal steps are TE's tiles: step 0 "diagonal", a source before r "lower-triangle" (all q
  against the first K/V half), a source after r "upper-triangle" (second q half against all
  K/V); non-causal "all". Every received K/V buffer, per-step output and per-step lse is KEPT
  until the end of the forward (memory grows with N); the lse is folded step by step into the
  final lse (flash_attn_fwd_softmax_lse_correction), and only then is every kept output
  rescaled by exp(lse_step - lse) and summed (flash_attn_fwd_out_correction);
- the forward saves q, out, lse and the LAST received K/V (position r+1's), not its own;
- backward: the ring runs the OTHER way (send to r-1, receive from r+1), starting from that
  saved K/V so a rank's own block comes home last (the diagonal tile). One message per step
  packs K/V with the dK/dV partial sum of the previous step's block, in the ACTIVATION dtype,
  so dK/dV are rounded to it on every hop as in TE; the first step sends K/V only, the last
  dK/dV only. Double buffers of (K/V, dK/dV) as TE's p2p_comm_buffers.
Not reproduced: the THD (packed varlen) format and padding between sequences, attention
bias, FP8, dropout, max-logit, the a2a / all_gather / a2a+p2p comm types (a2a+p2p can run this
function inside its rings via ``cp_lists``), the two-stream overlap of lse correction, the
even/odd send-recv ordering (our comm layer batches every exchange). Local accumulators of out
and dQ are fp32 (cpbench's rule); TE keeps them in the activation dtype.
"""

from __future__ import annotations

import torch

from cpbench.comm import RingComm
from cpbench.strategies import register
from cpbench.strategies.base import BWD, FWD, Message, Step, Strategy, save_for_backward
from cpbench.strategies.layout import ZigzagLayout, slice_len, zigzag_block


def _fwd_src(me: int, step: int, n: int) -> int:
    """Forward: K/V move to the next rank, so at ``step`` rank ``me`` holds me-step's."""
    return (me - step) % n


def _bwd_src(me: int, step: int, n: int) -> int:
    """Backward: starts from the forward's last block (me+1's) and moves to the previous rank,
    so the rank's own block (the diagonal tile) arrives at the last step."""
    return (me + 1 + step) % n


def _rows(x_bhs: torch.Tensor) -> torch.Tensor:
    """(b, h, s) per-query scale → (b, s, h, 1), to multiply a bshd output."""
    return x_bhs.transpose(1, 2).unsqueeze(-1)


class _TEP2PAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, strat: "MegatronCP", q, k, v):
        g = strat.groups["ring"]
        n, me = g.size, g.index
        s = q.shape[1]
        comm = RingComm(g)
        kv_bufs = [torch.stack([k, v])]  # TE keeps every received buffer alive to the end
        blocks, out_steps, lse_steps = [], [], []
        lse = None
        for step in range(n):
            if step + 1 < n:
                kv_bufs.append(comm.send_recv(kv_bufs[step]))
                comm.commit()
            kv = kv_bufs[step]
            blk = zigzag_block(me, _fwd_src(me, step, n), s, strat.attn.causal)
            o, lse_o = strat.kernel_call("forward", q[:, blk.q], kv[0][:, blk.kv],
                                     kv[1][:, blk.kv], causal=blk.causal)
            blocks.append(blk)
            out_steps.append(o)
            lse_steps.append(lse_o)
            # lse correction as the steps come in; outputs wait for the final lse
            if lse is None:  # step 0 is the diagonal (or "all") tile: every query row
                lse = lse_o.float().clone()
            else:
                lse[:, :, blk.q] = torch.logaddexp(lse[:, :, blk.q], lse_o.float())
            if step + 1 < n:
                comm.wait()
        out = torch.zeros_like(q, dtype=torch.float32)
        for blk, o, lse_o in zip(blocks, out_steps, lse_steps):
            out[:, blk.q] += o.float() * _rows(torch.exp(lse_o.float() - lse[:, :, blk.q]))
        out = out.to(q.dtype)
        save_for_backward(ctx, strat, q, kv_bufs[-1], out, lse, lse=lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        strat = ctx.strat
        q, kv, out, lse = ctx.saved_tensors
        g = strat.groups["ring"]
        n, me = g.size, g.index
        s = q.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        # bufs[i][0]: K/V, bufs[i][1]: dK/dV of the block before, both in the activation dtype
        bufs = [kv.new_empty((2, *kv.shape)) for _ in range(2)]
        bufs[0][0].copy_(kv)
        comm = RingComm(g)
        for step in range(n):
            cur, nxt = bufs[step % 2], bufs[(step + 1) % 2]
            if n > 1:
                # first hop: no dK/dV exists yet; last hop: nobody needs the K/V any more
                part = slice(0, 1) if step == 0 else slice(1, 2) if step == n - 1 else slice(0, 2)
                comm.send_recv(cur[part], nxt[part], reverse=True)
                comm.commit()
            blk = zigzag_block(me, _bwd_src(me, step, n), s, strat.attn.causal)
            bq, bk, bv = strat.kernel_call("backward", dout[:, blk.q], q[:, blk.q],
                                           cur[0][0][:, blk.kv], cur[0][1][:, blk.kv],
                                           out[:, blk.q], lse[:, :, blk.q], causal=blk.causal)
            dq[:, blk.q] += bq
            comm.wait()
            # the dK/dV that came in belongs to the block just computed: add ours and it
            # leaves with the next step's message, rounded to the activation dtype
            dkv = nxt[1]
            if step == 0:
                dkv.zero_()
            dkv[0][:, blk.kv] += bk
            dkv[1][:, blk.kv] += bv
        dkv = bufs[n % 2][1]  # own block: every rank's contribution, the diagonal last
        return None, dq.to(q.dtype), dkv[0].clone(), dkv[1].clone()


@register
class MegatronCP(ZigzagLayout, Strategy):
    name = "megatron-cp"
    description = ("TransformerEngine p2p CP (Megatron): zigzag layout, packed K/V ring, kept "
                   "per-step outputs, reverse ring with K/V+dK/dV in the activation dtype")

    def group_lists(self):
        return {"ring": self.cp_lists}

    def attention(self, q, k, v):
        return _TEP2PAttention.apply(self, q, k, v)

    def held_bytes(self) -> int:
        """At the end of the forward: every received K/V buffer and every step's output and
        lse (TE rescales and sums the outputs only once the final lse is known)."""
        g = self.groups["ring"]
        n, me, s = g.size, g.index, self.attn.seqlen // g.size
        rows = [slice_len(zigzag_block(me, _fwd_src(me, step, n), s, self.attn.causal).q, s)
                for step in range(n)]
        return (n - 1) * 2 * self.kv_bytes(s) + sum(self.q_bytes(r) + self.lse_bytes(r)
                                                     for r in rows)

    def schedule(self) -> list[Step]:
        g = self.groups["ring"]
        n, me, s = g.size, g.index, self.attn.seqlen // g.size
        kv = 2 * self.kv_bytes(s)  # K and V; dK/dV travel in the same dtype, same size
        steps = []
        for phase, src_of in ((FWD, _fwd_src), (BWD, _bwd_src)):
            for step in range(n):
                blk = zigzag_block(me, src_of(me, step, n), s, self.attn.causal)
                nbytes = 0
                if phase == FWD and step + 1 < n:
                    nbytes = kv
                elif phase == BWD and n > 1:
                    nbytes = kv if step in (0, n - 1) else 2 * kv
                # every message, the last dK/dV included, is in flight during that step's tile
                msgs = (Message("p2p", "ring", nbytes, g.crosses_nodes),) if nbytes else ()
                steps.append(self.kernel_step(phase, step, slice_len(blk.q, s),
                                              slice_len(blk.kv, s), blk.causal, msgs))
        return steps
