"""megatron-cp: TransformerEngine's p2p context parallelism (``cp_comm_type="p2p"``), the CP
attention Megatron-LM runs: AttnFuncWithCPAndKVP2P in TE v2.18's
``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py`` (CP below;
the schedule is transcribed with line numbers in tests/unit/test_parity_te.py).

Reproduced for bshd without FP8 — what is sent, its dtype, when it is posted and awaited:
- layout: 2N chunks, rank r holds chunks r and 2N-1-r;
- forward (CP L1686-1970): K and V packed in ONE buffer in the activation dtype (L1690; each
  flattened and concatenated, as TE does for MLA's unequal head dims: ``KVPack``), sent to
  the next rank, received from the previous. Step i first waits for the K/V posted at step i-1
  (L1701-1703), then posts the forward of what it holds (L1705-1715), then runs its tile, so
  each transfer hides behind one tile. Causal tiles: step 0 "diagonal", a source before r
  "lower-triangle" (all q against the first K/V half), a source after r "upper-triangle"
  (second q half against all K/V); non-causal "all" (L1781-1905). Every received K/V buffer,
  per-step output and per-step lse is KEPT to the end of the forward; the lse of step i-1 is
  folded into the final lse during step i (L1913-1968), and only then is every kept output
  rescaled by exp(lse_step - lse) and summed in step order IN THE ACTIVATION DTYPE (L1980-2030:
  ``flash_attn_fwd_out_correction_init`` returns ``.to(out dtype)``, later steps ``out.add_``);
- streams, CUDA only (L1677-1678, L1700, L1913-1970): step i runs on stream i % 2, the current
  stream or a second one (TE's ``cp_stream``), so tile i+1 can start while tile i finishes;
  ``TileStreams`` below. Nothing of it exists on CPU;
- the forward saves q, out, lse and the LAST received K/V (position r+1's), not its own (L2087);
- backward (CP L2203-2973), one stream: the ring runs the OTHER way (L2229-2230), starting from
  that saved K/V so a rank's own block comes home last (the diagonal tile). Each step posts one
  message BEFORE its tile and awaits it AFTER (L2458-2493, L2717-2719): K/V packed with the
  dK/dV partial sum of the previous step's block, in the activation dtype (L2397-2400), so
  dK/dV are rounded to it on every hop; step 0 sends K/V only, the last step dK/dV only. dQ
  accumulates in the activation dtype too (``dq_buffer = torch.empty_like(q)``, L2396).
Not reproduced: THD and padding between sequences, attention bias, FP8, dropout, max-logit;
TE's unbatched even/odd isend/irecv order (L96-136; TE batches only for NVTE_BATCH_MHA_P2P_COMM=1
or cp_size 2 below sm100): cpbench's comm layer batches every exchange (same messages, bytes and
wait points). The a2a+p2p type runs this inside its rings (``megatron-cp-a2a+p2p``).
Documents and windows (``cpbench.mask``; TE's THD path cuts each document into 2N chunks, the
zigzag layout does that for the whole packed sequence): each step computes exactly what the
local queries see of the held K/V by their global positions (``kernels.masked``) instead of
the causal tile rule; a step that sees nothing computes nothing and keeps no output, and its
K/V (and dK/dV) still travel: the ring's schedule does not change with the mask.
"""

from __future__ import annotations

import contextlib

import torch

from cpbench.comm import RingComm
from cpbench.merge import sink_grad, sink_lse
from cpbench.strategies import register
from cpbench.strategies._kv_ring import kv_ring_areas
from cpbench.strategies.base import BWD, FWD, Message, Step, Strategy, save_for_backward
from cpbench.strategies.layout import Block, ZigzagLayout, slice_len, zigzag_block

_EVERY = Block(slice(None), slice(None), False)  # a masked step: all local rows and keys


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


