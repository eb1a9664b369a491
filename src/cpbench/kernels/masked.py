"""Exact attention of a block under any mask (packed documents, sliding windows), on CPU.

A strategy knows, for the queries and keys it holds, which pairs are visible (a bool matrix
from ``cpbench.mask``) and their global positions. ``plan`` cuts it into tiles — runs of
consecutive positions on both sides (a zigzag chunk, a contiguous shard), rows at most TILE —
and crops each tile to the rows and keys that see anything, so
- a block with nothing visible is skipped, not computed as masked zeros;
- a crop that is all visible, or exactly the square causal triangle, runs the backend's own
  kernel (``causal=False`` / ``True``: sdpa-cpu's fast path);
- any other crop (a document boundary, a window's band) runs aten's CPU flash kernel with an
  additive -inf mask on the CPU (torch's maths with the mask elsewhere): exact either way.
Cropping to rows that see something also means no row is ever fully masked, which the aten
kernel would answer with lse = 0. On GPUs the bias matrix and this tile-by-tile loop would
be the slow path, so ``block_forward`` / ``block_backward`` run ``masked_varlen`` there
instead: uncapped tiles as sequences of the backend's varlen calls, every index on the device.
A strategy holds a ``Block`` (``Strategy.tiles``), which plans whichever path runs on first use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from cpbench.errors import UsageError
from cpbench.kernels import masked_varlen
from cpbench.kernels.base import KernelBackend
from cpbench.kernels.sdpa_cpu import flash_backward, flash_forward
from cpbench.mask import Mask
from cpbench.merge import merge

TILE = 1024  # query rows per tile: a tile's mask is at most TILE × keys
_FWD = "_scaled_dot_product_flash_attention_for_cpu"
_BWD = "_scaled_dot_product_flash_attention_for_cpu_backward"


@dataclass(frozen=True)
class Tile:
    rows: torch.Tensor  # local query indices (long)
    cols: torch.Tensor  # local key indices (long)
    causal: bool  # the backend's own kernel: full (False) or square causal (True)
    bias: torch.Tensor | None  # (rows, cols) additive -inf mask, when neither fits
    pairs: int


def runs(pos: torch.Tensor, limit: int | None = None) -> list[tuple[int, int]]:
    """(start, end) index ranges of consecutive positions, each at most ``limit`` long."""
    breaks = ((pos[1:] - pos[:-1]) != 1).nonzero().flatten().add(1).tolist()
    out = []
    for a, b in zip([0, *breaks], [*breaks, len(pos)]):
        step = limit or (b - a)
        out += [(i, min(i + step, b)) for i in range(a, b, step)]
    return out


def plan(visible: torch.Tensor, q_pos: torch.Tensor | None = None,
         k_pos: torch.Tensor | None = None) -> list[Tile]:
    """The tiles of a (queries × keys) visibility; [] when nothing is visible. With the
    positions, tiles follow their runs, so a zigzag block's chunk pairs each hit a fast path."""
    q_runs = runs(q_pos, TILE) if q_pos is not None else \
        [(i, min(i + TILE, visible.shape[0])) for i in range(0, visible.shape[0], TILE)]
    k_runs = runs(k_pos) if k_pos is not None else [(0, visible.shape[1])]
    tiles = []
    for q0, q1 in q_runs:
        for k0, k1 in k_runs:
            tile = _tile(visible[q0:q1, k0:k1], q0, k0)
            if tile is not None:
                tiles.append(tile)
    return tiles


def _tile(sub: torch.Tensor, q0: int, k0: int) -> Tile | None:
    """One block cropped to the rows and keys that see anything (None: nothing does)."""
    rows = sub.any(1).nonzero().flatten()
    if rows.numel() == 0:
        return None
    cols = sub[rows].any(0).nonzero().flatten()
    m = sub[rows][:, cols]
    n = int(m.sum())
    causal, bias = False, None
    if n != m.numel():
        tri = torch.ones_like(m).tril()
        if m.shape[0] == m.shape[1] and bool((m == tri).all()):
            causal = True
        else:
            bias = torch.zeros(m.shape).masked_fill_(~m, float("-inf"))
    return Tile(rows + q0, cols + k0, causal, bias, n)


def _aten(x) -> bool:
    return x.device.type == "cpu" and hasattr(torch.ops.aten, _FWD)


def _masked_forward(q, k, v, bias, scale):
    if _aten(q):
        out, lse = flash_forward(q, k, v, 0.0, False, attn_mask=bias.to(q.dtype), scale=scale)
        return out, lse.float()
    ke, ve = (x.repeat_interleave(q.shape[2] // x.shape[2], 2).float() for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), ke) * scale + bias.to(q.device)
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), ve)
    return out.to(q.dtype), lse


