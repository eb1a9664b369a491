"""The ideal block timed alone, for the "fraction of ideal" (its one definition:
``cpbench.ideal``): on rank 0, with the case's kernel, device and dtype, while the other
ranks wait, so nothing shares its device or CPUs.
"""

from __future__ import annotations

import math
import statistics

import torch

from cpbench import kernels
from cpbench.bench.timer import Timer
from cpbench.config import AttentionConfig, RunConfig
from cpbench.ideal import none_reason, section, share

# the other ranks wait in a collective while rank 0 times: its timeout is ten pessimistic
# steps (bench.plan.case_waits), hundreds of real ones; the block timed this many times stays
# well inside it whatever --iters asks
MAX_WARMUP, MAX_ITERS = 3, 20


def _time_block(kernel: str, attn: AttentionConfig, tokens: int, device: str, *,
                warmup: int, iters: int) -> tuple[float, float]:
    """(forward ms, backward ms) of one block alone: medians of ``iters`` calls each."""
    backend = kernels.get(kernel)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(name):
        return torch.randn(attn.batch, tokens, *attn.widths[name], generator=gen,
                           device=device, dtype=attn.torch_dtype)

    q, k, v, dout = (rand(name) for name in ("q", "k", "v", "dout"))
    scale = attn.softmax_scale or 1.0 / math.sqrt(attn.head_dim)
    causal = attn.causal
    out, lse = backend.forward(q, k, v, causal=causal, softmax_scale=scale)
    tm = Timer(device)
    fwd = tm.measure(lambda: backend.forward(q, k, v, causal=causal, softmax_scale=scale),
                     warmup=warmup, iters=iters)
    bwd = tm.measure(lambda: backend.backward(dout, q, k, v, out, lse, causal=causal,
                                              softmax_scale=scale), warmup=warmup, iters=iters)
    return statistics.median(fwd), statistics.median(bwd)


def measure(attn: AttentionConfig, ranks: int, kernel: str, run: RunConfig) -> dict:
    """The record's ``ideal`` section: the block of each rank's share timed alone on
    ``run``'s device (warmed up and timed as it asks, within ``MAX_WARMUP`` and
    ``MAX_ITERS``), its times ``ranks`` times over; or ``{"none": why}``."""
    why = none_reason(attn)
    if why:
        return {"none": why}
    assert run.warmup is not None and run.iters is not None, "a resolved RunConfig"
    tokens, _ = share(attn, ranks)
    fwd, bwd = _time_block(kernel, attn, tokens, run.device,
                           warmup=min(max(1, run.warmup), MAX_WARMUP),
                           iters=min(max(1, run.iters), MAX_ITERS))
    return section(attn, ranks, fwd, None if run.fwd_only else bwd)
