#!/usr/bin/env python3
"""Read MagiAttention's published distributed benchmark (H100 with FA3, B200 with cuDNN; 8-64
GPUs; GQA 64:8, head dim 128) off its figures into a cpbench validation CSV.

    git clone https://github.com/SandAI-org/MagiAttention   # read at 2c641357
    python scripts/digitize_magiattention.py MagiAttention/assets/magi_attn/exp/distributed \
        configs/validation/magiattention_h100.csv configs/validation/magiattention_b200.csv

The figures (docs/source/blog/cp_benchmark.md, "Distributed Level"; added in 09fc31b2 "Dev
v1.1.0", 2026-02-28) are bar charts, forward and backward TFLOP/s per GPU apart, with no
numbers printed and no data file in the repository: each bar is measured in pixels. The
y axis is a least-squares line through the gridlines (residual under 1 px) at the values
their labels print, read glyph by glyph against DejaVu Sans, matplotlib's font: the ticks
differ between figures (50 on H100's varlen causal backward, 100 on B200's; a tick assumed
per GPU read those bars at twice their value until 2026-11-28). A bar's top is the most
common top over its columns, reading up from the axis through other series' lines and
stopping at the background (a 9504 x 4704 figure: 0.18-0.41 TFLOP/s a pixel).
Their FLOPs are cpbench's (4 · mask area · query heads · head dim, backward 2.5x),
so the FWD+BWD figure is 3.5 / (1 / fwd + 2.5 / bwd) and the times follow from it.

    python scripts/digitize_magiattention.py MagiAttention/assets/magi_attn/exp/distributed \
        configs/validation/magiattention_h100_varlen.csv \
        configs/validation/magiattention_b200_varlen.csv --varlen 20 --max-gpus 8

    python scripts/digitize_magiattention.py MagiAttention/assets/magi_attn/exp/distributed \
        configs/validation/magiattention_h100_varlen_16_64.csv \
        configs/validation/magiattention_b200_varlen_16_64.csv --varlen 5 --min-gpus 16

reads the varlen figures (packed documents: "varlen full", "varlen causal"), whose rows
have no times (each packing has its own mask area) and name the documents cpbench packs
(``VARLEN_DOCUMENTS``) and how many packings to simulate.

    python scripts/digitize_magiattention.py --kernel cudnn \
        MagiAttention/assets/magi_attn/exp/kernel/b200

prints one legend's bars of the "Kernel Level" figures (one GPU, batch 1, GQA 64:8, head dim
128, seqlen 1K-32K; full and causal, forward and backward), read the same way, and each
figure's TFLOP/s a pixel: the B200 preset's cuDNN curves (--kernel cudnn: TransformerEngine's
fused attention) and FlashAttention-4's (--kernel fa4: flash_attn.cute's flash_attn_func) in
src/cpbench/sim/presets/b200.yaml. Given .../kernel/h100 it reads the H100 figures' legend
(fa2, fa3, cudnn, flex, flash_mask, sdpa, ffa), and their varlen full and causal
figures too (--kernel fa3: FlashAttention-3).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from functools import cache
from pathlib import Path

import numpy as np
from PIL import Image

from cpbench.metrics import fwd_bwd_rate

GRID = (234, 234, 234)  # the figures' gridline grey
COLOURS = {(199, 95, 133): "ulysses", (218, 136, 129): "ring_p2p",
           (237, 218, 168): "ring_allgather", (255, 191, 171): "usp",
           (150, 199, 168): "loongtrain", (83, 150, 159): "hybrid_dcp",
           (71, 126, 184): "magi_attn-a2av", (66, 103, 129): "magi_attn-native"}
# legend name -> (implementation, cpbench strategy); hybrid_dcp and MagiAttention have none
IMPLS = {"ulysses": ("Ulysses", "ulysses"),
         "ring_p2p": ("Ring P2P (TE p2p)", "megatron-cp"),
         "ring_allgather": ("Ring AllGather (TE)", "llama3"),
         "usp": ("USP", "usp"),
         "loongtrain": ("LoongTrain", "usp")}
RUNS = {"h100": (8192, "fa3"), "b200": (16384, "cudnn")}  # tokens a GPU, kernel
# the kernel-level figures: the same palette, each GPU's own legend (the colours of its legend
# patches, read off the pixels), and masks read (B200's varlen figures have another
# legend, without fa4); x axis 1K..32K
KERNEL_COLOURS = {(218, 136, 129): "fa4", (255, 191, 171): "cudnn", (237, 218, 168): "flex",
                  (150, 199, 168): "flash_mask", (83, 150, 159): "sdpa",
                  (66, 103, 129): "ffa_fa4"}
H100_KERNEL_COLOURS = {(187, 172, 209): "fa2", (199, 95, 133): "fa3", (255, 191, 171): "cudnn",
                       (237, 218, 168): "flex", (150, 199, 168): "flash_mask",
                       (83, 150, 159): "sdpa", (71, 126, 184): "ffa"}
KERNEL_RUNS = {"b200": (KERNEL_COLOURS, ("full", "causal")),
               "h100": (H100_KERNEL_COLOURS, ("full", "causal", "varlen_full", "varlen_causal"))}
KERNEL_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)


def _runs(mask) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate(list(mask) + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def _background(px) -> np.ndarray:
    return (np.ptp(px, axis=-1) < 8) & (px.min(axis=-1) > 190)


def _top(a, x: int, colour, probe: int) -> int:
    """The bar's top in column x: up from ``probe`` through lines of other colours (at most
    40 px of them), stopping at the background."""
    col = a[:probe + 1, x]
    match = np.all(np.abs(col - np.array(colour)) <= 6, axis=1)
    bg = _background(col)
    y, last, gap = probe, probe, 0
    while y > 0 and gap <= 40:
        y -= 1
        if match[y]:
            last, gap = y, 0
        elif bg[y]:
            break
        else:
            gap += 1
    return last


GLYPH = (32, 24)  # a digit's ink, scaled to this many rows x columns to be compared


def _ink(ink: np.ndarray) -> np.ndarray:
    """A glyph's ink cropped, scaled to GLYPH, zero-mean and unit-norm (a correlation's
    operand)."""
    rows, cols = np.where(ink.any(axis=1))[0], np.where(ink.any(axis=0))[0]
    crop = ink[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1].astype(np.uint8) * 255
    v = np.asarray(Image.fromarray(crop).resize(GLYPH[::-1], Image.BILINEAR), float)
    v -= v.mean()
    return v / (np.linalg.norm(v) or 1.0)


@cache
def _digits() -> dict[str, np.ndarray]:
    """Each digit drawn in DejaVu Sans, the font matplotlib drew the figures' labels in."""
    import matplotlib
    from PIL import ImageDraw, ImageFont

    font = ImageFont.truetype(os.path.join(matplotlib.get_data_path(), "fonts", "ttf",
                                           "DejaVuSans.ttf"), 200)
    out = {}
    for d in "0123456789":
        im = Image.new("L", (300, 300), 0)
        ImageDraw.Draw(im).text((20, 20), d, fill=255, font=font)
        out[d] = _ink(np.asarray(im) > 128)
    return out