def _masked_backward(dout, q, k, v, out, lse, bias, scale):
    if _aten(q):
        return flash_backward(dout, q, k, v, out.to(q.dtype), lse.float().contiguous(), 0.0,
                              False, attn_mask=bias.to(q.dtype), scale=scale)
    g = q.shape[2] // k.shape[2]
    ke, ve = (x.repeat_interleave(g, 2).float() for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), ke) * scale + bias.to(q.device)
    p = torch.exp(s - lse.float()[..., None])
    do = dout.float()
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, ve)
    ds = p * (dp - torch.einsum("bqhd,bqhd->bhq", do, out.float())[..., None]) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, ke)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float())
    return dq, dk.unflatten(2, (-1, g)).sum(3), dv.unflatten(2, (-1, g)).sum(3)


def forward(kernel: KernelBackend, tiles: list[Tile], q, k, v, *, softmax_scale: float):
    """(out (b, sq, h, d), lse (b, h, sq) fp32): rows that see nothing have lse -inf, so
    the LSE merge takes them from the other blocks; a row in several tiles is merged.
    out has V's head dim."""
    b, s, h, _ = q.shape
    out = torch.zeros(b, s, h, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    for t in tiles:
        qt, kt, vt = q[:, t.rows], k[:, t.cols], v[:, t.cols]
        if t.bias is None:
            o, lt = kernel.forward(qt, kt, vt, causal=t.causal, softmax_scale=softmax_scale)
        else:
            o, lt = _masked_forward(qt, kt, vt, t.bias, softmax_scale)
        o, lt = merge(out[:, t.rows], lse[:, :, t.rows], o, lt)
        out[:, t.rows] = o
        lse[:, :, t.rows] = lt
    return out, lse


def backward(kernel: KernelBackend, tiles: list[Tile], dout, q, k, v, out, lse, *,
             softmax_scale: float):
    """(dq, dk, dv) in fp32 at the sizes of q, k, v, against the final (merged) out/lse."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for t in tiles:
        args = (dout[:, t.rows], q[:, t.rows], k[:, t.cols], v[:, t.cols], out[:, t.rows],
                lse[:, :, t.rows])
        if t.bias is None:
            g = kernel.backward(*args, causal=t.causal, softmax_scale=softmax_scale)
        else:
            g = _masked_backward(*args, t.bias, softmax_scale)
        dq.index_add_(1, t.rows, g[0].float())
        dk.index_add_(1, t.cols, g[1].float())
        dv.index_add_(1, t.cols, g[2].float())
    return dq, dk, dv


class Block:
    """The masked kernel's plan of queries at global positions ``q_pos`` against keys at
    ``k_pos``: CPU tiles (``tiles``) or varlen groups (``varlen``), each planned on first use
    and kept (the same blocks recur every iteration). False when nothing is visible."""

    def __init__(self, mask: Mask, q_pos: torch.Tensor, k_pos: torch.Tensor):
        self.mask, self.q_pos, self.k_pos = mask, q_pos.cpu(), k_pos.cpu()

    @functools.cached_property
    def pairs(self) -> int:
        """How many (query, key) pairs are visible."""
        return self.mask.pairs(self.q_pos, self.k_pos)

    def __bool__(self) -> bool:
        return self.pairs > 0

    @functools.cached_property
    def tiles(self) -> list[Tile]:
        m = self.mask  # tiles never span a document: each one's block hits a fast path
        return plan(m.visible(self.q_pos, self.k_pos), m.run_key(self.q_pos),
                    m.run_key(self.k_pos))

    @functools.cached_property
    def varlen(self) -> masked_varlen.VarlenPlan:
        return masked_varlen.plan(self.mask, self.q_pos, self.k_pos)

    @functools.cached_property
    def calls(self) -> tuple[tuple[int, int, int], tuple] | None:
        """What the simulator reads of the varlen plan: its largest call and its tiles'
        ``spectrum``; None when no varlen call expresses the block (the CPU's kernels do)."""
        try:
            return masked_varlen.largest_call(self.varlen), masked_varlen.spectrum(self.varlen)
        except UsageError:
            return None


def _use_varlen(kernel: KernelBackend, device, varlen: bool | None) -> bool:
    """Varlen on any device but the CPU (``varlen`` forces either path: tests)."""
    use = torch.device(device).type != "cpu" if varlen is None else varlen
    if use and kernel.varlen_forward is None:
        raise UsageError(masked_varlen.no_varlen(kernel, torch.device(device).type))
    return use


def block_forward(kernel: KernelBackend, block: Block, q, k, v, *, softmax_scale: float,
                  varlen: bool | None = None):
    """``forward`` (CPU) or ``masked_varlen.forward`` (elsewhere) of a ``Block``."""
    if _use_varlen(kernel, q.device, varlen):
        return masked_varlen.forward(kernel, block.varlen, q, k, v, softmax_scale=softmax_scale)
    return forward(kernel, block.tiles, q, k, v, softmax_scale=softmax_scale)


def block_backward(kernel: KernelBackend, block: Block, dout, q, k, v, out, lse, *,
                   softmax_scale: float, varlen: bool | None = None):
    if _use_varlen(kernel, q.device, varlen):
        return masked_varlen.backward(kernel, block.varlen, dout, q, k, v, out, lse,
                                      softmax_scale=softmax_scale)
    return backward(kernel, block.tiles, dout, q, k, v, out, lse, softmax_scale=softmax_scale)
