"""What a step passes over around its kernel call and what ranks on one CPU share, as the
simulator prices it (``cpbench.sim.model``, point 6 of its docstring): the memory passes
around each kernel call (every preset: measured per element on a CPU, bytes per element over
HBM on a GPU), and a node's cores and caches left to the ranks still computing (CPU presets
only; on GPUs ``idle_speedup`` is 1 and this adds nothing)."""

from __future__ import annotations

from cpbench.config import AttentionConfig
from cpbench.sim.hardware import GB, Hardware
from cpbench.strategies.base import FWD, Strategy


def elements(strat: Strategy, attn: AttentionConfig, block) -> dict[str, float]:
    """A kernel call's query and key elements (rows x its heads x head dim), each on its own
    width: Q and K on ``head_dim``, out and V on V's (MLA: 192 and 128): what its merge (out)
    and its gradient sums (dq, dk, dv) pass over."""
    if not block:
        return {}
    rows = attn.batch * strat.kernel_head_share() * block[0] * attn.heads
    keys = attn.batch * strat.kernel_head_share() * block[1] * attn.num_kv_heads
    return {"q_elements": rows * attn.head_dim, "out_elements": rows * attn.dv,
            "kv_elements": keys * attn.head_dim, "v_elements": keys * attn.dv}


def passes_s(hw: Hardware, phase: str, q: float, kv: float, out: float | None = None,
             v: float | None = None) -> float:
    """The step's memory passes around its kernel: the forward merges the block into the
    rows' (out, lse); the backward adds its dq, dk and dv into the partial sums. ``out``
    and ``v``: those on V's width (None: as wide as ``q`` and ``kv``)."""
    out = q if out is None else out
    v = kv if v is None else v
    if phase == FWD:
        return hw.merge.seconds(out)
    return hw.accumulate.seconds(q) + hw.accumulate.seconds(kv) + hw.accumulate.seconds(v)


def copies_s(hw: Hardware, nbytes: float) -> float:
    """A step's layout copies around its messages (``RankStep.copied``: bytes read and
    written), over HBM at its datasheet rate: a lower bound (a copy kernel reaches less).
    CPU presets measured no copy: nothing."""
    return nbytes / (hw.memory_bandwidth_gbs * GB) if nbytes and hw.memory_bandwidth_gbs else 0.0


def sinks_s(hw: Hardware, phase: str, attn: AttentionConfig, ranks: int) -> float:
    """The attention sinks' own passes on a rank (every strategy adds the sink once per
    query, after its last merge): the forward rescales the rank's output rows by
    exp(lse - lse'), a merge-like pass; the backward's dsink sums exp(s - lse') · rowsum(dout
    · out) over them, an accumulate-like pass. A rank holds 1 / ``ranks`` of the problem's
    query rows × heads (by sequence or by heads). The (heads,) gradient's sum over ranks
    rides the data-parallel gradient reduction, not the attention step."""
    if not attn.sinks:
        return 0.0
    rows = attn.batch * attn.seqlen * attn.heads * attn.dv / ranks
    return hw.merge.seconds(rows) if phase == FWD else hw.accumulate.seconds(rows)


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
