"""Predict a strategy's FWD / FWD+BWD time and peak memory per GPU on a cluster it never ran on.

Nothing here knows a strategy by name. Each rank's work and traffic come from the schedule
the strategy itself declares (``Strategy.schedule()``: per step, the kernel block it computes
and the bytes it sends over which group), which the multi-rank tests hold equal to the bytes
the code really sends and whose FLOPs sum to the one FLOP formula. The machine comes from a
hardware preset (``cpbench.sim.hardware``). Modelling assumptions, and where they come from:

1. Lock-step. Ring neighbours exchange every step and collectives synchronise their group,
   so a step lasts as long as its slowest rank; a phase is the sum of its steps. (Ring
   attention papers and ring-flash-attention's per-step ``wait()``.) The causal imbalance of
   ``ring`` shows up here: its last rank computes a full block at every step. Steps that
   wait for no other rank (``Step.joins`` False: llama3's kernels after a gather) follow
   the step before at each rank's own pace: such a run lasts its slowest rank's sum.
2. A rank's step costs ``max(compute, overlapped communication) + exposed communication``.
   Messages the schedule marks overlapped (the next K/V block, a partial dK/dV sum moving on)
   are in flight while the kernel runs; exposed ones (all-to-alls, the last backward hop)
   wait for or are waited on by the compute. (The strategies' own code: ``commit`` before
   the kernel, ``wait`` after.)
3. Compute: each kernel step costs its FLOPs at the kernel's rate for its block side
   sqrt(seqlen_q · seqlen_k) and head dim (the preset's curve: on GPUs the published
   figures of the kernel benchmarked alone, ``sim.curves``), forward and backward curves
   separately, times the kernel's rate inside a CP run over its rate alone
   (``kernel_in_cp``: NCCL's kernels run beside it; 1 where not measured); then the step's
   own costs, each a named term of the preset: a fixed per-step cost (launches, the small
   kernels around the call, posting the p2p batch) and the memory passes of point 6.
   Heads and batch only scale the FLOPs (FlashAttention parallelises over them; at the
   block sizes CP runs, >= 1k tokens, the grid fills the GPU); so do K/V heads not (GQA:
   every query head attends, FlashAttention reads its group's K/V; the FLOPs and, within
   2 % in published A100 runs of 32 and 8 K/V heads, the rate are those of MHA), while the
   bytes a schedule moves for K and V scale with the K/V heads. A causal (diagonal) block
   is priced on the preset's causal curves where it has them (the published causal rate,
   FLOPs counted as half the square's: the causal penalty once, nowhere else).
4. Links: a message inside a node moves at the intra-node link rate (NVSwitch: every GPU has
   its own full-rate port). A message crossing nodes takes the longer of its bytes over the
   GPU's own share of the network (one NIC) and its node's inter-node bytes of that step
   (every GPU of the node that sends across then) over the node's NIC total: the NICs are
   shared. Concurrent messages of a rank on different groups share these links (their bytes
   add); a step pays each link's latency once (inside / across nodes, overlapped / exposed).
   A ring hop counts as inter-node for a rank when either neighbour is on another node (it
   sends to one, receives from the other); an all-to-all sends n-1 equal parts, those to
   members on other nodes cross.
5. Overlap windows: a message awaited ``overlap_steps`` steps after it is posted (a double
   ring's outer hop has a whole inner window) is spread evenly over the kernels it overlaps:
   its own step's and the next ones, or only the next ones when it is posted after its
   step's kernel (``after_compute``: a partial sum moving on).
6. What a step passes over in memory around its kernel call: the forward's log-sum-exp
   merge of the block into the rank's fp32 (out, lse) rows, the backward's dq, dk, dv sums,
   priced per element (``merge``, ``accumulate``; ``sim.sharing``): on CPUs measured by
   ``cpbench calibrate``, on GPUs bytes per element over the HBM bandwidth (measured on A800
   in seed 000's profile). A strategy that returns its one kernel call's result as it is
   (``Strategy.merges``: Ulysses) pays neither. An all-to-all's own layout copies (the send
   buffer laid chunk-major, the received chunks side by side: ``Message.copied``) are
   priced the same way, bytes over HBM (``sim.terms``, ``layout copies``). What ranks on
   one CPU share besides (only presets ``cpbench calibrate`` measured on a CPU carry these):
   - an overlapped message does not hide: the transport's thread needs the core the kernel
     holds. It adds ``overlapped`` times its time alone on the link (measured: the same
     exchange posted before a kernel and awaited after it, against its time alone);
   - a rank waiting in a collective leaves the node's shared caches and memory bandwidth to
     those still computing: processor sharing within a step, ``idle_speedup`` with one rank
     busy, linear down to 1 with all busy (measured: a kernel alone against all at once;
     about 1.0 on this 2-core VM while its two vCPUs sit on separate cores, 1.6-1.9 while
     the host puts them on one core's hyperthreads, which the self-check's probes detect).
7. Memory per rank (``sim.memory``): inputs, the strategy's accumulators, the buffers of
   the messages in flight at each step, two kernel calls' results, what it keeps beyond a
   step, at the worst moment of either phase; held within 10 % of the real code's
   allocations (the dry run) for every own strategy and variant by a test. OOM when over
   the preset's memory. FlashAttention-2's backward buffers are counted; other kernel
   workspaces and allocator fragmentation are not.

Everything scales exactly with the sequence length and batch (bytes with S·B, FLOPs with
S²·B; an all-to-all's layout copies with B from 2 on: a batch over 1 compiles at 2), and
bf16 and fp16 move the same bytes, so a schedule is built once per (strategy, options,
heads, head dim, element size, topology) and re-scaled: 1,500 configurations up to 64 GPUs
take about 2 s; the first build of one strategy on 128 GPUs about half a second.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from cpbench import ideal as ideal_def
from cpbench.config import AttentionConfig
from cpbench.errors import UsageError
from cpbench.launch import torch_threads
from cpbench.mask import mask_of
from cpbench.metrics import attention_flops
from cpbench.sim import sharing, terms
from cpbench.sim.hardware import Hardware

# the schedule's types and builders, named here too: callers read them as the model's
from cpbench.sim.schedule import Compiled, RankStep, StepLoad, build, compile_schedule  # noqa: F401
from cpbench.strategies.base import BWD, FWD
from cpbench.topology import Topology

GIB = 2 ** 30


@dataclass(frozen=True)
class Prediction:
    fwd_s: float
    bwd_s: float
    fwd_compute_s: float  # the slowest rank's kernel time, summed over forward steps
    bwd_compute_s: float
    memory_bytes: float
    capacity_bytes: float
    ranks_per_problem: int
    resolved: dict
    # (term, FWD s, BWD s) of the slowest rank of each step, summed (``sim.terms``): they
    # add up to fwd_s and bwd_s
    terms: tuple[tuple[str, float, float], ...] = ()

    @property
    def fwd_bwd_s(self) -> float:
        return self.fwd_s + self.bwd_s

    @property
    def oom(self) -> bool:
        return self.memory_bytes > self.capacity_bytes


@lru_cache(maxsize=4096)
def _compiled(name: str, options, attn: AttentionConfig, world: int, rpn: int) -> Compiled:
    # a schedule indexes a few thousand positions at a time (integers: exact on any number
    # of threads): a parallel region's threads would only wait for each other, or for a core
    with torch_threads(1):
        return compile_schedule(name, options, attn,
                                Topology(world_size=world, ranks_per_node=rpn))


_REFERENCE: dict[tuple, AttentionConfig] = {}  # shape → the problem compiled for it
_BY_SIZE = {2: "bf16", 4: "fp32"}


def compiled_for(name: str, options, attn: AttentionConfig, topo: Topology) -> Compiled:
    """The compiled schedule of this shape and topology, built once at a small sequence
    length the strategy accepts and batch 1, or 2 for any larger batch (an all-to-all's
    layout copies differ between batch 1 and more: ``comm.a2a_copied_bytes``), and
    re-scaled (exact: see the module docstring)."""
    build(name, options, attn, topo)  # this seqlen's own validation
    if not mask_of(attn).plain:
        # a mask's area does not scale as S² (documents, windows): compiled at its own size
        return _compiled(name, options, attn, topo.world_size, topo.ranks_per_node)
    # bf16 and fp16 schedules are the same bytes: one compile serves both
    shape = dataclasses.replace(attn, seqlen=1, batch=min(attn.batch, 2),
                                dtype=_BY_SIZE[attn.element_size])
    key = (name, options, shape, topo.world_size, topo.ranks_per_node)
    if key not in _REFERENCE:
        _REFERENCE[key] = dataclasses.replace(
            shape, seqlen=_small_seqlen(name, options, attn, topo))
    return _compiled(name, options, _REFERENCE[key], topo.world_size, topo.ranks_per_node)


def _small_seqlen(name: str, options, attn: AttentionConfig, topo: Topology) -> int:
    """``attn.seqlen`` halved while the strategy still accepts it (building a schedule walks
    every rank's token indices: cheap at this size, whatever size is asked for), keeping 2
    tokens a rank: at 1, an all-to-all's send buffer would be a view and its copy vanish
    (``comm.a2a_copied_bytes``), which no real size has."""
    seqlen = attn.seqlen
    while seqlen % 2 == 0 and seqlen // 2 >= 2 * topo.world_size:
        try:
            build(name, options, dataclasses.replace(attn, seqlen=seqlen // 2), topo)
        except UsageError:
            break
        seqlen //= 2
    return seqlen


def predict(name: str, options, attn: AttentionConfig, topo: Topology, hw: Hardware
            ) -> Prediction:
    """The predicted step times and memory of ``name`` on ``topo`` with ``hw``; ValueError
    when the strategy cannot run this configuration."""
    if attn.dtype not in hw.dtypes:
        gpu = hw.name.split(" (")[0]  # the name without its network, to fit 120 columns
        raise UsageError(f"the {gpu} preset models {'/'.join(hw.dtypes)} attention kernels; "
                         f"simulate with --dtype {hw.dtypes[0]}")
    return evaluate(compiled_for(name, options, attn, topo), attn, hw)


def memory_estimate(name: str, options, attn: AttentionConfig, topo: Topology, *,
                    kernel_buffers: bool = True) -> float:
    """The memory model's peak bytes of a rank (any hardware: memory needs no speeds);
    ``kernel_buffers``: with the GPU kernel's own backward buffers (``sim.memory``)."""
    c = compiled_for(name, options, attn, topo)
    peak = c.memory_bytes if kernel_buffers else c.memory_bytes_bare
    return peak * (attn.batch / c.batch) * (attn.seqlen / c.seqlen)


def evaluate(c: Compiled, attn: AttentionConfig, hw: Hardware) -> Prediction:
    """The prediction for ``attn`` from a schedule compiled at another seqlen and batch (or
    the same): bytes scale with S·B, FLOPs with S²·B, block sides with S. Each step's cost
    and its terms: ``sim.terms``."""
    linear = (attn.batch / c.batch) * (attn.seqlen / c.seqlen)
    scale = terms.Scale(linear=linear, square=linear * (attn.seqlen / c.seqlen),
                        length=attn.seqlen / c.seqlen,
                        share_side=ideal_def.share(attn, c.ranks_per_problem)[0])
    total = {FWD: 0.0, BWD: 0.0}
    compute_total = {FWD: 0.0, BWD: 0.0}
    by_term = {phase: dict.fromkeys(terms.TERMS, 0.0) for phase in (FWD, BWD)}
    for run in terms.runs(c.steps):
        worst, compute, parts = terms.run(hw, run, attn.head_dim, scale)
        phase = run[0].phase
        total[phase] += worst
        # the slowest rank's kernel time as the step runs it (shared, where a CPU shares)
        compute_total[phase] += compute
        for key, value in parts.items():
            by_term[phase][key] += value
    for phase in total:  # the sinks, once per query after the last merge (a small pass)
        sink = sharing.sinks_s(hw, phase, attn, c.ranks_per_problem)
        total[phase] += sink
        by_term[phase]["merge / rescale"] += sink
    # FlashAttention-2's backward buffers: its kernels run bf16 / fp16 only (fp32 runs on the
    # CPU's kernels, which hold none)
    memory = (c.memory_bytes if attn.element_size == 2 else c.memory_bytes_bare) * linear
    return Prediction(fwd_s=total[FWD], bwd_s=total[BWD], fwd_compute_s=compute_total[FWD],
                      bwd_compute_s=compute_total[BWD], memory_bytes=memory,
                      capacity_bytes=hw.memory_gib * GIB,
                      ranks_per_problem=c.ranks_per_problem, resolved=c.resolved,
                      terms=tuple((k, by_term[FWD][k], by_term[BWD][k]) for k in terms.TERMS))


def ideal(attn: AttentionConfig, ranks: int, hw: Hardware) -> tuple[float, float]:
    """(FWD s, BWD s) of one ideal block (``bench.ideal``, the one definition: the kernel
    alone on one GPU's share, S / ranks tokens, every head, the batch, causal as the
    problem; ``bench.ideal.section`` counts it ``ranks`` times) on the preset's curve, with
    no communication, merge, step cost or CP-run slowdown (``kernel_in_cp``)."""
    local, _ = ideal_def.share(attn, ranks)
    out = []
    for phase in (FWD, BWD):  # each phase on its own widths (MLA: PV on V's)
        flops = attention_flops(batch=attn.batch, seqlen_q=local, seqlen_k=local,
                                heads=attn.heads, head_dim=attn.head_dim, causal=attn.causal,
                                mode=phase, v_head_dim=attn.v_head_dim)
        rate = hw.kernel(phase, attn.causal, attn.head_dim).tflops(local)
        out.append(flops / (rate * 1e12))
    return out[0], out[1]


def clear_cache() -> None:
    """Forget every compiled schedule (e.g. to time a cold start)."""
    _compiled.cache_clear()
    _REFERENCE.clear()
