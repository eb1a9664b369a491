#!/usr/bin/env python3
"""How the simulator prices one varlen call, judged on MagiAttention's published H100
kernel-level FA3 bars (one GPU, batch 1, GQA 64:8, head dim 128, bf16; packed documents as
its sampler draws them: cpbench's ``trace:magiattention,split,midpoint``).

    git clone https://github.com/SandAI-org/MagiAttention   # read at 2c641357
    python scripts/varlen_kernel_check.py MagiAttention/assets/magi_attn/exp/kernel/h100

For each total length (1K-32K), mask and phase it prints the relative error against the
published "varlen" bar of two rules: the whole packed sequence as one block on the curve
(``block``, the simulator's rule before 2026-11-28) and each tile of the varlen call at its
own side in FA3's whole tiles (``tiles``: ``masked_varlen.spectrum`` rounded by the
preset's ``tiles:``, the forward packing GQA's 8 query heads: the rule now), each on two
curves: the h100-sxm preset's FA3 curve (the FA3 paper's figures) and MagiAttention's own
dense FA3 bars
of the same figures' run (``full_mask`` / ``causal_mask``). Rates are the mean over 20
packings of each packing's TFLOP/s, as the bars are (theirs over 3 packs).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch
from digitize_magiattention import kernel_curves

from cpbench.config import packed_problems, parse_documents
from cpbench.kernels import masked_varlen
from cpbench.mask import mask_of
from cpbench.sim import hardware
from cpbench.sim.curves import KernelCurve, piece_rate

DOCUMENTS = "trace:magiattention,split,midpoint"
GQA = 64 // 8  # query heads a K/V head: what FA3's varlen forward packs into a tile


def spectra(length: int, causal: bool, packings: int) -> list[tuple]:
    attn = dict(batch=1, seqlen=length, heads=64, kv_heads=8, head_dim=128, dtype="bf16",
                causal=causal, documents=parse_documents(DOCUMENTS))
    every = torch.arange(length)
    return [masked_varlen.spectrum(masked_varlen.plan(mask_of(a), every, every))
            for a in packed_problems(attn, 0, packings)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("figures", type=Path, help="assets/magi_attn/exp/kernel/h100 of a checkout")
    p.add_argument("--packings", type=int, default=20)
    args = p.parse_args(argv)
    bars = kernel_curves(args.figures, "fa3")
    dense = {key: KernelCurve(tuple((float(n), v) for n, v in pts))
             for key, pts in bars.items() if not key[0].startswith("varlen")}
    fa3 = hardware.load("h100-sxm", kernel="fa3")
    curves = {"preset": lambda ph, c: fa3.kernel(ph, c, 128),
              "magi": lambda ph, c: dense[("causal" if c else "full", ph)]}
    print("error against the published varlen bar: block rule / tiles rule, on each curve")
    for mask in ("full", "causal"):
        for (length, fwd), (_, bwd) in zip(bars[(f"varlen_{mask}", "fwd")],
                                           bars[(f"varlen_{mask}", "bwd")]):
            spec = spectra(length, mask == "causal", args.packings)
            cells = []
            for phase, pub in (("fwd", fwd), ("bwd", bwd)):
                for name, curve in curves.items():
                    block = curve(phase, False).tflops(length)
                    tiles = statistics.fmean(
                        piece_rate(s, functools.partial(curve, phase),
                                   fa3.tiles[phase == "bwd"], GQA, phase=phase) for s in spec)
                    cells.append(f"{phase} {name} {block / pub - 1:+5.0%} / "
                                 f"{tiles / pub - 1:+5.0%}")
            print(f"varlen {mask:6} {length:6}: " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
