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
   (``Strategy.merges``: Ulysses) pays neither. What ranks on one CPU share besides (only
   presets ``cpbench calibrate`` measured on a CPU carry these):
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
S²·B), and bf16 and fp16 move the same bytes, so a schedule is built once per (strategy,
options, heads, head dim, element size, topology) and re-scaled: 1,500 configurations up to
64 GPUs take about 2 s; the first build of one strategy on 128 GPUs about half a second.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from cpbench import ideal as ideal_def
from cpbench import kernels, strategies
from cpbench.config import AttentionConfig
from cpbench.errors import Skipped, UsageError
from cpbench.mask import mask_of
from cpbench.metrics import attention_flops
from cpbench.sim import memory, sharing, terms
from cpbench.sim.hardware import Hardware
from cpbench.strategies.base import BWD, FWD, Strategy
from cpbench.topology import Topology

GIB = 2 ** 30


@dataclass(frozen=True)
class RankStep:
    """One rank's step at the compiled size: kernel FLOPs and block side, the bytes it moves
    inside / across nodes, overlapped or exposed, and what its node sends across in all
    (the NICs it shares)."""

    flops: float
    side: float
    intra_ov: float = 0.0
    inter_ov: float = 0.0
    intra_exp: float = 0.0
    inter_exp: float = 0.0
    node_ov: float = 0.0
    node_exp: float = 0.0
    causal: bool = False  # a diagonal block: priced on the preset's causal curve if it has one
    q_elements: float = 0.0  # the kernel call's query rows x heads x head dim (dq sum)
    kv_elements: float = 0.0  # its key rows x kv heads x head dim (dk sum)
    out_elements: float = 0.0  # its rows x heads x V's head dim (its merge)
    v_elements: float = 0.0  # its key rows x kv heads x V's head dim (dv sum)


@dataclass(frozen=True)
class StepLoad:
    """Every distinct rank view of one step, and how many ranks of each node share it (one
    tuple per distinct node, counts parallel to ``ranks``)."""

    phase: str
    ranks: tuple[RankStep, ...]
    nodes: tuple[tuple[int, ...], ...] = ()
    joins: bool = True  # ``Step.joins``: False, it waits for no other rank before it starts
    # each rank's view (an index into ``ranks``), ranks in the same order at every step:
    # what follows a rank through a run of steps that do not join
    who: tuple[int, ...] = ()


@dataclass(frozen=True)
class Compiled:
    seqlen: int
    batch: int
    steps: tuple[StepLoad, ...]
    memory_bytes: float  # a rank's peak: resident tensors, held blocks, worst step's buffers
    ranks_per_problem: int
    resolved: dict
    # the same without the GPU kernel's own backward buffers (a CPU kernel has none)
    memory_bytes_bare: float


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


_KERNEL = kernels.get("torch")  # schedules never call the kernel; constructors want one


def build(name: str, options, attn: AttentionConfig, topo: Topology, rank: int = 0) -> Strategy:
    """``rank``'s strategy with planned groups (no processes); ValueError if it cannot run."""
    cls = strategies.get(name)
    if cls.causal_only and not attn.causal:
        raise UsageError(f"{name} only runs causal attention")
    why = cls.unsupported_mask(mask_of(attn))
    if why:
        raise Skipped(why)
    return cls(attn, topo, rank, kernel=_KERNEL, options=options, create_groups=False)


def _shares(g, op: str, me: int, topo: Topology) -> tuple[float, float]:
    """(share of a message on ``g`` that crosses nodes for this rank, share that leaves its
    node): a ring hop crosses when either neighbour is on another node (it sends to one and
    receives from the other) and leaves the node when the next one is; an all-to-all sends
    n-1 equal parts, those to members on other nodes cross."""
    if op == "p2p":
        leaves = float(topo.node_of(g.next_rank) != me)
        return float(leaves or topo.node_of(g.prev_rank) != me), leaves
    remote = sum(topo.node_of(r) != me for r in g.ranks) / (g.size - 1)
    return remote, remote


@dataclass
class _Loads:
    """One rank's schedule as the model reads it, per step: bytes by link and kind
    (intra_ov, inter_ov, intra_exp, inter_exp) and bytes leaving the node (ov, exp)."""

    moved: list[list[float]]
    leaving: list[list[float]]


def _span(phases: list[str], i: int, m) -> list[int]:
    """The steps whose compute a message declared at step ``i`` overlaps: its own and the next
    ``overlap_steps`` - 1, or, posted after the step's kernel, the next ``overlap_steps``;
    never past its phase. An exposed message costs at its own step."""
    if not m.overlapped:
        return [i]
    first = i + 1 if m.after_compute else i
    span = [j for j in range(first, min(first + m.overlap_steps, len(phases)))
            if phases[j] == phases[i]]
    return span or [i]