def _label(band: np.ndarray) -> int:
    """The number printed rightmost in ``band`` (dark pixels, left of the plot): its glyphs,
    column runs closer than a glyph's width, each the digit it correlates with best."""
    def height(run):
        rows = np.where(band[:, run[0]:run[1]].any(axis=1))[0]
        return rows[-1] - rows[0] + 1

    # not a tick mark (matplotlib's default style): a dash, far wider than tall
    glyphs = [r for r in _runs(band.any(axis=0)) if height(r) >= 0.4 * (r[1] - r[0])]
    label = [glyphs[-1]]
    for g in reversed(glyphs[:-1]):
        if label[0][0] - g[1] >= label[-1][1] - label[-1][0]:
            break
        label.insert(0, g)
    digits = _digits()
    return int("".join(max(digits, key=lambda d: float((digits[d] * _ink(band[:, s:e])).sum()))
                       for s, e in label))


def gridlines(a) -> list[tuple[float, int]]:
    """(row, the value its label prints) of each gridline, the top one first; raises
    SystemExit where the labels are not 1, 2, 3, ... ticks."""
    x = int(a.shape[1] * 0.975)  # inside the plot, right of the last bar
    lines = [(s + e - 1) / 2 for s, e in _runs(np.all(a[:, x] == GRID, axis=1))]
    gap = lines[1] - lines[0]
    # the plot's left edge: where the gridlines start (runs of their grey, not the odd pixel
    # of a label's antialiased edge)
    left = min(r[0] for y in lines for r in _runs(np.all(a[int(y)] == GRID, axis=1))
               if r[1] - r[0] >= 20)
    dark = a.max(axis=-1) < 120
    values = [_label(dark[int(y - 0.3 * gap):int(y + 0.3 * gap), :left]) for y in lines]
    step = values[-1]  # the bars stand on 0, one step below the lowest gridline
    if step <= 0 or values != [step * (len(lines) - i) for i in range(len(lines))]:
        raise SystemExit(f"the y labels read {values}: not steps of one tick above 0")
    return list(zip(lines, values))


