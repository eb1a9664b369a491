"""A strategy's declared schedule, compiled for the timing model: each rank's steps reduced
to kernel FLOPs, block side and bytes by link (inside / across nodes, overlapped / exposed),
the distinct rank views of each step and how many ranks of each node share them
(``cpbench.sim.model``'s points 1, 2, 4 and 5 say how they are read)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from cpbench import kernels, strategies
from cpbench.config import AttentionConfig
from cpbench.errors import Skipped, UsageError
from cpbench.mask import mask_of
from cpbench.sim import memory, sharing
from cpbench.strategies.base import Strategy
from cpbench.topology import Topology


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
    spectrum: tuple[tuple[float, float, bool, float], ...] = ()  # ``Step.spectrum``
    gqa: int = 1  # query heads a K/V head in its kernel call (tiles that pack them)
    copied: float = 0.0  # bytes its layout copies around its messages read and write


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
    n-1 equal parts, those to members on other nodes cross. An all-gather or reduce-scatter
    over nodes runs as NCCL's rings (its only algorithm for them over a network): each ring
    carries the whole message into and out of every node, once, over one NIC, and the rings
    (channels) share the node's NICs, so a member's NIC moves 1/m of it (m: the group's
    members on its node) and NVLink the rest. nccl-tests' bus bandwidth says the same: a
    node's NICs together, not one GPU's (docs/simulator.md, 2026-11-29)."""
    if op == "p2p":
        leaves = float(topo.node_of(g.next_rank) != me)
        return float(leaves or topo.node_of(g.prev_rank) != me), leaves
    local = sum(topo.node_of(r) == me for r in g.ranks)
    if op in ("ag", "rs") and local < g.size:
        return 1 / local, 1 / local
    remote = (g.size - local) / (g.size - 1)
    return remote, remote


@dataclass
class _Loads:
    """One rank's schedule as the model reads it, per step: bytes by link and kind
    (intra_ov, inter_ov, intra_exp, inter_exp), bytes leaving the node (ov, exp) and bytes
    its layout copies pass over (``Message.copied``, at the message's own step)."""

    moved: list[list[float]]
    leaving: list[list[float]]
    copied: list[float]


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
    loads = _Loads([[0.0] * 4 for _ in schedule], [[0.0, 0.0] for _ in schedule],
                   [0.0] * len(schedule))
    shares: dict[tuple[str, str], tuple[float, float]] = {}
    for i, step in enumerate(schedule):
        for m in step.messages:
            loads.copied[i] += m.copied
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
            key = (step.flops, step.block, step.spectrum, *rank_loads.moved[i],
                   *node_out[node], own, rank_loads.copied[i])
            if key not in made:
                made[key] = _view(strat, attn, step, rank_loads.moved[i], node_out[node],
                                  rank_loads.copied[i])
            views.setdefault(node, []).append(made[key])
        steps.append(_step_load(first.phase, list(views.values()), first.joins))
    rank0 = ranks[0]
    peak, bare = memory.peaks(ranks, schedules)
    return Compiled(attn.seqlen, attn.batch, tuple(steps), peak,
                    rank0.ranks_per_problem, rank0.resolved_options(), bare)


def _view(strat: Strategy, attn: AttentionConfig, step, moved: list[float],
          out: list[float], copied: float) -> RankStep:
    """One rank's step as the model reads it."""
    side = math.sqrt(step.block[0] * step.block[1]) if step.block else 0.0
    el = sharing.elements(strat, attn, step.block) if strat.merges() else {}
    return RankStep(
        step.flops, side, moved[0], moved[1], moved[2], moved[3], out[0], out[1],
        causal=bool(step.block and step.block[2]), spectrum=step.spectrum, copied=copied,
        gqa=strat.kernel_gqa() if step.spectrum else 1,
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