class TileStreams:
    """TE's two forward streams (CP L1677-1678): step i's tile runs on ``streams[i % 2]``, the
    current stream and TE's ``cp_stream``, so neighbouring tiles overlap (against wave
    quantization, L1677). The lse corrections all update one lse from alternating streams:
    one event chains them (L1913-1916, L1967-1968), and the current stream waits for the
    second before the outputs are summed (L1970). With no streams (CPU) nothing happens.

    Written from TE's code and NEVER RUN ON A GPU HERE (no GPU in this project's checks):
    its order is tested with stand-in streams (tests/unit/test_schedule_megatron_cp.py)."""

    def __init__(self, streams=(), event=None, use=None):
        self.streams, self.event = list(streams), event
        self._use = use or torch.cuda.stream  # the context making a stream current

    @classmethod
    def for_tensor(cls, x: torch.Tensor, owner) -> TileStreams:
        """CUDA: the current stream and ``owner``'s second stream (made once, as Megatron
        makes one ``cp_stream`` for all layers); elsewhere none."""
        if x.device.type != "cuda":
            return cls()
        if owner.cp_stream is None:
            owner.cp_stream = torch.cuda.Stream(x.device)
        return cls([torch.cuda.current_stream(x.device), owner.cp_stream], torch.cuda.Event())

    def on(self, step: int):
        """Make step ``step``'s stream current (its tile, or its lse correction)."""
        return self._use(self.streams[step % 2]) if self.streams else contextlib.nullcontext()

    def before_correction(self, step: int) -> None:
        if self.streams and step > 0:  # the previous correction ran on the other stream
            self.streams[step % 2].wait_event(self.event)

    def after_correction(self, step: int, n: int) -> None:
        if self.streams and step < n - 1:
            self.streams[step % 2].record_event(self.event)

    def join(self) -> None:
        if self.streams:
            self.streams[0].wait_stream(self.streams[1])