def _axis(a) -> tuple[float, float, int]:
    """(pixels a TFLOP/s, the axis' row, the tick): a least-squares line through the
    gridlines at the values their labels print."""
    rows, values = zip(*gridlines(a))
    slope, y0 = np.polyfit(values, rows, 1)
    return float(slope), float(y0), values[-1]


def resolution(path: Path) -> float:
    """TFLOP/s a pixel of the figure at ``path``: what one pixel of a bar's top is worth."""
    return 1 / abs(_axis(np.asarray(Image.open(path).convert("RGB")).astype(int))[0])


def bars(path: Path, colours: dict = COLOURS) -> list[tuple[str, float]]:
    """(legend name, TFLOP/s) of every bar, left to right. A top is read at most a pixel
    high and up to ~5 pixels low, where a series' line crosses it (tests/unit/
    test_validate_magiattention.py)."""
    a = np.asarray(Image.open(path).convert("RGB")).astype(int)
    slope, y0, tick = _axis(a)
    probe = int(round(y0 + slope * 0.03 * tick))  # 3 % of a tick up
    x = int(a.shape[1] * 0.975)
    while probe > 0 and not np.all(a[probe, x] == 255):  # clear of the axis' own line
        probe -= 1
    row, out, cur = a[probe], [], None
    for i in range(a.shape[1]):
        p = tuple(int(c) for c in row[i])
        if _background(np.array(p)):
            cur = None
            continue
        if cur is not None and max(abs(p[k] - cur[2][k]) for k in range(3)) <= 10:
            cur[1] = i + 1
            continue
        cur = [i, i + 1, p]
        out.append(cur)
    found = []
    for s, e, colour in (b for b in out if b[1] - b[0] > 80):
        tops = [_top(a, cx, colour, probe) for cx in range(s + (e - s) // 20, e - (e - s) // 20, 2)]
        ys, counts = np.unique(tops, return_counts=True)
        found.append((colours[colour], float((ys[np.argmax(counts)] - y0) / slope)))
    return found


def _loongtrain_window(ring: int) -> int:
    """exps/dist_attn/run_benchmark.py: window_num is the largest divisor i of the ring
    with i <= ring / i (1 where that is the ring); shard.get_loongtrain_pg: ranks per
    window = ring / window_num."""
    num = max(i for i in range(1, ring + 1) if ring % i == 0 and i <= ring // i)
    return ring // (1 if num >= ring else num)


def rows(root: Path, hw: str, packings: int = 0, max_gpus: int = 64, min_gpus: int = 8
         ) -> list[dict]:
    """The rows of ``hw``'s full and causal figures on min_gpus..max_gpus; ``packings`` > 0:
    of its varlen figures (packed documents), each row sampling that many packings."""
    tokens, kernel = RUNS[hw]
    out = []
    for mask in ("full", "causal"):
        folder = f"varlen_{mask}_mask" if packings else f"{mask}_mask"
        read = {ph: bars(root / hw / folder / ph / "flops_report.png")
                for ph in ("fwd", "bwd")}
        per = len(read["fwd"]) // 4
        for i, ((name, fwd), (name_b, bwd)) in enumerate(zip(read["fwd"], read["bwd"])):
            assert name == name_b, (name, name_b)
            cp = 8 << (i // per)
            if name not in IMPLS or not min_gpus <= cp <= max_gpus:
                continue
            seq = tokens * cp
            impl, strategy = IMPLS[name]
            label = folder[:-len("_mask")].replace("_", " ")  # "full", "varlen causal", ...
            options = ""
            if name == "ring_allgather":  # their dispatch zigzags each document (thd)
                options = "layout=zigzag-documents"
            if name == "loongtrain":
                options = f"ring_impl=double-ring;ring_window={_loongtrain_window(cp // 8)}"
            row = {
                "implementation": f"{impl}, {label}",
                "strategy": strategy, "options": options,
                "seqlen": seq, "nodes": cp // 8, "gpus_per_node": 8, "batch": 1, "heads": 64,
                "kv_heads": 8, "head_dim": 128, "dtype": "bf16",
                "causal": "true" if mask == "causal" else "false",
                **(_varlen(fwd, bwd) if packings else _dense(fwd, bwd, seq, cp, mask)),
                "printed_tflops": f"fwd {fwd:.1f}; bwd {bwd:.1f}", "score": "yes",
                "kernel": kernel,
                "source": f"MagiAttention cp_benchmark.md, {hw.upper()} {label} mask, "
                          f"distributed/{hw}/{folder}/{{fwd,bwd}}/flops_report.png (digitized)",
                "note": ""}
            if packings:
                row.update(documents=VARLEN_DOCUMENTS, packings=packings)
            out.append(row)
    return out


def _dense(fwd: float, bwd: float, seq: int, cp: int, mask: str) -> dict:
    """A full or causal row's times and FWD+BWD TFLOP/s from its two figures."""
    flops = 4 * 64 * 128 * seq * seq / (2 if mask == "causal" else 1)  # forward
    t_fwd, t_bwd = flops / (fwd * 1e12 * cp), 2.5 * flops / (bwd * 1e12 * cp)
    return {"fwd_ms": f"{1e3 * t_fwd:.3f}", "fwd_bwd_ms": f"{1e3 * (t_fwd + t_bwd):.3f}",
            "memory_mb": "", "tflops": f"{3.5 * flops / (t_fwd + t_bwd) / cp / 1e12:.1f}"}


# MagiAttention's varlen runs (exps/dist_attn/benchmark_conf.py SAMPLE_CONFIG, benchmark/
# utils.py DatasetSampler): its own length trace read as bin midpoints, documents over a
# quarter of the sequence split into quarter-long pieces, the pieces of the whole trace
# shuffled and packed; 20 packs, each phase's TFLOP/s (the real mask area's FLOPs) averaged
# over them. cpbench takes the same packs, seeds 0-19 (cpbench.mask.TRACE_OPTIONS, packs).
VARLEN_DOCUMENTS = "trace:magiattention,packs"


def _varlen(fwd: float, bwd: float) -> dict:
    """A varlen row: no times (each packing has its own mask area), the FWD+BWD figure
    joined from the two phases' averages as a dense row's is (the same FLOPs weights)."""
    return {"fwd_ms": "", "fwd_bwd_ms": "", "memory_mb": "",
            "tflops": f"{fwd_bwd_rate(fwd, bwd):.1f}"}


def kernel_curves(root: Path, legend: str) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(mask, phase) -> [(seqlen, TFLOP/s)] of ``legend``'s bars in the kernel-level figures
    under ``root`` (assets/magi_attn/exp/kernel/b200 or .../h100: its name picks the legend)."""
    colours, masks = KERNEL_RUNS[root.name]
    out = {}
    for mask in masks:
        for phase in ("fwd", "bwd"):
            path = root / f"{mask}_mask" / phase / "flops_report.png"
            read = [v for name, v in bars(path, colours) if name == legend]
            if len(read) != len(KERNEL_LENGTHS):  # a length without its bar (an X)
                raise SystemExit(f"{path}: {len(read)} {legend} bars, not one a length")
            out[(mask, phase)] = list(zip(KERNEL_LENGTHS, read))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("figures", type=Path, help="assets/magi_attn/exp/distributed of a checkout "
                   "(with --kernel: assets/magi_attn/exp/kernel/b200 or h100)")
    p.add_argument("h100_csv", type=Path, nargs="?")
    p.add_argument("b200_csv", type=Path, nargs="?")
    p.add_argument("--kernel", metavar="LEGEND", choices=sorted(
                   {n for colours, _ in KERNEL_RUNS.values() for n in colours.values()}),
                   help="print this legend's kernel-level bars (B200: cudnn, fa4, ...; "
                        "H100: fa3, fa2, cudnn, ...)")
    p.add_argument("--varlen", metavar="K", type=int, default=0,
                   help="read the varlen (packed documents) figures instead, each row to be "
                        "simulated over K packings")
    p.add_argument("--max-gpus", type=int, default=64, help="only the runs on up to this "
                   "many GPUs")
    p.add_argument("--min-gpus", type=int, default=8, help="only the runs on at least this "
                   "many GPUs")
    args = p.parse_args(argv)
    if args.kernel:
        run = KERNEL_RUNS.get(args.figures.name)
        if run is None or args.kernel not in run[0].values():
            legends = "one of " + ", ".join(run[0].values()) if run else "give kernel/b200 or h100"
            print(f"{args.figures.name}: no {args.kernel} bars ({legends})", file=sys.stderr)
            return 2
        for (mask, phase), points in kernel_curves(args.figures, args.kernel).items():
            px = resolution(args.figures / f"{mask}_mask" / phase / "flops_report.png")
            print(f"{mask} {phase}: " + ", ".join(f"{n} {v:.1f}" for n, v in points)
                  + f" ({px:.2f} TFLOP/s a pixel)")
        return 0
    if args.b200_csv is None:
        p.error("give the two CSVs to write, or --kernel LEGEND")
    for hw, path in (("h100", args.h100_csv), ("b200", args.b200_csv)):
        table = rows(args.figures, hw, args.varlen, args.max_gpus, args.min_gpus)
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(table)
        print(f"{path}: {len(table)} rows", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
