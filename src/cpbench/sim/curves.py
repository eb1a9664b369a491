"""A hardware preset's attention-kernel curves: attained TFLOP/s against the block side, per
head dim, forward / backward, full and causal, each point with its source.

In a preset (``kernel:`` of ``cpbench/sim/presets/*.yaml``) a curve is a list of points
``[side, tflops]`` or ``[side, tflops, source]``, where ``source`` names an entry of
``kernel.sources``: the paper, figure and value it was read from, or the stated rule that
derived it. Curves are given per head dim (``head_dim_128:``, ``head_dim_64:``, each with
``fwd``, ``bwd`` and optionally ``fwd_causal``, ``bwd_causal``); a preset measured at one
head dim (``cpbench calibrate``) gives them directly under ``kernel:``, for any head dim.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass

from cpbench.errors import UsageError

PHASES = ("fwd", "bwd", "fwd_causal", "bwd_causal")
_HEAD_DIM = re.compile(r"head_dim_(\d+)$")


@dataclass(frozen=True)
class KernelCurve:
    """Attained TFLOP/s of one attention kernel call against its block's side
    L = sqrt(seqlen_q · seqlen_k), log-linear between points, flat beyond the ends."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self):
        sides = [side for side, _ in self.points]
        if not self.points or sides != sorted(sides) or len(set(sides)) != len(sides):
            raise UsageError("a kernel curve needs [side, tflops] points with increasing sides")
        if not all(math.isfinite(v) and v > 0 for point in self.points for v in point):
            raise UsageError("kernel curve sides and TFLOP/s must be positive numbers")

    def tflops(self, side: float) -> float:
        pts = self.points
        if side <= pts[0][0]:
            return pts[0][1]
        if side >= pts[-1][0]:
            return pts[-1][1]
        i = bisect.bisect_right([p[0] for p in pts], side)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        w = (math.log(side) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return y0 + w * (y1 - y0)

    def looping(self, side: float, step: int) -> float:
        """TFLOP/s of a call whose work tiles loop over ``side`` (keys forward, query rows
        backward) in whole steps of ``step``: the curve from its first point up; below it,
        each tile's fixed cost (prologue, epilogue: t0) weighs more, a tile of n steps
        taking t0 + n·tb, with t0 / tb the curve's own (``fixed_steps``)."""
        first, rate = self.points[0]
        if side >= first:
            return self.tflops(side)
        c, n0, n = self.fixed_steps(step), math.ceil(first / step), max(1, math.ceil(side / step))
        on_tiles = rate * n0 * step / first  # the first point's rate on the work its tiles do
        return on_tiles * n / (c + n) * (c + n0) / n0 * side / (n * step)

    def fixed_steps(self, step: int) -> float:
        """t0 / tb: a tile's fixed cost in loop steps, from the first and last points (the
        benchmarks behind a curve keep the count of tiles fixed as L grows: batch x L and
        the heads constant, so its rise with L is t0 spread over longer loops)."""
        (l0, r0), (l1, r1) = self.points[0], self.points[-1]
        n0, n1 = math.ceil(l0 / step), math.ceil(l1 / step)
        q = (r0 * n0 / l0) / (r1 * n1 / l1)  # the rates on the tiles' work, first over last
        return max(0.0, n0 * n1 * (1 - q) / (q * n1 - n0)) if q * n1 > n0 else 0.0


@dataclass(frozen=True)
class Tiles:
    """The tile one phase of a kernel computes whole: ``rows`` query rows by ``keys`` keys
    (``*_causal``: under a causal diagonal, where they differ); ``pack_gqa``: the query
    heads that share a K/V head fill a tile's rows together (FA3's varlen forward), so a
    13-row piece of GQA 8:1 fills 104 of 128 rows, not 13. The default, 128 x 128 without
    packing, is FlashAttention's forward at head dim 128 (kBlockM), for a kernel whose
    preset states no tiles of its own."""

    rows: int = 128
    keys: int = 128
    rows_causal: int | None = None
    keys_causal: int | None = None
    pack_gqa: bool = False

    def loop_step(self, causal: bool, phase: str) -> int:
        """The tile's side its loop steps over: keys forward, query rows backward."""
        if phase == "fwd":
            return (self.keys_causal if causal else None) or self.keys
        return (self.rows_causal if causal else None) or self.rows

    def padded(self, rows: float, keys: float, causal: bool, gqa: int) -> float:
        """The area (per query head) the kernel computes for a ``rows`` x ``keys`` piece."""
        tr, tk = self.loop_step(causal, "bwd"), self.loop_step(causal, "fwd")
        pack = gqa if self.pack_gqa else 1
        return math.ceil(rows * pack / tr) * tr / pack * (math.ceil(keys / tk) * tk)


_TILE_KEYS = ("rows", "keys", "rows_causal", "keys_causal", "pack_gqa")


def parse_tiles(k: dict, where: str) -> tuple[Tiles, Tiles]:
    """A kernel section's ``tiles:`` ({fwd: {rows, keys, ...}, bwd: ..., source: NAME}, NAME
    an entry of its ``sources``), per phase; the default tiles where it gives none."""
    d = k.get("tiles")
    if d is None:
        return Tiles(), Tiles()
    if not isinstance(d, dict) or d.get("source") not in (k.get("sources") or {}):
        raise UsageError(f"{where}.tiles: give fwd and bwd tiles and source: a name of "
                         f"its sources")
    out = []
    for phase in ("fwd", "bwd"):
        t = d.get(phase) or {}
        if not isinstance(t, dict) or any(key not in _TILE_KEYS for key in t):
            raise UsageError(f"{where}.tiles.{phase}: give {', '.join(_TILE_KEYS)}")
        sizes = [t.get(key) for key in _TILE_KEYS[:4]]
        if not all(v is None or (isinstance(v, int) and v > 0) for v in sizes):
            raise UsageError(f"{where}.tiles.{phase}: tile sizes are positive integers")
        out.append(Tiles(**{key: t[key] for key in t}))
    return out[0], out[1]


def piece_rate(spectrum, curve_of, tiles: Tiles = Tiles(), gqa: int = 1,
               scale: float = 1.0, phase: str = "fwd", fixed_tiles: bool = True) -> float:
    """TFLOP/s of a varlen call whose work is ``spectrum`` ((rows, keys, causal, share of
    the visible pairs) by piece: ``masked_varlen.spectrum``), each piece's rows and keys
    x ``scale`` rounded up to the kernel's whole ``tiles`` (``gqa`` query heads a K/V head)
    and run on ``curve_of(causal)`` at the length its tiles loop over: its keys forward,
    its rows backward (``KernelCurve.looping``; GQA's packed heads add tiles, not loop
    steps): the call's FLOPs (of its visible pairs) over its pieces' summed times. A causal
    piece with more keys than rows (bottom-right aligned) is a full rows x (keys - rows)
    block beside a rows x rows diagonal: its tiles left of the diagonal run unmasked.
    ``fixed_tiles`` false (curves benchmarked at a fixed batch, whose rise with L is the
    call's, not each tile's): below a curve's first point a piece runs at that point's rate."""
    time = 0.0
    for rows, keys, causal, share in spectrum:
        r, k = rows * scale, keys * scale
        for side, causal_part, part in _parts(r, k, causal, share):
            area = tiles.padded(r, side, causal_part, gqa)
            step = tiles.loop_step(causal_part, phase)
            loop = math.ceil((k if phase == "fwd" else r) / step) * step
            curve = curve_of(causal_part)
            rate = curve.looping(loop, step) if fixed_tiles else curve.tflops(loop)
            time += part * area / (r * side) / rate
    return 1 / time


def _parts(r: float, k: float, causal: bool, share: float):
    """(keys, causal, share of the visible pairs) of a piece's full and diagonal parts."""
    if not causal or k <= r:
        return [(k, causal, share)]
    full = r * (k - r) / (r * (k - r) + r * r / 2)
    return [(k - r, False, share * full), (r, True, share * (1 - full))]


@dataclass(frozen=True)
class KernelSet:
    """One head dim's curves. A causal (diagonal) block has its own where given: half its
    tiles are masked, so it attains less per FLOP (counted as half the square's) than a
    full block of the same side; without them it is priced on the full-block curve."""

    fwd: KernelCurve
    bwd: KernelCurve | None  # None: no backward figure at this head dim (another's prices it)
    fwd_causal: KernelCurve | None = None
    bwd_causal: KernelCurve | None = None

    def curve(self, phase: str, causal: bool) -> KernelCurve:
        if causal:
            curve = self.fwd_causal if phase == "fwd" else self.bwd_causal
            if curve is not None:
                return curve
        out = self.fwd if phase == "fwd" else self.bwd
        assert out is not None, "nearest() picks a set with this phase"
        return out

    def curves(self) -> tuple[KernelCurve, ...]:
        return tuple(c for c in (self.fwd, self.bwd, self.fwd_causal, self.bwd_causal)
                     if c is not None)


def _curve(points, sources: dict, what: str) -> KernelCurve:
    if not isinstance(points, list):
        raise UsageError(f"{what}: write [[side, tflops], ...] or [[side, tflops, source], ...]")
    out = []
    for p in points:
        if not (isinstance(p, list) and len(p) in (2, 3)):
            raise UsageError(f"{what}: {p!r} is not [side, tflops] or [side, tflops, source]")
        if len(p) == 3 and p[2] not in sources:
            raise UsageError(f"{what}: point {p!r} cites {p[2]!r}, which kernel.sources does "
                             f"not list ({', '.join(sources) or 'none'})")
        try:
            out.append((float(p[0]), float(p[1])))
        except (TypeError, ValueError):
            raise UsageError(f"{what}: {p!r} is not [side, tflops]") from None
    try:
        return KernelCurve(tuple(out))
    except UsageError as e:
        raise UsageError(f"{what}: {e}") from None


def _set(d: dict, sources: dict, where: str, need_bwd: bool = True) -> KernelSet:
    if not isinstance(d, dict) or "fwd" not in d or (need_bwd and "bwd" not in d):
        raise UsageError(f"{where}: needs fwd and bwd curves (and optionally fwd_causal, "
                         f"bwd_causal)")
    curves = {k: _curve(d[k], sources, f"{where}.{k}") for k in PHASES if d.get(k) is not None}
    return KernelSet(curves["fwd"], curves.get("bwd"), curves.get("fwd_causal"),
                     curves.get("bwd_causal"))


def parse(k: dict, where: str) -> list[tuple[int | None, KernelSet]]:
    """(head dim, curves) in the preset's order; head dim None: one set for any head dim."""
    sources = k.get("sources") or {}
    if not isinstance(sources, dict):
        raise UsageError(f"{where}.sources: a mapping of name → what the figure or rule is")
    by_dim = [(int(m.group(1)), key) for key in k if (m := _HEAD_DIM.match(str(key)))]
    if by_dim:
        if "fwd" in k or "bwd" in k:
            raise UsageError(f"{where}: give curves per head dim (head_dim_N) or directly "
                             f"under kernel, not both")
        # the first head dim needs both phases; another may give only the forward (its
        # backward priced on the nearest head dim that has one, and said: ``gaps``)
        return [(dim, _set(k[key], sources, f"{where}.{key}", need_bwd=i == 0))
                for i, (dim, key) in enumerate(by_dim)]
    return [(None, _set(k, sources, where))]


def nearest(sets: tuple[tuple[int | None, KernelSet], ...], head_dim: int | None,
            phase: str = "fwd") -> KernelSet:
    """The set of ``head_dim``, or of the nearest head dim given (the larger on a tie), among
    those with a ``phase`` curve."""
    if head_dim is None or len(sets) == 1 or sets[0][0] is None:
        return sets[0][1]
    having = [s for s in sets if getattr(s[1], phase) is not None]
    return min(having, key=lambda s: (abs((s[0] or 0) - head_dim), -(s[0] or 0)))[1]


def gaps(kernel: str, sets: tuple[tuple[int | None, KernelSet], ...], head_dim: int | None,
         causal: bool) -> list[str]:
    """What a problem's blocks are priced on where ``kernel`` has no figure of their own: the
    nearest head dim's curves, the full-block curve for a causal block, one point held flat.
    Each said in a line; nothing is scaled by a guessed factor."""
    if sets[0][0] is None:  # a measured preset: one set for any head dim
        return []
    out = []
    for phase, word in (("fwd", "forward"), ("bwd", "backward")):
        chosen = nearest(sets, head_dim, phase)
        dim = next(d for d, s in sets if s is chosen)
        if head_dim is not None and dim != head_dim:
            have = ", ".join(str(d) for d, s in sets if getattr(s, phase) is not None)
            out.append(f"{kernel}: no head dim {head_dim} {word} figure on this GPU; priced "
                       f"on head dim {dim}'s (published: {have})")
        own = getattr(chosen, f"{phase}_causal")
        if causal and own is None:
            out.append(f"{kernel}: no causal {word} figure at head dim {dim}; causal blocks "
                       f"priced on the full-block curve (FLOPs halved)")
        curve = own if causal and own is not None else getattr(chosen, phase)
        if len(curve.points) == 1:
            out.append(f"{kernel}: one published {word} point (L = {curve.points[0][0]:g}) at "
                       f"head dim {dim}; held flat at every block size")
    return out
