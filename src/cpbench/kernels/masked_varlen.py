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

import numpy as np
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
    """The tiles of one (causal, window): one varlen call. Tile t is rows q0[t]:q1[t]
    against keys k0[t]:k1[t] (arrays: a packing makes hundreds of tiles a block)."""

    causal: bool
    window: tuple[int, int]
    q0: np.ndarray
    q1: np.ndarray
    k0: np.ndarray
    k1: np.ndarray
    pairs: np.ndarray  # each tile's visible (query, key) pairs
    _dev: dict = field(default_factory=dict)

    @property
    def tiles(self) -> list[Shape]:
        return [Shape(*t, self.causal, self.window) for t in
                zip(self.q0.tolist(), self.q1.tolist(), self.k0.tolist(), self.k1.tolist())]

    @property
    def max_q(self) -> int:
        return int((self.q1 - self.q0).max())

    @property
    def max_k(self) -> int:
        # see the module docstring: max_seqlen_k >= max_q keeps one-sided windows exact
        return max(self.max_q, int((self.k1 - self.k0).max()))

    def on(self, device, batch: int) -> dict[str, torch.Tensor]:
        """rows / cols (long) and cu_q / cu_k (int32, the tiles repeated per batch element)
        on ``device``; built and copied once, then cached."""
        key = (str(device), batch)
        if key not in self._dev:
            made = (("rows", _ranges(self.q0, self.q1)), ("cols", _ranges(self.k0, self.k1)),
                    ("cu_q", _cu(np.tile(self.q1 - self.q0, batch))),
                    ("cu_k", _cu(np.tile(self.k1 - self.k0, batch))))
            self._dev[key] = {name: x.to(device) for name, x in made}
        return self._dev[key]


def _ranges(a: np.ndarray, b: np.ndarray) -> torch.Tensor:
    """a[0]..b[0]-1, a[1]..b[1]-1, ... as one long tensor."""
    n = b - a
    ends = np.cumsum(n)
    return torch.from_numpy(np.repeat(a - ends + n, n) + np.arange(int(n.sum())))


def _cu(lengths: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(([0], np.cumsum(lengths)))).to(torch.int32)


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
    ok, causal, left, right = _kinds(lo.numpy(), hi.numpy(), np.zeros(1, np.int64),
                                     np.array([sq]), np.array([sk]))
    return (bool(causal[0]), (int(left[0]), int(right[0]))) if ok[0] else None


def _kinds(lo, hi, off, sq, sk):
    """``classify`` of many cropped tiles at once: tile t's rows are lo/hi[off[t]:off[t] +
    sq[t]] (local keys, sk[t] of them). (expressible, causal, left, right) per tile."""
    seg = np.repeat(np.arange(len(sq)), sq)
    i = np.arange(len(lo)) - off[seg]
    d = sk - sq  # bottom-right alignment: row i's diagonal is key i + d
    right = np.where(_every(hi == (sk - 1)[seg], off), -1, hi[off] - d)
    left = np.where(_every(lo == 0, off), -1, (sq - 1 + d) - lo[off + sq - 1])
    bad = ((right != -1) & (right < 0)) | ((left != -1) & (left < 0))
    want_lo = np.where((left >= 0)[seg], np.maximum(i + (d - left)[seg], 0), 0)
    want_hi = np.where((right >= 0)[seg], np.minimum(i + (d + right)[seg], (sk - 1)[seg]),
                       (sk - 1)[seg])
    ok = ~bad & _every((want_lo == lo) & (want_hi == hi), off)
    return ok, right == 0, left, right


def _every(flags: np.ndarray, off: np.ndarray) -> np.ndarray:
    """Per segment (starting at ``off``), whether all its flags hold."""
    return np.minimum.reduceat(flags.astype(np.int8), off).astype(bool)