class KVPack:
    """K and V flattened into one buffer and viewed back: TE's packing when their head dims
    differ (``enable_mla``: ``torch.cat((k.view(-1), v.view(-1)))``), the same bytes as its
    stacked (2, ...) buffer when they do not."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k_shape, self.v_shape, self.k_numel = k.shape, v.shape, k.numel()

    @staticmethod
    def pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.cat((k.reshape(-1), v.reshape(-1)))

    def unpack(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return buf[:self.k_numel].view(self.k_shape), buf[self.k_numel:].view(self.v_shape)


def _tile(strat, q, kv, me: int, src: int):
    """One forward tile: (block, out, lse) of the local q against K/V block ``src`` (the
    pair ``kv``); None when the mask hides all of it."""
    if not strat.mask.plain:
        tiles = strat.ring_tiles(src)
        return (_EVERY, *strat.masked_forward(q, kv[0], kv[1], tiles)) if tiles else None
    blk = zigzag_block(me, src, q.shape[1], strat.attn.causal)
    o, lse = strat.kernel_call("forward", q[:, blk.q], kv[0][:, blk.kv], kv[1][:, blk.kv],
                               causal=blk.causal)
    return blk, o, lse


def _correct_lse(lse, tile, step: int, n: int, streams: TileStreams):
    """Fold step ``step``'s lse into the running one on that step's stream (TE L1913-1968)."""
    streams.before_correction(step)
    with streams.on(step):
        if tile is not None:  # an empty masked step has nothing to fold
            blk, _, lse_step = tile
            if lse is None:  # step 0's diagonal (or "all") tile, or a masked one: every row
                lse = lse_step.float().clone()
            else:
                lse[:, :, blk.q] = torch.logaddexp(lse[:, :, blk.q], lse_step.float())
    streams.after_correction(step, n)
    return lse


def _sum_outputs(q, tiles, lse):
    """Every kept output rescaled by exp(lse_step - lse), summed in step order in the activation
    dtype: the product is fp32, each sum rounded to q's dtype as TE's ``out.add_`` (L1980-2030)."""
    out = None
    for blk, o, lse_step in filter(None, tiles):
        # a masked row that sees nothing in this step has o = 0 and lse_step = -inf: weight 0
        # (a pad token sees nothing in any step: its final lse is -inf too, and -inf - -inf
        # would be NaN)
        w = torch.exp(lse_step.float() - lse[:, :, blk.q])
        scaled = o * _rows(torch.where(torch.isneginf(lse_step), 0.0, w))
        if out is None:  # step 0 covers every row
            out = scaled.to(q.dtype)
        else:
            out[:, blk.q].add_(scaled)
    return out


def p2p_forward(strat, q, k, v, comm, streams: TileStreams, sinks=None):
    """TE's forward loop (CP L1697-1970); returns out, lse and the last K/V received.
    ``sinks`` join the final lse once, before the outputs are rescaled to it."""
    g = strat.groups["ring"]
    n, me = g.size, g.index
    pack = KVPack(k, v)
    kv_bufs = [pack.pack(k, v)]  # TE's p2p_comm_buffers: every one kept to the end
    tiles, lse = [], None
    for i in range(n + 1):
        if i < n:
            with streams.on(i):
                if i > 0:
                    comm.wait()  # the K/V posted at step i-1, awaited before this tile
                if i + 1 < n:
                    kv_bufs.append(comm.send_recv(kv_bufs[i]))
                    comm.commit()
                tiles.append(_tile(strat, q, pack.unpack(kv_bufs[i]), me, _fwd_src(me, i, n)))
        if i > 0:  # step i-1's correction runs behind step i's tile
            lse = _correct_lse(lse, tiles[i - 1], i - 1, n, streams)
    streams.join()
    assert lse is not None, "a ring of at least one step"
    lse = sink_lse(lse, sinks)  # exp(lse_step - lse') then leaves each row the sink's share
    return _sum_outputs(q, tiles, lse), lse, kv_bufs[-1]


def p2p_backward(strat, dout, q, kv, out, lse, pack: KVPack):
    """TE's backward loop (CP L2452-2810): dq, and the rank's own dK/dV (views of a ring
    buffer). ``kv``: the packed K/V buffer the forward saved."""
    g = strat.groups["ring"]
    n, me = g.size, g.index
    dq = torch.zeros_like(q)  # activation dtype, as TE's dq_buffer
    # bufs[i][0]: K/V, bufs[i][1]: dK/dV of the block before, both in the activation dtype
    bufs = [kv.new_empty((2, kv.numel())) for _ in range(2)]
    bufs[0][0].copy_(kv)
    comm = RingComm(g)
    for step in range(n):
        cur, nxt = bufs[step % 2], bufs[(step + 1) % 2]
        if n > 1:
            # first hop: no dK/dV exists yet; last hop: nobody needs the K/V any more
            part = slice(0, 1) if step == 0 else slice(1, 2) if step == n - 1 else slice(0, 2)
            comm.send_recv(cur[part], nxt[part], reverse=True)
            comm.commit()
        grads = _bwd_tile(strat, dout, q, pack.unpack(cur[0]), out, lse, me,
                          _bwd_src(me, step, n))
        if grads is not None:
            dq[:, grads[0].q] += grads[1]
        comm.wait()
        # the dK/dV that came in belongs to the block just computed: add ours and it
        # leaves with the next step's message, rounded to the activation dtype
        if step == 0:
            nxt[1].zero_()
        dk, dv = pack.unpack(nxt[1])
        if grads is not None:
            blk, _, bk, bv = grads
            dk[:, blk.kv] += bk
            dv[:, blk.kv] += bv
    return dq, pack.unpack(bufs[n % 2][1])  # own block: every rank's, the diagonal last


def _bwd_tile(strat, dout, q, kv, out, lse, me: int, src: int):
    """(block, dq, dk, dv) of the local q against K/V block ``src``; None when masked away."""
    if not strat.mask.plain:
        tiles = strat.ring_tiles(src)
        return (_EVERY, *strat.masked_backward(dout, q, kv[0], kv[1], out, lse, tiles)
                ) if tiles else None
    blk = zigzag_block(me, src, q.shape[1], strat.attn.causal)
    return blk, *strat.kernel_call("backward", dout[:, blk.q], q[:, blk.q], kv[0][:, blk.kv],
                                   kv[1][:, blk.kv], out[:, blk.q], lse[:, :, blk.q],
                                   causal=blk.causal)


class _TEP2PAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, strat: "MegatronCP", q, k, v, sinks):
        comm = RingComm(strat.groups["ring"])
        out, lse, kv_last = p2p_forward(strat, q, k, v, comm, TileStreams.for_tensor(q, strat),
                                        sinks)
        save_for_backward(ctx, strat, q, kv_last, out, lse, sinks, lse=lse)
        ctx.pack = KVPack(k, v)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kv, out, lse, sinks = ctx.saved_tensors
        dq, dkv = p2p_backward(ctx.strat, dout.contiguous(), q, kv, out, lse, ctx.pack)
        # dK/dV: views of the ring buffer, as TE returns them
        return None, dq, dkv[0], dkv[1], sink_grad(out, dout, lse, sinks)


@register
class MegatronCP(ZigzagLayout, Strategy):
    name = "megatron-cp"
    masks = frozenset({"documents", "window"})
    takes_sinks = True
    description = ("TransformerEngine p2p CP (Megatron): zigzag layout, packed K/V ring, kept "
                   "per-step outputs, reverse ring with K/V+dK/dV in the activation dtype; "
                   "two forward streams on GPU")
    cp_stream = None  # CUDA: the second forward stream, made on first use

    def group_lists(self):
        return {"ring": self.cp_lists}

    def attention(self, q, k, v, sinks=None):
        return _TEP2PAttention.apply(self, q, k, v, sinks)

    def accumulator_bytes(self, phase: str) -> int:
        """Forward: its own K/V stacked into the first ring buffer (TE keeps outputs, not an
        fp32 sum); backward: dq in the activation dtype, the K/V saved stacked, and the two
        ring buffers of K/V + dK/dV."""
        s = self.local_seqlen
        kv = self.kv_bytes(s)
        return kv if phase == FWD else self.q_bytes(s) + kv + 2 * 2 * kv

    def receives_in_place(self, phase: str) -> bool:
        return phase == BWD

    def late_accumulator_bytes(self, phase: str) -> int:
        return 0

    def finish_bytes(self, phase: str) -> int:
        """Forward: the outputs summed (each rescaled in fp32, the last two alive, into out)."""
        s = self.local_seqlen
        if phase == FWD:
            return 2 * self.out_bytes(s, element_size=4) + self.out_bytes(s)
        return super().finish_bytes(phase)

    def held_bytes(self) -> int:
        """At the end of the forward: every received K/V buffer and every step's output and
        lse (TE rescales and sums the outputs only once the final lse is known)."""
        g = self.groups["ring"]
        n, me, s = g.size, g.index, self.attn.seqlen // g.size
        if self.mask.plain:
            rows = [slice_len(zigzag_block(me, _fwd_src(me, step, n), s, self.attn.causal).q, s)
                    for step in range(n)]
        else:  # a masked step keeps every row's output, an empty one none
            rows = [s if pairs else 0 for pairs in kv_ring_areas(self, [self.rank])[0]]
        return (n - 1) * self.kv_bytes(s) + sum(self.out_bytes(r) + self.lse_bytes(r)
                                                     for r in rows)

    def schedule(self) -> list[Step]:
        g = self.groups["ring"]
        n, me, s = g.size, g.index, self.attn.seqlen // g.size
        kv = self.kv_bytes(s)  # K and V; dK/dV travel in the same dtype, same size
        steps = []
        for phase, src_of in ((FWD, _fwd_src), (BWD, _bwd_src)):
            for step in range(n):
                src = src_of(me, step, n)
                nbytes = 0
                if phase == FWD and step + 1 < n:
                    nbytes = kv
                elif phase == BWD and n > 1:
                    nbytes = kv if step in (0, n - 1) else 2 * kv
                # posted before the step's tile, awaited before the next tile (forward) or
                # right after this one (backward): either way one tile hides it
                msgs = (Message("p2p", "ring", nbytes, g.crosses_nodes),) if nbytes else ()
                steps.append(self._step(phase, step, src, msgs))
        return steps

    def _step(self, phase: str, step: int, src: int, msgs) -> Step:
        """The kernel work of one step against K/V block ``src``: the causal tile rule, or
        the pairs the mask lets through."""
        s = self.local_seqlen
        if not self.mask.plain:
            tiles = self.ring_tiles(src)
            return self.pairs_step(phase, step, tiles.pairs, (s, s), msgs, tiles)
        blk = zigzag_block(self.groups["ring"].index, src, s, self.attn.causal)
        return self.kernel_step(phase, step, slice_len(blk.q, s), slice_len(blk.kv, s),
                                blk.causal, msgs)

    def area_per_step(self) -> list[list[int]]:
        return kv_ring_areas(self)  # forward order: K/V of position me-step at step
