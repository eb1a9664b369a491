"""The ideal step of a case: its kernel blocks alone, for the "fraction of ideal".

As ring-flash-attn's README computes its 90.2 % / 75.9 %: every kernel call a rank makes in
a step (``Strategy.schedule()``: each step's ``block``, rows × keys, causal, on the heads its
FLOPs say) is timed alone, with the same kernel on the same device and the same inputs'
dtype, once per distinct shape; a rank's ideal is the sum over its steps. The slowest rank
by that sum sets the ideal step (no communication, no merge, no layout: what CP cannot beat
on this kernel); ``results.derive`` divides it by the measured step.

Not for what the kernel alone cannot stand for: a masked problem (documents, windows: a
block's work is its mask's, not its shape's) or a strategy that declares no schedule (the
upstream adapters). The section then says why.
"""

from __future__ import annotations

import math
import statistics

import torch

from cpbench import kernels, strategies
from cpbench.bench.timer import Timer
from cpbench.config import AttentionConfig
from cpbench.errors import UsageError
from cpbench.topology import Topology

Shape = tuple[int, int, bool, int]  # rows, keys, causal, query heads
# the other ranks wait in a collective while rank 0 times: its timeout is ten pessimistic
# steps (bench.plan.case_waits), hundreds of real ones; a step's distinct blocks timed this
# many times each stay well inside it whatever --iters asks
MAX_WARMUP, MAX_ITERS = 3, 20


def rank_blocks(name: str, options, attn: AttentionConfig, topo: Topology, kernel: str
                ) -> list[list[tuple[str, Shape]]] | str:
    """Per rank, its steps' (phase, shape); or why there is no ideal."""
    if attn.documents or attn.window_size not in (None, (-1, -1)):
        return "a masked problem: a block's work is its mask's, not its shape's"
    cls = strategies.get(name)
    per_rank = []
    for rank in range(topo.world_size):
        strat = cls(attn, topo, rank, kernel=kernels.get(kernel), options=options,
                    create_groups=False)
        try:
            steps = strat.schedule()
        except UsageError:
            return f"{name} declares no schedule"
        blocks = []
        for s in steps:
            if s.block is None:
                continue
            rows, keys, causal = s.block
            dense = strat.block_flops(rows, keys, causal, s.phase)
            heads = max(1, round(attn.heads * s.flops / dense)) if dense else attn.heads
            blocks.append((s.phase, (rows, keys, causal, heads)))
        per_rank.append(blocks)
    return per_rank


def _time_block(kernel: str, attn: AttentionConfig, shape: Shape, device: str, *,
                warmup: int, iters: int) -> tuple[float, float]:
    """(forward ms, backward ms) of one block alone: medians of ``iters`` calls each."""
    rows, keys, causal, heads = shape
    kv_heads = max(1, attn.num_kv_heads * heads // attn.heads)
    backend = kernels.get(kernel)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(s, h):
        return torch.randn(attn.batch, s, h, attn.head_dim, generator=gen, device=device,
                           dtype=attn.torch_dtype)

    q, k, v, dout = rand(rows, heads), rand(keys, kv_heads), rand(keys, kv_heads), \
        rand(rows, heads)
    scale = attn.softmax_scale or 1.0 / math.sqrt(attn.head_dim)
    out, lse = backend.forward(q, k, v, causal=causal, softmax_scale=scale)
    tm = Timer(device)
    fwd = tm.measure(lambda: backend.forward(q, k, v, causal=causal, softmax_scale=scale),
                     warmup=warmup, iters=iters)
    bwd = tm.measure(lambda: backend.backward(dout, q, k, v, out, lse, causal=causal,
                                              softmax_scale=scale), warmup=warmup, iters=iters)
    return statistics.median(fwd), statistics.median(bwd)


def measure(name: str, options, attn: AttentionConfig, topo: Topology, kernel: str, *,
            device: str, warmup: int, iters: int, fwd_only: bool) -> dict:
    """The record's ``ideal`` section: the slowest rank by its blocks, its ideal FWD and
    BWD in ms, each distinct block's times; or ``{"none": why}``."""
    per_rank = rank_blocks(name, options, attn, topo, kernel)
    if isinstance(per_rank, str):
        return {"none": per_rank}
    timed: dict[Shape, tuple[float, float]] = {}
    for blocks in per_rank:
        for _, shape in blocks:
            if shape not in timed:
                timed[shape] = _time_block(kernel, attn, shape, device,
                                           warmup=min(max(1, warmup), MAX_WARMUP),
                                           iters=min(max(1, iters), MAX_ITERS))
    sums = [{"fwd": sum(timed[s][0] for p, s in blocks if p == "fwd"),
             "bwd": sum(timed[s][1] for p, s in blocks if p == "bwd")} for blocks in per_rank]
    rank = max(range(len(sums)), key=lambda r: sums[r]["fwd"] + (0 if fwd_only else
                                                                  sums[r]["bwd"]))
    return {"rank": rank, "fwd_ms": sums[rank]["fwd"],
            "bwd_ms": None if fwd_only else sums[rank]["bwd"],
            "blocks": [{"rows": s[0], "keys": s[1], "causal": s[2], "heads": s[3],
                        "fwd_ms": f, "bwd_ms": b} for s, (f, b) in timed.items()]}
