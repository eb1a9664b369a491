"""llama3: all-gather K/V across the CP group, then attention of the local queries (the
Llama 3 paper's context parallelism, section 3.3.2; TransformerEngine's ``all_gather`` CP
type; ring-flash-attn's ``llama3_flash_attn_varlen_func``).

Layouts (``--layout``):
- ``zigzag`` (default, the paper's and TE's): the sequence cut into 2·N chunks, ring position
  r holding chunks r and 2N-1-r, so causal work is balanced. The gathered K/V are put back in
  sequence order (TE: ``get_seq_chunk_ids_for_reordering_before_attn``, context_parallel.py
  v2.18 L3222-3231); without a mask each local half attends to the keys before it: the
  earlier keys in full, its own chunk causal. Under a mask too, so each document's keys are
  one run for the varlen kernel, not 2N. Under documents the chunks are the whole
  sequence's, as the paper cuts it (any document lengths).
- ``zigzag-documents``: under documents *each document* cut into 2N chunks, rank r holding
  chunks r and 2N-1-r of every one (TE's thd format, ``thd_partition_indices_kernel``;
  MagiAttention's Ring AllGather baseline, ``exps/dist_attn/baselines/ring_attn.py``
  ``RingAttnAllGather.dispatch``: ``zigzag_dispatch`` of the padded thd layout), so every
  document is balanced; documents padded to 2N. The gathered K/V are put back in sequence
  order token by token (that baseline's ``gather_with_reorder_before_attn``), and dK/dV back
  in member order before the reduce-scatter. Without documents it is ``zigzag``.
- ``contiguous``: ring position r holds tokens [r·S/N, (r+1)·S/N), as ring-flash-attn's
  llama3 (the twin of ``rfa-llama3``).

Forward: K and V are gathered from every rank (two all-gathers per head chunk) and the local
queries attend to every key they see under the mask; under a mask a zigzag rank calls the
kernel once per half, each against the whole gathered sequence, and adds the halves' dK/dV in
their dtype (MagiAttention's ``FA3RingAGAttnFunc``, ring_attn.py L505-522, L588-615).
Backward: K and V are gathered again (not kept: the point of the method is memory), dQ stays
here, and the dK/dV of the whole sequence are reduce-scattered back to their owners.
As ring-flash-attn (llama3_flash_attn_varlen.py, 0.1.8) by default:
- ``--heads-k-stride H`` gathers (and reduce-scatters) H K/V heads at a time, capping the
  gathered buffers at H/kv_heads of the sequence's K/V; 0 gathers every head at once;
- the next head chunk's all-gathers are posted as soon as this chunk's have arrived, before
  its kernels, so they travel while it computes (L97-115 forward, L213-243 backward); the
  first chunk's are exposed;
- the dK/dV buffer of the whole sequence is in the activation dtype (L194-198), and the
  reduce-scatters, posted after a chunk's kernels and awaited at once, move that dtype
  (L292-293; TE's all_gather alike: L3766-3775, L4098-4121).
``--dkv-dtype fp32`` (a cpbench variant) keeps the dK/dV buffer and the reduce-scatter in fp32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from cpbench.comm import all_gather_seq_async, reduce_scatter_seq
from cpbench.errors import UsageError
from cpbench.merge import add_sink, sink_grad
from cpbench.strategies import register
from cpbench.strategies._llama3_calls import attend, attend_grads
from cpbench.strategies.base import BWD, FWD, Message, Step, Strategy, option, save_for_backward
from cpbench.strategies.layout import (
    check_divisible,
    check_documents_divisible,
    contiguous_index,
    zigzag_documents_half,
    zigzag_documents_index,
    zigzag_index,
)

LAYOUTS = ("zigzag", "contiguous", "zigzag-documents")
DKV_DTYPES = ("activation", "fp32")


def _gathered(strat, k, v):
    """Per head chunk: (query heads, K/V heads, K and V of the whole sequence in member
    order). Chunk i+1's gathers are posted once chunk i's have arrived, before the caller
    computes chunk i (ring-flash-attn's prefetch)."""
    g, chunks = strat.groups["cp"], strat.head_chunks()

    def post(kh):
        return all_gather_seq_async(k[:, :, kh], g), all_gather_seq_async(v[:, :, kh], g)

    pending = post(chunks[0][1])
    for i, (qh, kh) in enumerate(chunks):
        k_all, v_all = (wait() for wait in pending)
        if i + 1 < len(chunks):
            pending = post(chunks[i + 1][1])
        yield qh, kh, k_all, v_all


class _Llama3Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, strat, q, k, v, sinks):
        out = q.new_empty(*q.shape[:3], v.shape[-1])  # V's width
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32,
                          device=q.device)
        for qh, _, k_all, v_all in _gathered(strat, k, v):
            # every key of these heads is in: their sinks join once, here
            o, lse[:, qh] = add_sink(*attend(strat, q[:, :, qh], k_all, v_all),
                                     None if sinks is None else sinks[qh])
            out[:, :, qh] = o.to(q.dtype)
        save_for_backward(ctx, strat, q, k, v, out, lse, sinks, lse=lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        dout = dout.contiguous()
        strat = ctx.strat
        q, k, v, out, lse, sinks = ctx.saved_tensors
        g = strat.groups["cp"]
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        for qh, kh, k_all, v_all in _gathered(strat, k, v):
            dq_c, dk_all, dv_all = attend_grads(strat, dout[:, :, qh], q[:, :, qh], k_all,
                                                 v_all, out[:, :, qh], lse[:, qh])
            dq[:, :, qh] = dq_c.to(q.dtype)
            dk[:, :, kh] = reduce_scatter_seq(dk_all, g).to(k.dtype)
            dv[:, :, kh] = reduce_scatter_seq(dv_all, g).to(v.dtype)
        return None, dq, dk, dv, sink_grad(out, dout, lse, sinks)


@register
class Llama3(Strategy):
    name = "llama3"
    description = ("all-gather K/V, local queries attend to the whole sequence; dK/dV "
                   "reduce-scattered (Llama 3's CP; zigzag layout by default)")
    masks = frozenset({"documents", "window"})
    takes_sinks = True

    @dataclass(frozen=True, kw_only=True)
    class Options:
        layout: str = option("zigzag", "which tokens a rank holds: zigzag (the Llama 3 paper, "
                             "TE's all_gather: chunks r and 2N-1-r of 2N), contiguous "
                             "(ring-flash-attn's llama3) or zigzag-documents (each "
                             "document zigzagged: TE's thd)", LAYOUTS)
        heads_k_stride: int = option(0, "K/V heads gathered at a time (0: all at once); "
                                     "fewer caps the gathered buffers")
        dkv_dtype: str = option("activation", "dtype of the dK/dV buffer and its "
                                "reduce-scatter: activation (ring-flash-attn, TE) or fp32 "
                                "(a cpbench variant)", DKV_DTYPES)

    @classmethod
    def variants(cls, topo) -> list:
        # the paper's layout and the twin of rfa-llama3 side by side (zigzag-documents is
        # zigzag unless documents are given: asked for by name)
        return [cls.Options(layout=layout) for layout in ("zigzag", "contiguous")]

    @classmethod
    def layout_multiples(cls, cp_size: int, options) -> tuple[int, int]:
        # zigzag cuts the whole sequence into 2N chunks (any document lengths, as the paper);
        # zigzag-documents cuts every document into 2N (documents padded to 2N, as TE's thd)
        layout = (options or cls.Options()).layout
        if layout == "zigzag-documents":
            return 2 * cp_size, 2 * cp_size
        return 1, 2 * cp_size if layout == "zigzag" else cp_size

    def validate(self) -> None:
        o, n = self.opts, self.cp_size
        for name, value, allowed in (("layout", o.layout, LAYOUTS),
                                     ("dkv-dtype", o.dkv_dtype, DKV_DTYPES)):
            if value not in allowed:
                raise UsageError(f"{self.name} --{name} must be one of {', '.join(allowed)}, "
                                 f"got {value!r}")
        zigzag = self.zigzag
        check_divisible(self.attn.seqlen, 2 * n if zigzag else n,
                        f"{self.name} over {n} ranks" + (" (zigzag: 2 chunks per rank)"
                                                         if zigzag else ""))
        if (docs := self.documents_zigzagged()) is not None:
            check_documents_divisible(docs, 2 * n, f"{self.name} over {n} ranks")
        stride, hk = o.heads_k_stride, self.attn.num_kv_heads
        if stride < 0 or (stride and hk % stride):
            ok = ", ".join(str(d) for d in range(1, hk + 1) if hk % d == 0)
            raise UsageError(f"--heads-k-stride {stride} must divide the {hk} K/V heads; "
                             f"use 0 (all at once) or one of: {ok}")

    def group_lists(self):
        return {"cp": self.cp_lists}

    @property
    def zigzag(self) -> bool:
        """Two chunks a rank (of the sequence, or of every document)."""
        return self.opts.layout != "contiguous"

    def documents_zigzagged(self) -> tuple[int, ...] | None:
        """The documents each cut in 2N (``zigzag-documents`` under documents), or None."""
        return (self.attn.documents or None) if self.opts.layout == "zigzag-documents" else None

    def seq_index(self, rank: int) -> torch.Tensor:
        if (docs := self.documents_zigzagged()) is not None:
            return zigzag_documents_index(docs, self.cp_size, self.cp_index(rank))
        index = zigzag_index if self.zigzag else contiguous_index
        return index(self.attn.seqlen, self.cp_size, self.cp_index(rank))

    def resolved_options(self) -> dict:
        return {**dataclasses.asdict(self.opts), "heads_k_stride": self.stride}

    @property
    def stride(self) -> int:
        return self.opts.heads_k_stride or self.attn.num_kv_heads

    @property
    def dkv_dtype(self) -> torch.dtype:
        return torch.float32 if self.opts.dkv_dtype == "fp32" else self.attn.torch_dtype

    def late_accumulator_bytes(self, phase: str) -> int:
        return 0  # its sums exist before the first call

    def accumulator_bytes(self, phase: str) -> int:
        """out / dq, dk, dv filled chunk by chunk, and a chunk's sums: out in fp32 (and its
        rows' accumulator) in the forward; dq in fp32 and the gathered sequence's dK, dV in
        the backward (under a mask: those of the calls per half); zigzag also reorders the
        gathered K/V (a copy)."""
        s, share = self.local_seqlen, self.stride / self.attn.num_kv_heads
        q32, gathered = self.q_bytes(s, element_size=4), self.cp_size * self.kv_bytes(s)
        plain = self.mask.plain  # under a mask the masked kernels return the fp32 sums
        reordered = gathered if self.zigzag else 0
        halves = not plain and self.zigzag  # a masked call per half
        if phase == FWD:  # out and its rows' accumulator: V's width (halves: out fp32)
            out32 = self.out_bytes(s, element_size=4)
            return self.out_bytes(s) + self.lse_bytes(s) + int(
                share * ((plain * 2 + halves) * out32 + reordered))
        wide = 4 // self.attn.element_size if self.opts.dkv_dtype == "fp32" else 1
        return self.q_bytes(s) + self.kv_bytes(s) + int(
            share * (plain + halves) * (q32 + wide * gathered) + share * reordered)

    def finish_bytes(self, phase: str) -> int:
        """The backward's end: under a mask, the masked kernel's fp32 dK, dV of the gathered
        sequence cast to the dK/dV dtype (a copy unless that is fp32; put back in member order
        after the kernel's buffers are freed: no higher peak, measured on fake CUDA); plain
        zigzag puts the gathered dK, dV back in member order (a copy each), beside the K/V in
        both orders."""
        base = super().finish_bytes(phase)
        if phase == FWD:
            return base
        share = self.stride / self.attn.num_kv_heads
        gathered = self.cp_size * self.kv_bytes(self.local_seqlen)
        wide = 4 // self.attn.element_size if self.opts.dkv_dtype == "fp32" else 1
        if not self.mask.plain:
            return base + int(share * gathered) * (self.dkv_dtype.itemsize < 4)
        if self.zigzag:
            return base + int(share * (wide + 1) * gathered)
        return base

    def head_chunks(self) -> list[tuple[slice, slice]]:
        """(query heads, K/V heads) of each gather."""
        group = self.attn.heads // self.attn.num_kv_heads
        return [(slice(h * group, (h + self.stride) * group), slice(h, h + self.stride))
                for h in range(0, self.attn.num_kv_heads, self.stride)]

    # -- the gathered sequence ----------------------------------------------------------------

    def _orders(self, device) -> dict[bool, torch.Tensor] | None:
        """{to sequence order: indices, to member order: indices} of the pieces an all-gather
        lays out (group members in global rank order, each member's in its local order):
        chunks (S/N contiguous, S/2N zigzag), or tokens when every document is zigzagged;
        None when that is sequence order (contiguous on a ring in rank order). Made once per
        device at the first call (a forward: the warm-up), not per step: the backward's own
        would otherwise copy host to device in a step."""
        cache = self.__dict__.setdefault("_order_cache", {})
        if device not in cache:
            ring = sorted(next(lst for lst in self.cp_lists if self.rank in lst))
            orders: tuple[torch.Tensor, torch.Tensor] | None
            if self.documents_zigzagged() is not None:  # token by token
                orders = (self.sorted_positions(ring).indices, self.positions(ring))
            else:
                n, zigzag = self.cp_size, self.zigzag
                held = [c for p in map(self.cp_index, ring)
                        for c in ((p, 2 * n - 1 - p) if zigzag else (p,))]
                orders = None if held == sorted(held) else (
                    torch.tensor([held.index(c) for c in range(len(held))]), torch.tensor(held))
            cache[device] = orders and {True: orders[0].to(device), False: orders[1].to(device)}
        return cache[device]

    def _reorder(self, x_bs: torch.Tensor, to_sequence: bool) -> torch.Tensor:
        orders = self._orders(x_bs.device)
        if orders is None:
            return x_bs
        order = orders[to_sequence]
        return x_bs.unflatten(1, (len(order), -1)).index_select(1, order).flatten(1, 2)

    def in_sequence_order(self, gathered: torch.Tensor) -> torch.Tensor:
        return self._reorder(gathered, True)

    def in_member_order(self, x_bs: torch.Tensor) -> torch.Tensor:
        """The inverse: what a reduce-scatter hands each member its own tokens from."""
        return self._reorder(x_bs, False)

    def plain_parts(self, position: int | None = None
                    ) -> list[tuple[slice, list[tuple[slice, bool]]]]:
        """Without documents or a window, per run of local query rows (one contiguous, two
        zigzag halves), the keys of the sequence-ordered gather they see: the earlier keys in
        full, then their own chunk causal (the kernels' fast paths); full attention: every
        key. ``position``: that ring position's (default this rank's)."""
        s, n = self.local_seqlen, self.cp_size
        me = self.cp_index(self.rank) if position is None else position
        if not self.attn.causal:
            return [(slice(0, s), [(slice(0, self.attn.seqlen), False)])]
        zigzag = self.zigzag
        c = s // 2 if zigzag else s
        chunks = (me, 2 * n - 1 - me) if zigzag else (me,)
        out = []
        for j, chunk in enumerate(chunks):
            parts = [(slice(0, chunk * c), False)] if chunk else []
            out.append((slice(j * c, (j + 1) * c), parts + [(slice(chunk * c, (chunk + 1) * c),
                                                              True)]))
        return out

    def half_rows(self) -> list[slice | np.ndarray]:
        """The local query rows of each kernel call under a mask: zigzag's two halves apart
        (the chunks r and 2N-1-r; under ``zigzag-documents`` every document's first chunks,
        then its second: TE's ``thd_read_half_tensor``), as TE and MagiAttention's Ring
        AllGather call them; contiguous: all rows in one call."""
        s = self.local_seqlen
        if not self.zigzag:
            return [slice(0, s)]
        if (docs := self.documents_zigzagged()) is not None:
            return [zigzag_documents_half(docs, self.cp_size, i) for i in (0, 1)]
        return [slice(0, s // 2), slice(s // 2, s)]

    def halves(self, device) -> list[slice | torch.Tensor]:
        """``half_rows`` on ``device`` (index tensors made once per device, at the warm-up)."""
        cache = self.__dict__.setdefault("_halves", {})
        if device not in cache:
            cache[device] = [r if isinstance(r, slice) else torch.from_numpy(r).to(device)
                             for r in self.half_rows()]
        return cache[device]

    def gathered_tiles(self, half: int = 0):
        """The queries of ``half_rows()[half]`` against the gathered sequence put back in
        sequence order (each document's keys one run for the varlen kernel). Planned at the
        first call (the warm-up): the positions' sort stays out of the timed steps."""
        tiles = self.__dict__.get("_gathered_tiles")
        if tiles is None:
            ring = next(lst for lst in self.cp_lists if self.rank in lst)
            keys = self.sorted_positions(sorted(ring)).values
            tiles = self.__dict__["_gathered_tiles"] = [
                self.tiles(("gathered", i), self.held_positions(rows), keys)
                for i, rows in enumerate(self.half_rows())]
        return tiles[half]

    def attention(self, q, k, v, sinks=None):
        return _Llama3Attention.apply(self, q, k, v, sinks)

    # -- the schedule -------------------------------------------------------------------------

    def schedule(self) -> list[Step]:
        g, a = self.groups["cp"], self.attn
        n, chunks = g.size, len(self.head_chunks())
        elems = a.batch * self.local_seqlen * self.stride * (n - 1)  # times a head dim
        kv = tuple(elems * d * a.element_size for d in (a.head_dim, a.dv))  # K, V
        dkv = tuple(elems * d * self.dkv_dtype.itemsize for d in (a.head_dim, a.dv))
        steps: list[Step] = []
        for phase in (FWD, BWD):
            for i in range(chunks):
                gathers = []
                if n > 1 and i == 0:  # the first chunk's gathers: nothing to hide them
                    gathers += [Message("ag", g.name, b, g.crosses_nodes, overlapped=False)
                                for b in kv]
                if n > 1 and i + 1 < chunks:  # the next chunk's, behind this one's kernels
                    gathers += [Message("ag", g.name, b, g.crosses_nodes,
                                        overlap_steps=self._steps_per_chunk()) for b in kv]
                scatters = [Message("rs", g.name, b, g.crosses_nodes, overlapped=False,
                                    after_compute=True)
                            for b in dkv] if phase == BWD and n > 1 else []
                steps += self._chunk_steps(phase, len(steps), chunks, gathers, scatters)
        return steps

    def _steps_per_chunk(self) -> int:
        """Kernel steps of one head chunk, the same on every rank (the simulator's rule)."""
        if not self.mask.plain:
            return 2 if self.zigzag else 1  # a call per half (``half_rows``)
        return max(sum(len(parts) for _, parts in self.plain_parts(p))
                   for p in range(self.cp_size))

    def _chunk_steps(self, phase: str, index: int, chunks: int, gathers, scatters
                     ) -> list[Step]:
        """One head chunk: the gathers before its first kernel, the reduce-scatters after
        its last; under a mask one kernel per half (``half_rows``), else ``plain_parts``."""
        s = self.local_seqlen
        if not self.mask.plain:  # a call per half, each against the whole gathered sequence
            tiles = map(self.gathered_tiles, range(self._steps_per_chunk()))
            steps = [self.pairs_step(phase, index + i, blk.pairs / chunks,
                                     (len(blk.q_pos), self.attn.seqlen), (), blk)
                     for i, blk in enumerate(tiles)]
        else:
            blocks = [(len(range(s)[rows]), len(range(self.attn.seqlen)[keys]), causal)
                      for rows, parts in self.plain_parts() for keys, causal in parts]
            # a rank with fewer kernels (no earlier keys) gets empty steps in their place
            missing = self._steps_per_chunk() - len(blocks)
            steps = [Step(phase, index + i, 0.0) for i in range(missing)]
            steps += [self.kernel_step(phase, index + missing + i, sq, sk, causal,
                                       head_share=chunks)
                      for i, (sq, sk, causal) in enumerate(blocks)]
        steps[0] = dataclasses.replace(steps[0], messages=tuple(gathers))
        steps[-1] = dataclasses.replace(steps[-1], messages=steps[-1].messages + tuple(scatters))
        # after the gather, each rank runs its kernels back to back: no rank waits for another
        # until the next chunk's gather or the reduce-scatter (the simulator sums them per rank)
        return steps[:1] + [dataclasses.replace(st, joins=False) for st in steps[1:]]