def _rank_loads(strat: Strategy, schedule, topo: Topology, spans: dict | None = None
                ) -> _Loads:
    """A message spread over k steps moves 1/k of its bytes at each (the link carries it
    while they compute). ``spans``: ``_span``'s answers, shared by ranks of one phase order."""
    spans = {} if spans is None else spans
    me = topo.node_of(strat.rank)
    phases = [st.phase for st in schedule]
    loads = _Loads([[0.0] * 4 for _ in schedule], [[0.0, 0.0] for _ in schedule])
    shares: dict[tuple[str, str], tuple[float, float]] = {}
    for i, step in enumerate(schedule):
        for m in step.messages:
            key = (m.op, m.group)
            if key not in shares:
                shares[key] = _shares(strat.groups[m.group], m.op, me, topo)
            remote, out = shares[key]
            at = (i, m.overlapped, m.after_compute, m.overlap_steps)
            if at not in spans:
                spans[at] = _span(phases, i, m)
            span = spans[at]
            kind = 0 if m.overlapped else 2
            share = m.nbytes / len(span)
            for j in span:
                loads.moved[j][kind] += share * (1 - remote)
                loads.moved[j][kind + 1] += share * remote
                loads.leaving[j][kind // 2] += share * out
    return loads


def compile_schedule(name: str, options, attn: AttentionConfig, topo: Topology) -> Compiled:
    """Every rank's schedule, reduced to what the timing model reads."""
    ranks = [build(name, options, attn, topo, r) for r in range(topo.world_size)]
    schedules = [s.schedule() for s in ranks]
    assert len({len(s) for s in schedules}) == 1, f"{name}: ranks disagree on the step count"
    assert len({tuple((st.phase, st.joins) for st in s) for s in schedules}) == 1, \
        f"{name}: ranks disagree on the phases of their steps or where they join"
    spans: dict = {}
    loads = [_rank_loads(strat, sched, topo, spans) for strat, sched in zip(ranks, schedules)]
    nodes = [topo.node_of(strat.rank) for strat in ranks]
    # a kernel call's elements depend on its block and the rank's head share only
    share = [(strat.merges(), strat.kernel_head_share()) for strat in ranks]
    made: dict[tuple, RankStep] = {}  # equal views built once
    steps = []
    for i, first in enumerate(schedules[0]):
        node_out: dict[int, list[float]] = {}
        for node, rank_loads in zip(nodes, loads):
            acc = node_out.setdefault(node, [0.0, 0.0])
            acc[0] += rank_loads.leaving[i][0]
            acc[1] += rank_loads.leaving[i][1]
        views: dict[int, list[RankStep]] = {}
        for strat, sched, rank_loads, node, own in zip(ranks, schedules, loads, nodes, share):
            step = sched[i]
            key = (step.flops, step.block, *rank_loads.moved[i], *node_out[node], own)
            if key not in made:
                made[key] = _view(strat, attn, step, rank_loads.moved[i], node_out[node])
            views.setdefault(node, []).append(made[key])
        steps.append(_step_load(first.phase, list(views.values()), first.joins))
    rank0 = ranks[0]
    peak, bare = memory.peaks(ranks, schedules)
    return Compiled(attn.seqlen, attn.batch, tuple(steps), peak,
                    rank0.ranks_per_problem, rank0.resolved_options(), bare)


def _view(strat: Strategy, attn: AttentionConfig, step, moved: list[float],
          out: list[float]) -> RankStep:
    """One rank's step as the model reads it."""
    side = math.sqrt(step.block[0] * step.block[1]) if step.block else 0.0
    el = sharing.elements(strat, attn, step.block) if strat.merges() else {}
    return RankStep(
        step.flops, side, moved[0], moved[1], moved[2], moved[3], out[0], out[1],
        causal=bool(step.block and step.block[2]),
        **{k: el.get(k, 0.0) for k in ("q_elements", "kv_elements", "out_elements",
                                       "v_elements")})


def _step_load(phase: str, by_node: list[list[RankStep]], joins: bool = True) -> StepLoad:
    """The distinct views of a step and, per distinct node, how many of its ranks have each
    (and each rank's, node by node: ``StepLoad.who``)."""
    distinct = tuple(sorted({v for views in by_node for v in views}, key=dataclasses.astuple))
    index = {v: i for i, v in enumerate(distinct)}
    nodes = set()
    for views in by_node:
        counts = [0] * len(distinct)
        for v in views:
            counts[index[v]] += 1
        nodes.add(tuple(counts))
    who = tuple(index[v] for views in by_node for v in views)
    return StepLoad(phase, distinct, tuple(sorted(nodes)), joins, who)


@lru_cache(maxsize=4096)
def _compiled(name: str, options, attn: AttentionConfig, world: int, rpn: int) -> Compiled:
    # a schedule indexes a few thousand positions at a time (integers: exact on any number
    # of threads): a parallel region's threads would only wait for each other, or for a core
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return compile_schedule(name, options, attn,
                                Topology(world_size=world, ranks_per_node=rpn))
    finally:
        torch.set_num_threads(threads)


_REFERENCE: dict[tuple, AttentionConfig] = {}  # shape → the problem compiled for it
_BY_SIZE = {2: "bf16", 4: "fp32"}


def compiled_for(name: str, options, attn: AttentionConfig, topo: Topology) -> Compiled:
    """The compiled schedule of this shape and topology, built once at a small sequence
    length the strategy accepts and batch 1, and re-scaled (exact: see the module
    docstring)."""
    build(name, options, attn, topo)  # this seqlen's own validation
    if not mask_of(attn).plain:
        # a mask's area does not scale as S² (documents, windows): compiled at its own size
        return _compiled(name, options, attn, topo.world_size, topo.ranks_per_node)
    # bf16 and fp16 schedules are the same bytes: one compile serves both
    shape = dataclasses.replace(attn, seqlen=1, batch=1, dtype=_BY_SIZE[attn.element_size])
    key = (name, options, shape, topo.world_size, topo.ranks_per_node)
    if key not in _REFERENCE:
        _REFERENCE[key] = dataclasses.replace(
            shape, seqlen=_small_seqlen(name, options, attn, topo))
    return _compiled(name, options, _REFERENCE[key], topo.world_size, topo.ranks_per_node)


def _small_seqlen(name: str, options, attn: AttentionConfig, topo: Topology) -> int:
    """``attn.seqlen`` halved while the strategy still accepts it (building a schedule walks
    every rank's token indices: cheap at this size, whatever size is asked for)."""
    seqlen = attn.seqlen
    while seqlen % 2 == 0:
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
