"""Exact attention of a block under any mask on a GPU: every tile one sequence of a varlen call.

A tile is a (run of consecutive query positions, run of consecutive key positions) pair
inside one document, cropped to the rows and keys that see anything. Under cpbench's masks
(documents, causal, a window) each query sees one interval of key positions, so a tile is
described exactly by per-row intervals (no S × S matrix is ever built) and is one of
flash-attn's per-sequence masks, bottom-right aligned: fully visible, causal, or a window band
(query i of sq × sk sees key j when i + sk - sq - left <= j <= i + sk - sq + right). ``plan``
classifies each tile once, on the CPU, and refuses (UsageError) a tile no varlen call can
express; tiles of one (causal, window) run in one ``varlen_forward`` / ``varlen_backward``
call. Index tensors and ``cu_seqlens`` are built once per plan and moved to the device once
per (device, batch) (``VarlenPlan.on``), so the timed step copies nothing from the host.
Rows in several tiles are merged by their lse with scatter reductions on the device.

flash-attn rewrites windows (flash_api.cpp): a bound >= max_seqlen_k is dropped and, with one
side bounded, the unbounded side becomes max_seqlen_k. Each call therefore passes
``max_seqlen_k = max(max_q, max_k)``: a right side left unbounded next to a bounded left one
then still reaches every key (the first row needs sq - 1), and every finite bound a tile
needs (< sk) is kept as given. Passing a larger max_seqlen_k only sizes the launch grid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpbench.errors import UsageError
from cpbench.kernels.base import KernelBackend
from cpbench.mask import Mask

NO_WINDOW = (-1, -1)


@dataclass(frozen=True)
class Shape:
    """One classified tile: local index ranges [q0, q1) x [k0, k1) and its varlen mask."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    window: tuple[int, int]  # (left, right), -1 unbounded; right == 0 when causal


@dataclass
class Group:
    """The tiles of one (causal, window): one varlen call."""

    causal: bool
    window: tuple[int, int]
    tiles: list[Shape]
    _dev: dict = field(default_factory=dict)

    @property
    def max_q(self) -> int:
        return max(t.q1 - t.q0 for t in self.tiles)

    @property
    def max_k(self) -> int:
        # see the module docstring: max_seqlen_k >= max_q keeps one-sided windows exact
        return max(self.max_q, max(t.k1 - t.k0 for t in self.tiles))

    def on(self, device, batch: int) -> dict[str, torch.Tensor]:
        """rows / cols (long) and cu_q / cu_k (int32, the tiles repeated per batch element)
        on ``device``; built and copied once, then cached."""
        key = (str(device), batch)
        if key not in self._dev:
            rows = torch.cat([torch.arange(t.q0, t.q1) for t in self.tiles])
            cols = torch.cat([torch.arange(t.k0, t.k1) for t in self.tiles])
            cu_q = _cu([t.q1 - t.q0 for t in self.tiles] * batch)
            cu_k = _cu([t.k1 - t.k0 for t in self.tiles] * batch)
            self._dev[key] = {name: x.to(device) for name, x in
                              (("rows", rows), ("cols", cols), ("cu_q", cu_q), ("cu_k", cu_k))}
        return self._dev[key]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)


@dataclass
class VarlenPlan:
    groups: list[Group]

    def __bool__(self) -> bool:
        return bool(self.groups)

    @property
    def tiles(self) -> list[Shape]:
        return [t for g in self.groups for t in g.tiles]


