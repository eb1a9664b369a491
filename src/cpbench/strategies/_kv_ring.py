"""The K/V ring pass shared by ``ring`` and ``zigzag`` (ring-flash-attention's algorithm).

The two differ only in their layout and in which part of each received block a rank
computes; they supply that as ``strat.block(me, src, local_len) -> Block | None`` (None:
the whole block is in the future and skipped). Everything else is this one ring:
Forward: K/V circulate, packed in one message; step i+1's transfer is posted before step i
computes (double buffer); results merge by LSE in fp32.
Backward: K/V go round again; each block's dK/dV partial sum follows it one hop behind in
fp32 and is home after N hops; dQ stays local. The dK/dV ring has its own group
("ring_dkv", same members): both rings are in flight at once, and on one communicator NCCL
would serialize them.
"""

from __future__ import annotations

import torch

from cpbench.comm import RingComm
from cpbench.merge import OutLseAccumulator
from cpbench.strategies.base import BWD, FWD, Message, Step, save_for_backward
from cpbench.strategies.layout import slice_len


def kv_ring_lists(cp_lists: list[list[int]]) -> dict[str, list[list[int]]]:
    """The K/V ring and the dK/dV ring: the same members, their own groups."""
    return {"ring": cp_lists, "ring_dkv": cp_lists}


def src_of(me: int, step: int, n: int) -> int:
    """Ring position whose K/V block ``me`` holds at ``step`` (blocks move to the next rank)."""
    return (me - step) % n


class KVRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, strat, q, k, v):
        g = strat.groups["ring"]
        n, me = g.size, g.index
        b, s, h, d = q.shape
        acc = OutLseAccumulator(b, s, h, d, q.device)
        comm = RingComm(g)
        kv = torch.stack([k, v])
        for step in range(n):
            if step + 1 < n:
                nxt = comm.send_recv(kv)
                comm.commit()
            blk = strat.block(me, src_of(me, step, n), s)
            if blk is not None:
                out, lse = strat.kernel_call("forward", q[:, blk.q], kv[0][:, blk.kv],
                                             kv[1][:, blk.kv], causal=blk.causal)
                acc.update(out, lse, blk.q)
            if step + 1 < n:
                comm.wait()
                kv = nxt
        out, lse = acc.result(q.dtype)
        save_for_backward(ctx, strat, q, k, v, out, lse, lse=lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        strat = ctx.strat
        q, k, v, out, lse = ctx.saved_tensors
        g = strat.groups["ring"]
        n, me = g.size, g.index
        s = q.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v])
        kv_comm, dkv_comm = RingComm(g), RingComm(strat.groups["ring_dkv"])
        dkv_recv = None  # the partial sum arriving from the previous rank (from step 1 on)
        for step in range(n):
            if step + 1 < n:
                nxt_kv = kv_comm.send_recv(kv)
                kv_comm.commit()
            blk = strat.block(me, src_of(me, step, n), s)
            dkv = torch.zeros_like(kv, dtype=torch.float32)
            if blk is not None:
                # the kernel needs the final out/lse rows of exactly the queries it sees
                bq, bk, bv = strat.kernel_call(
                    "backward", dout[:, blk.q], q[:, blk.q], kv[0][:, blk.kv], kv[1][:, blk.kv],
                    out[:, blk.q], lse[:, :, blk.q], causal=blk.causal)
                dq[:, blk.q] += bq
                dkv[0][:, blk.kv] = bk.float()
                dkv[1][:, blk.kv] = bv.float()
            if step > 0:
                dkv_comm.wait()
                dkv += dkv_recv
            # a ring of one (e.g. inside USP) already holds its block, and gloo cannot send to self
            dkv_recv = dkv_comm.send_recv(dkv) if n > 1 else dkv
            dkv_comm.commit()
            if step + 1 < n:
                kv_comm.wait()
                kv = nxt_kv
        dkv_comm.wait()  # after n hops every block's dK/dV is back on its owner
        return None, dq.to(q.dtype), dkv_recv[0].to(k.dtype), dkv_recv[1].to(v.dtype)


def kv_ring_schedule(strat) -> list[Step]:
    """Steps of ``KVRingAttention`` for ``strat``'s rank: the block FLOPs and K/V messages."""
    g, g_dkv = strat.groups["ring"], strat.groups["ring_dkv"]
    n, me, s = g.size, g.index, strat.local_seqlen
    kv = 2 * strat.kv_bytes(s)
    dkv = 2 * strat.kv_bytes(s) * 4 // strat.attn.element_size
    steps = []
    for phase in (FWD, BWD):
        for step in range(n):
            blk = strat.block(me, src_of(me, step, n), s)
            msgs = []
            if step + 1 < n:
                msgs.append(Message("p2p", g.name, kv, g.crosses_nodes))
            if phase == BWD and n > 1:
                # the last dK/dV hop has nothing left to hide behind
                msgs.append(Message("p2p", g_dkv.name, dkv, g_dkv.crosses_nodes,
                                    overlapped=step + 1 < n, after_compute=True))
            steps.append(Step(phase, step, 0.0, tuple(msgs)) if blk is None else
                         strat.kernel_step(phase, step, slice_len(blk.q, s),
                                           slice_len(blk.kv, s), blk.causal, msgs))
    return steps