def _run_bounds(pos: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) of each run of consecutive values in ``pos``."""
    p = pos.numpy()
    breaks = np.flatnonzero(np.diff(p) != 1) + 1
    return np.concatenate(([0], breaks)), np.concatenate((breaks, [len(p)]))


def _refusal(mask: Mask, why: str) -> str:
    return (f"the mask (documents {mask.documents}, window {mask.window}, causal "
            f"{mask.causal}) has a block no varlen kernel call expresses exactly: {why}; "
            f"run it on the CPU (sdpa-cpu) instead")


def largest_call(vplan: VarlenPlan) -> tuple[int, int, int]:
    """(rows, keys, calls): what the largest varlen call of a plan packs (a row is packed
    once per key run it sees), and how many calls the plan makes."""
    sizes = [(int((g.q1 - g.q0).sum()), int((g.k1 - g.k0).sum())) for g in vplan.groups]
    return (*max(sizes, key=sum, default=(0, 0)), len(sizes))


# Every kernel tile is a multiple of 16 tokens a side, so a piece rounded up to 16 first
# rounds to the same whole tiles: pieces are kept at 16-token steps, a packing's hundreds
# of sequences in as many shapes as their lengths have.
STEP = 16


def spectrum(vplan: VarlenPlan) -> tuple[tuple[float, float, bool, float], ...]:
    """The plan's work by piece shape: (rows, keys, causal, share), a sequence's rows and
    keys each rounded up to ``STEP``, its share its visible pairs over the plan's at that
    shape (its visible fraction times the rounded rows x keys). What a varlen call's time
    depends on: each sequence runs at its size in the kernel's whole tiles, which the
    simulator rounds it to (``sim.curves.Tiles``: they are the kernel's, not the plan's)."""
    bins: dict[tuple[float, float, bool], float] = {}
    total = sum(float(g.pairs.sum()) for g in vplan.groups)
    for g in vplan.groups:
        rows, keys = (g.q1 - g.q0).astype(float), (g.k1 - g.k0).astype(float)
        r, k = np.ceil(rows / STEP) * STEP, np.ceil(keys / STEP) * STEP
        shapes, where = np.unique(np.stack([r, k], 1), axis=0, return_inverse=True)
        work = np.bincount(where.ravel(), weights=g.pairs / (rows * keys) * r * k,
                           minlength=len(shapes))
        for (rr, kk), w in zip(shapes, work):
            key = (float(rr), float(kk), g.causal)
            bins[key] = bins.get(key, 0.0) + float(w) / total
    return tuple(sorted((r, k, causal, w) for (r, k, causal), w in bins.items()))


def plan(mask: Mask, q_pos: torch.Tensor, k_pos: torch.Tensor) -> VarlenPlan:
    """The varlen plan of queries at global positions ``q_pos`` against keys at ``k_pos``
    (both in local order); no groups when nothing is visible. Raises UsageError for a tile
    no varlen call can express."""
    q_pos, k_pos = q_pos.long().cpu(), k_pos.long().cpu()
    if not len(q_pos) or not len(k_pos):
        return VarlenPlan([])
    lo_t, hi_t = mask.key_interval(q_pos)
    lo, hi = lo_t.numpy(), hi_t.numpy()
    qa, qb = _run_bounds(mask.run_key(q_pos))
    ka, kb = _run_bounds(mask.run_key(k_pos))
    first = k_pos.numpy()[ka]  # each key run's first position
    pq, pk = _near(first, first + (kb - ka) - 1, np.minimum.reduceat(lo, qa),
                   np.maximum.reduceat(hi, qa))
    t, a, b, c0, c1, causal, left, right, pairs = _crop(lo, hi, qa[pq], qb[pq] - qa[pq], first[pk],
                                                 kb[pk] - ka[pk], mask)
    q0, k0 = qa[pq[t]], ka[pk[t]]
    kinds, at, which = np.unique(np.stack([causal, left, right], 1), axis=0,
                                 return_index=True, return_inverse=True)
    which = which.reshape(-1)
    groups = []
    for g in np.argsort(at):  # in the order the tiles first meet each kind
        m = which == g
        groups.append(Group(bool(kinds[g, 0]), (int(kinds[g, 1]), int(kinds[g, 2])),
                            q0[m] + a[m], q0[m] + b[m], k0[m] + c0[m], k0[m] + c1[m],
                            pairs[m]))
    return VarlenPlan(groups)


def _near(first, last, lo, hi) -> tuple[np.ndarray, np.ndarray]:
    """(query run, key run) pairs whose key positions first..last meet the query run's reach
    lo..hi, query run by query run, key runs in order (many documents: many runs, few
    pairs)."""
    order = np.argsort(first, kind="stable")
    if np.any(np.diff(last[order]) <= 0):  # runs that overlap (repeated keys): every pair
        pq, pk = np.nonzero((first <= hi[:, None]) & (last >= lo[:, None]))
        return pq, pk
    a = np.searchsorted(last[order], lo)  # the first run ending at or after lo
    b = np.searchsorted(first[order], hi, side="right")  # past the last starting by hi
    n = np.maximum(b - a, 0)
    pq = np.repeat(np.arange(len(lo)), n)
    pk = order[np.repeat(a - np.cumsum(n) + n, n) + np.arange(int(n.sum()))]
    keep = np.lexsort((pk, pq))
    return pq[keep], pk[keep]


def _crop(lo, hi, q0, n, start, sk, mask: Mask) -> tuple[np.ndarray, ...]:
    """Tile t: query rows q0[t]..+n[t] (key intervals lo / hi) against the key run of
    positions start[t]..+sk[t]; the tiles that see something cropped and classified, as
    arrays (t, a, b, c0, c1, causal, left, right, pairs) in run-local rows and keys."""
    if not len(n):
        return (np.zeros(0, np.int64),) * 9
    off = np.concatenate(([0], np.cumsum(n)[:-1]))
    seg = np.repeat(np.arange(len(n)), n)
    local = np.arange(int(n.sum())) - off[seg]
    rows = q0[seg] + local
    lo_t = np.maximum(lo[rows] - start[seg], 0)
    hi_t = np.minimum(hi[rows] - start[seg], (sk - 1)[seg])
    seen = lo_t <= hi_t
    count = np.add.reduceat(seen, off)
    big = np.iinfo(np.int64).max
    a = np.minimum.reduceat(np.where(seen, local, big), off)
    b = np.maximum.reduceat(np.where(seen, local, -1), off) + 1
    c0 = np.minimum.reduceat(np.where(seen, lo_t, big), off)
    c1 = np.maximum.reduceat(np.where(seen, hi_t, -1), off) + 1
    live = np.flatnonzero(count > 0)
    if not len(live):
        return (np.zeros(0, np.int64),) * 9
    split = live[b[live] - a[live] != count[live]]
    # the seen rows of each live tile, in local keys: one segment per tile
    sq, k = b[live] - a[live], c1[live] - c0[live]
    pick = np.repeat(off[live] + a[live], sq) + (np.arange(int(sq.sum()))
                                                 - np.repeat(np.cumsum(sq) - sq, sq))
    shift = np.repeat(c0[live], sq)
    t_off = np.cumsum(sq) - sq
    ok, causal, left, right = _kinds(lo_t[pick] - shift, hi_t[pick] - shift, t_off, sq, k)
    if len(split) or not ok.all():
        t = min([*split.tolist(), *live[~ok].tolist()])
        why = ("its query rows that see keys are not one run" if t in set(split.tolist())
               else f"a {b[t] - a[t]} x {c1[t] - c0[t]} tile is neither fully visible, "
                    f"causal nor a window band")
        raise UsageError(_refusal(mask, why))
    pairs = np.add.reduceat(np.where(seen, hi_t - lo_t + 1, 0), off)[live]
    return live, a[live], b[live], c0[live], c1[live], causal, left, right, pairs


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