def classify(lo: torch.Tensor, hi: torch.Tensor, sk: int) -> tuple[bool, tuple[int, int]] | None:
    """The varlen mask of a cropped tile whose row i sees local keys lo[i]..hi[i] (every row
    sees some, every key is seen), or None when no bottom-right causal / window mask is
    exactly that visibility."""
    sq = len(lo)
    d = sk - sq  # bottom-right alignment: row i's diagonal is key i + d
    i = torch.arange(sq)
    right = -1 if bool((hi == sk - 1).all()) else int(hi[0]) - d
    left = -1 if bool((lo == 0).all()) else (sq - 1 + d) - int(lo[-1])
    if (right != -1 and right < 0) or (left != -1 and left < 0):
        return None
    want_lo = (i + d - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
    want_hi = (i + d + right).clamp(max=sk - 1) if right >= 0 else torch.full_like(i, sk - 1)
    if not (torch.equal(want_lo, lo) and torch.equal(want_hi, hi)):
        return None
    return right == 0, (left, right)


def _runs(pos: torch.Tensor) -> list[tuple[int, int]]:
    breaks = ((pos[1:] - pos[:-1]) != 1).nonzero().flatten().add(1).tolist()
    return list(zip([0, *breaks], [*breaks, len(pos)]))


def _tile(lo: torch.Tensor, hi: torch.Tensor, q0: int, k0: int, sk: int, mask: Mask
          ) -> Shape | None:
    """The tile of query rows q0.. (their key intervals lo/hi in the key run's local
    coordinates) against keys k0..k0+sk, cropped; None when nothing is visible."""
    lo, hi = lo.clamp(min=0), hi.clamp(max=sk - 1)
    seen = lo <= hi
    if not bool(seen.any()):
        return None
    rows = seen.nonzero().flatten()
    a, b = int(rows[0]), int(rows[-1]) + 1
    if b - a != len(rows):
        raise UsageError(_refusal(mask, "its query rows that see keys are not one run"))
    lo, hi = lo[a:b], hi[a:b]
    c0, c1 = int(lo.min()), int(hi.max()) + 1
    kind = classify(lo - c0, hi - c0, c1 - c0)
    if kind is None:
        raise UsageError(_refusal(mask, f"a {b - a} x {c1 - c0} tile is neither fully "
                                        f"visible, causal nor a window band"))
    return Shape(q0 + a, q0 + b, k0 + c0, k0 + c1, *kind)


def _refusal(mask: Mask, why: str) -> str:
    return (f"the mask (documents {mask.documents}, window {mask.window}, causal "
            f"{mask.causal}) has a block no varlen kernel call expresses exactly: {why}; "
            f"run it on the CPU (sdpa-cpu) instead")


def largest_call(vplan: VarlenPlan) -> tuple[int, int, int]:
    """(rows, keys, calls): what the largest varlen call of a plan packs (a row is packed
    once per key run it sees), and how many calls the plan makes."""
    sizes = [(sum(t.q1 - t.q0 for t in g.tiles), sum(t.k1 - t.k0 for t in g.tiles))
             for g in vplan.groups]
    return (*max(sizes, key=sum, default=(0, 0)), len(sizes))


def plan(mask: Mask, q_pos: torch.Tensor, k_pos: torch.Tensor) -> VarlenPlan:
    """The varlen plan of queries at global positions ``q_pos`` against keys at ``k_pos``
    (both in local order); no groups when nothing is visible. Raises UsageError for a tile
    no varlen call can express."""
    q_pos, k_pos = q_pos.long().cpu(), k_pos.long().cpu()
    lo, hi = mask.key_interval(q_pos)
    k_runs = _runs(mask.run_key(k_pos))
    first = torch.tensor([int(k_pos[a]) for a, _ in k_runs])  # each key run's positions
    last = first + torch.tensor([b - a for a, b in k_runs]) - 1
    groups: dict[tuple, list[Shape]] = {}
    for q0, q1 in _runs(mask.run_key(q_pos)):
        # only the key runs some row's interval reaches (many documents: many runs)
        near = (first <= hi[q0:q1].max()) & (last >= lo[q0:q1].min())
        for r in near.nonzero().flatten().tolist():
            (k0, k1), start = k_runs[r], int(first[r])
            t = _tile(lo[q0:q1] - start, hi[q0:q1] - start, q0, k0, k1 - k0, mask)
            if t is not None:
                groups.setdefault((t.causal, t.window), []).append(t)
    return VarlenPlan([Group(c, w, ts) for (c, w), ts in groups.items()])


def device_refusal(kernel: KernelBackend, device: str) -> str | None:
    """Why masked blocks cannot run with ``kernel`` on ``device`` (None: they can)."""
    if device == "cpu" or kernel.varlen_forward is not None:
        return None
    return no_varlen(kernel, device)


def no_varlen(kernel: KernelBackend, device: str) -> str:
    return (f"--documents / --window-size on {device} need a kernel with varlen calls "
            f"(packed sequences); {kernel.name} has none: use --kernel flash-attn")


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(b, s, h, d) rows ``idx`` packed as varlen tokens (b * len(idx), h, d)."""
    return x.index_select(1, idx).flatten(0, 1)


def forward(kernel: KernelBackend, vplan: VarlenPlan, q, k, v, *, softmax_scale: float):
    """(out (b, sq, h, d) fp32, lse (b, h, sq) fp32), as ``masked.forward``: rows that see
    nothing have out 0 and lse -inf; out has V's head dim."""
    b, s, h, _ = q.shape
    d = v.shape[-1]
    varlen_forward = kernel.varlen_forward
    if varlen_forward is None:  # callers check device_refusal first
        raise UsageError(no_varlen(kernel, q.device.type))
    parts = []
    for g in vplan.groups:
        dev = g.on(q.device, b)
        o, lse = varlen_forward(
            _take(q, dev["rows"]), _take(k, dev["cols"]), _take(v, dev["cols"]), dev["cu_q"],
            dev["cu_k"], g.max_q, g.max_k, causal=g.causal, softmax_scale=softmax_scale,
            window=g.window)
        parts.append((dev["rows"], o.reshape(b, -1, h, d), lse.reshape(h, b, -1).transpose(0, 1)))
    return scatter_merge(parts, (b, s, h, d), q.device)


def scatter_merge(parts, shape, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial (rows, out (b, n, h, d), lse (b, h, n)) by log-sum-exp into rows of a
    (b, s, h, d) result; a row may appear in several parts, or in none (out 0, lse -inf)."""
    b, s, h, d = shape
    top = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=device)
    for rows, _, lse in parts:
        top.scatter_reduce_(2, rows.expand(b, h, -1), lse.float(), "amax")
    top = torch.where(torch.isneginf(top), 0.0, top)
    den = torch.zeros(b, h, s, dtype=torch.float32, device=device)
    acc = torch.zeros(b, s, h, d, dtype=torch.float32, device=device)
    for rows, out, lse in parts:
        w = torch.exp(lse.float() - top.index_select(2, rows))
        den.index_add_(2, rows, w)
        acc.index_add_(1, rows, out.float() * w.transpose(1, 2).unsqueeze(-1))
    # a touched row's sum holds exp(0) = 1 from its largest lse; an untouched one is 0
    out = acc / den.clamp(min=1.0).transpose(1, 2).unsqueeze(-1)
    return out, top + torch.log(den)


def backward(kernel: KernelBackend, vplan: VarlenPlan, dout, q, k, v, out, lse, *,
             softmax_scale: float):
    """(dq, dk, dv) in fp32 at the sizes of q, k, v, against the final (merged) out/lse."""
    b, _, h, d = q.shape
    varlen_backward = kernel.varlen_backward
    if varlen_backward is None:  # callers check device_refusal first
        raise UsageError(no_varlen(kernel, q.device.type))
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    dout, out = dout.to(q.dtype), out.to(q.dtype)
    for g in vplan.groups:
        dev = g.on(q.device, b)
        rows, cols = dev["rows"], dev["cols"]
        lse_t = lse.float().index_select(2, rows).transpose(0, 1).reshape(h, -1)
        gq, gk, gv = varlen_backward(
            _take(dout, rows), _take(q, rows), _take(k, cols), _take(v, cols),
            _take(out, rows), lse_t, dev["cu_q"], dev["cu_k"], g.max_q, g.max_k,
            causal=g.causal, softmax_scale=softmax_scale, window=g.window)
        dq.index_add_(1, rows, gq.reshape(b, -1, h, d).float())
        dk.index_add_(1, cols, gk.reshape(b, len(cols), -1, d).float())
        dv.index_add_(1, cols, gv.reshape(b, len(cols), -1, v.shape[-1]).float())
    return dq, dk, dv
