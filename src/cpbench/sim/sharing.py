"""What a step passes over around its kernel call and what ranks on one CPU share, as the
simulator prices it (``cpbench.sim.model``, point 6 of its docstring): the memory passes
around each kernel call (every preset: measured per element on a CPU, bytes per element over
HBM on a GPU), and a node's cores and caches left to the ranks still computing (CPU presets
only; on GPUs ``idle_speedup`` is 1 and this adds nothing)."""

from __future__ import annotations

from cpbench.config import AttentionConfig
from cpbench.sim.hardware import Hardware
from cpbench.strategies.base import FWD, Strategy


def elements(strat: Strategy, attn: AttentionConfig, block) -> dict[str, float]:
    """A kernel call's query and key elements (rows x its heads x head dim): what its merge
    and its gradient sums pass over."""
    if not block:
        return {}
    per_row = attn.batch * attn.head_dim * strat.kernel_head_share()
    return {"q_elements": block[0] * attn.heads * per_row,
            "kv_elements": block[1] * attn.num_kv_heads * per_row}


def passes_s(hw: Hardware, phase: str, q: float, kv: float) -> float:
    """The step's memory passes around its kernel: the forward merges the block into the
    rows' (out, lse); the backward adds its dq, dk and dv into the partial sums."""
    if phase == FWD:
        return hw.merge.seconds(q)
    return hw.accumulate.seconds(q) + 2 * hw.accumulate.seconds(kv)


def shared_compute(computes: list[float], nodes, speedup: float) -> list[float]:
    """Each view's kernel time when the ranks of a node that finish first leave it to the
    others: processor sharing, ``speedup`` with one rank busy, linear down to 1 with all of
    them; the slowest node pattern a view occurs in counts. ``computes`` are all-busy times."""
    if speedup == 1 or not nodes:
        return computes
    finish = [0.0] * len(computes)
    for counts in nodes:
        n = sum(counts)
        members = sorted((computes[i], i) for i, k in enumerate(counts) if k)
        t = done = 0.0
        busy = n
        for work, i in members:
            rate = 1 + (speedup - 1) * (n - busy) / max(n - 1, 1)
            t += (work - done) / rate
            done = work
            finish[i] = max(finish[i], t)
            busy -= counts[i]
    return finish
