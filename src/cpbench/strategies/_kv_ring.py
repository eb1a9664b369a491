"""The K/V ring pass shared by ``ring`` and ``zigzag`` (ring-flash-attention's algorithm and
schedule: ring-flash-attn 0.1.8 ``zigzag_ring_flash_attn.py`` / ``ring_flash_attn.py``).

The two differ only in their layout and in which part of each received block a rank
computes; they supply that as ``strat.block(me, src, local_len) -> Block | None`` (None:
the whole block is in the future and skipped). Everything else is this one ring:
Forward: K and V circulate as two messages of one batch (``send_recv_kv``); step i+1's
transfer is posted before step i computes; results merge by LSE in fp32.
Backward: K and V go round again; each block's dK/dV partial sums (fp32) follow one hop
behind, posted after the step's kernel, and are home after N hops; a rank adds its block
gradients into the partial sums it received, in place (upstream: ``dk += dk_buffer``, half
the block on the lower tiles); dQ stays local, accumulated in fp32.
Groups: as upstream, the dK/dV ring shares the K/V ring's process group (ring-flash-attn
builds both ``RingComm``\\ s on one group), so on NCCL the two rings queue behind each other;
``--dkv-group separate`` gives the dK/dV ring its own group (a cpbench variant: both in
flight at once).
Under documents or a window (``cpbench.mask``) the block rule gives way to the mask itself:
each step's block is what the local queries see of the held K/V by their global positions,
computed exactly (``kernels.masked``); a step whose block sees nothing computes nothing, and
its K/V still travel (the ring's schedule does not change with the mask).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch

from cpbench.comm import RingComm
from cpbench.merge import OutLseAccumulator, add_sink, sink_grad
from cpbench.strategies.base import BWD, FWD, Message, Step, Strategy, option, save_for_backward
from cpbench.strategies.layout import Block, slice_len

DKV_GROUPS = ("shared", "separate")


def dkv_group_option():
    return option("shared", "the dK/dV ring's process group: shared with the K/V ring, as "
                  "ring-flash-attn (the rings queue on one communicator), or separate (a "
                  "cpbench variant: both in flight at once)", DKV_GROUPS)


def kv_ring_lists(cp_lists: list[list[int]], dkv_group: str = "shared"
                  ) -> dict[str, list[list[int]]]:
    """The K/V ring, and the dK/dV ring's own group when it is separate."""
    return {"ring": cp_lists, **({"ring_dkv": cp_lists} if dkv_group == "separate" else {})}


def _dkv_group(strat):
    return strat.groups.get("ring_dkv", strat.groups["ring"])


def src_of(me: int, step: int, n: int) -> int:
    """Ring position whose K/V block ``me`` holds at ``step`` (blocks move to the next rank)."""
    return (me - step) % n


def kv_ring_areas(strat, ranks=None) -> list[list[int]]:
    """Per rank (of ``ranks``, default all), the attended pairs of each ring step (the
    layout and the mask)."""
    out = []
    for r in range(strat.world_size) if ranks is None else ranks:
        ring = next(lst for lst in strat.cp_lists if r in lst)
        me, n = ring.index(r), len(ring)
        if r == strat.rank:  # the blocks its own steps plan (cached)
            out.append([strat.ring_tiles(src_of(me, i, n)).pairs for i in range(n)])
            continue
        mine = strat.seq_index(r)
        out.append([strat.mask.pairs(mine, strat.seq_index(ring[src_of(me, i, n)]))
                    for i in range(n)])
    return out


def _send_kv(comm: RingComm, k, v, into=(None, None)):
    """K and V (or dK and dV) to the next rank as two messages of one batch; receive into
    ``into`` where given (buffers free again), else fresh ones."""
    nk, nv = comm.send_recv(k, into[0]), comm.send_recv(v, into[1])
    comm.commit()
    return nk, nv


class KVRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, strat, q, k, v, sinks):
        g = strat.groups["ring"]
        n, me = g.size, g.index
        b, s, h, _ = q.shape
        acc = OutLseAccumulator(b, s, h, v.shape[-1], q.device)  # out: V's width
        comm = RingComm(g, queue_behind=True)
        k_home, v_home = k, v
        for step in range(n):
            if step + 1 < n:
                next_k, next_v = _send_kv(comm, k, v)
            if not strat.mask.plain:
                tiles = strat.ring_tiles(src_of(me, step, n))
                if tiles:  # an empty block is skipped, not computed as masked zeros
                    acc.update(*strat.masked_forward(q, k, v, tiles))
            elif (blk := strat.block(me, src_of(me, step, n), s)) is not None:
                out, lse = strat.kernel_call("forward", q[:, blk.q], k[:, blk.kv], v[:, blk.kv],
                                             causal=blk.causal)
                acc.update(out, lse, blk.q)
            if step + 1 < n:
                comm.wait()
                k, v = next_k, next_v
        out, lse = add_sink(*acc.result(torch.float32), sinks)  # once, after every step
        out = out.to(q.dtype)
        save_for_backward(ctx, strat, q, k_home, v_home, out, lse, sinks, lse=lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        strat = ctx.strat
        q, k, v, out, lse, sinks = ctx.saved_tensors
        g = strat.groups["ring"]
        n, me, s = g.size, g.index, q.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk = dv = next_dk = next_dv = None  # partial sums (fp32): the held block's, arriving
        spare = (None, None)  # the sums sent last step: free once it arrived, reused to receive
        kv_comm = RingComm(g, queue_behind=True)
        dkv_comm = RingComm(_dkv_group(strat), queue_behind=True)
        for step in range(n):
            if step + 1 < n:
                next_k, next_v = _send_kv(kv_comm, k, v)
            grads = _block_grads(strat, me, step, n, s, dout, q, k, v, out, lse)
            if step > 0:
                dkv_comm.wait()
                spare, (dk, dv) = (dk, dv), (next_dk, next_dv)
            dk, dv = _add_block(grads, dq, dk, dv, k, v)
            if step + 1 < n:
                kv_comm.wait()
                k, v = next_k, next_v
            if n > 1:  # a ring of one (inside USP) already holds its block's sums
                next_dk, next_dv = _send_kv(dkv_comm, dk, dv, spare)
        if n > 1:
            dkv_comm.wait()  # after n hops every block's dK/dV is back on its owner
            dk, dv = next_dk, next_dv
        return (None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                sink_grad(out, dout, lse, sinks))


def _block_grads(strat, me, step, n, s, dout, q, k, v, out, lse):
    """(block, dq, dk, dv) of this step's block, or None when it is skipped."""
    if not strat.mask.plain:
        tiles = strat.ring_tiles(src_of(me, step, n))
        if not tiles:
            return None
        every = slice(None)
        return (Block(every, every, False),
                *strat.masked_backward(dout, q, k, v, out, lse, tiles))
    blk = strat.block(me, src_of(me, step, n), s)
    if blk is None:
        return None
    # the kernel needs the final out/lse rows of exactly the queries it sees
    bq, bk, bv = strat.kernel_call("backward", dout[:, blk.q], q[:, blk.q], k[:, blk.kv],
                                   v[:, blk.kv], out[:, blk.q], lse[:, :, blk.q],
                                   causal=blk.causal)
    return blk, bq, bk, bv


def _add_block(grads, dq, dk, dv, k, v):
    """Add a block's gradients: dQ locally, dK/dV into the partial sums received (in place;
    the first step starts them)."""
    if dk is None:  # step 0: the partial sums start here, at the sizes of K and V
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
    if grads is not None:
        blk, bq, bk, bv = grads
        dq[:, blk.q] += bq
        dk[:, blk.kv] += bk
        dv[:, blk.kv] += bv
    return dk, dv


def kv_ring_schedule(strat) -> list[Step]:
    """Steps of ``KVRingAttention`` for ``strat``'s rank: the block FLOPs and messages (K and
    V separately; dK and dV in fp32, separately, posted after the step's kernel)."""
    g, g_dkv = strat.groups["ring"], _dkv_group(strat)
    n, me, s = g.size, g.index, strat.local_seqlen
    kv = strat.k_bytes(s), strat.v_bytes(s)
    dkv = strat.k_bytes(s, element_size=4), strat.v_bytes(s, element_size=4)
    steps = []
    areas = kv_ring_areas(strat, [strat.rank])[0] if not strat.mask.plain else None
    hop = tuple(Message("p2p", g.name, nbytes, g.crosses_nodes) for nbytes in kv)
    # the last dK/dV hop has nothing left to hide behind
    dkv_hop = {last: tuple(Message("p2p", g_dkv.name, nbytes, g_dkv.crosses_nodes,
                                   overlapped=not last, after_compute=True) for nbytes in dkv)
               for last in (False, True)}
    for phase in (FWD, BWD):
        for step in range(n):
            blk = strat.block(me, src_of(me, step, n), s) if areas is None else None
            msgs = hop if step + 1 < n else ()
            if phase == BWD and n > 1:
                msgs = msgs + dkv_hop[step + 1 == n]
            if areas is not None:
                steps.append(strat.pairs_step(phase, step, areas[step], (s, s), msgs,
                                              strat.ring_tiles(src_of(me, step, n))))
                continue
            steps.append(Step(phase, step, 0.0, tuple(msgs)) if blk is None else
                         strat.kernel_step(phase, step, slice_len(blk.q, s),
                                           slice_len(blk.kv, s), blk.causal, msgs))
    return steps


class KVRing(Strategy):
    """A strategy on this ring (``ring``, ``zigzag``): its options, groups, pass, schedule and
    per-step areas. A subclass gives its layout (``seq_index``) and ``block``."""

    masks = frozenset({"documents", "window"})
    takes_sinks = True

    @dataclass(frozen=True, kw_only=True)
    class Options:
        dkv_group: str = dkv_group_option()

    def group_lists(self):
        return kv_ring_lists(self.cp_lists, self.opts.dkv_group)

    @abstractmethod
    def block(self, me: int, src: int, local_len: int) -> Block | None:
        """What ``me``'s queries compute of ring position ``src``'s K/V (None: nothing)."""

    def attention(self, q, k, v, sinks=None):
        return KVRingAttention.apply(self, q, k, v, sinks)

    def schedule(self) -> list[Step]:
        return kv_ring_schedule(self)

    def area_per_step(self) -> list[list[int]]:
        return kv_ring_areas(self)
