"""Where one rank's step time goes, from its Chrome trace: a partition of each step's wall
time into parts, idle, and the exposed communication.

**Intervals.** On GPU, the device's own intervals: CUDA kernels (NCCL's included), memcpys
and memsets. On CPU there is no device timeline, so the rank's CPU op intervals stand for
its kernels (``cpu_op`` events: ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its
backward, the merges' ``aten::sub`` / ``aten::add_``…), and gloo's work spans stand for its
communication. Profiling a real 2-rank gloo run (torch 2.13) shows what those are: every
ProcessGroupGloo work carries a ``user_annotation`` span named ``gloo:<op>``. For
``send`` / ``recv`` it runs on the posting thread from the post (``c10d::send``,
``c10d::recv_``) until the ``wait()`` that completes it returns; for collectives
(``gloo:all_to_all``, ``gloo:all_gather``…) on gloo's worker thread while the work executes,
the calling thread blocked inside its wait (no op of its own runs meanwhile). Either way the
span covers the time the rank waits on that transfer. Other annotations (the step marks,
``ProfilerStep#N``) are labels, not work, and are left out.

**Partition.** Each instant of a step belongs to exactly one part: the highest-priority part
active then (``PRIORITY``: attention, GEMM, elementwise, memory, communication, other), or
idle when none is. So nothing is counted twice, the parts and idle sum to the step's wall
time, and busy = wall − idle.

**Exposed communication** is the time communication is active and no compute (attention,
GEMM, elementwise, memory) runs: with communication after the compute parts in the
priority, it is exactly the communication parts' share of the partition. Time where only
attention is absent but the merge runs is not counted as exposed: on gloo a ``send`` span
ends only at the ``wait()`` after the merge, which would otherwise be charged to the wire.

**Steps.** The windows are the ``cpbench/step`` marks ``cpbench run --profile`` puts around
each profiled iteration (on GPU they end after a synchronize, so a window holds all its
kernels); else torch's ``ProfilerStep#N`` (their GPU-side copies when present); else the
span of the whole timeline as one step.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

from cpbench.errors import UsageError
from cpbench.profile import parsers
from cpbench.profile.groups import ATTENTION, COMMUNICATION, Rules, top
from cpbench.profile.parsers import Event, Trace

STEP_MARK = "cpbench/step"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
PRIORITY = ("attention", "gemm", "elementwise", "memory", "communication", "other")
IDLE = "idle"
GPU, CPU = "gpu kernels", "cpu ops + gloo work"  # what a breakdown's intervals are


def part(group: str) -> str:
    """The breakdown part of a group: attention and communication keep their subgroup
    (forward / backward, which operation); the others are one part each."""
    parts = group.split("/")
    return "/".join(parts[:2]) if parts[0] in (ATTENTION, COMMUNICATION) else parts[0]


def priority_of(name: str) -> tuple[int, str]:
    """A part's place in the priority (smaller first)."""
    return PRIORITY.index(top(name)), name


def ordered(parts: Iterable[str]) -> list[str]:
    """Parts in priority order, idle last (a record's JSON keeps them sorted by name)."""
    return sorted(parts, key=lambda p: (p == IDLE, priority_of(p) if p != IDLE else ()))


def timeline(trace: Trace, rules: Rules) -> tuple[list[Event], str]:
    """The intervals the breakdown is made of, and which kind they are (GPU or CPU)."""
    device = [e for e in trace.events if e.cat in DEVICE_CATS]
    if device:
        return device, GPU
    return [e for e in trace.events if e.cat == "cpu_op" or (
        e.cat == "user_annotation" and top(rules.group(e.name)) == COMMUNICATION)], CPU


def step_windows(trace: Trace, device: bool) -> list[tuple[float, float]]:
    """The profiled steps' (start, end) in µs, in time order (see the module docstring)."""
    marks = [e for e in trace.events if e.name == STEP_MARK and e.cat != "gpu_user_annotation"]
    if not marks:
        steps = [e for e in trace.events if e.name.startswith("ProfilerStep#")]
        on_gpu = [e for e in steps if e.cat == "gpu_user_annotation"]
        marks = on_gpu if device and on_gpu else [e for e in steps if e not in on_gpu]
    return sorted((e.start, e.end) for e in marks)


def windows(trace: Trace, events: list[Event], kind: str) -> list[tuple[float, float]]:
    """The step windows, else the whole timeline as one step."""
    found = step_windows(trace, kind == GPU)
    if not found and events:
        found = [(min(e.start for e in events), max(e.end for e in events))]
    return found


def attribute_span(intervals: list[tuple[float, float, str, tuple[Any, ...]]], w0: float, w1: float
                   ) -> tuple[dict[str, float], float]:
    """Each instant of the span [w0, w1) to the active interval of the smallest key: (µs per
    label, idle µs). ``intervals``: (start, end, label, key), clipped to the span (a step owns
    only its own time)."""
    totals: dict[str, float] = defaultdict(float)
    idle = 0.0
    edges = []
    for i, (s, e, _, _) in enumerate(intervals):
        s, e = max(s, w0), min(e, w1)
        if e > s:
            edges += [(s, 1, i), (e, -1, i)]
    edges.sort()  # at equal times, ends before starts
    heap: list[tuple[tuple[Any, ...], int]] = []
    live: set[int] = set()
    at = w0
    for t, delta, i in edges:
        if t > at:
            while heap and heap[0][1] not in live:  # lazily drop ended intervals
                heapq.heappop(heap)
            if heap:
                totals[intervals[heap[0][1]][2]] += t - at
            else:
                idle += t - at
            at = t
        if delta > 0:
            live.add(i)
            heapq.heappush(heap, (intervals[i][3], i))
        else:
            live.discard(i)
    return dict(totals), idle + (w1 - at)


def attribute(intervals: list[tuple[float, float, str, tuple[Any, ...]]],
              spans: list[tuple[float, float]]) -> tuple[dict[str, float], float, float]:
    """``attribute_span`` summed over ``spans``: (µs per label, idle µs, wall µs)."""
    totals: dict[str, float] = defaultdict(float)
    idle = 0.0
    for w0, w1 in spans:
        part_us, span_idle = attribute_span(intervals, w0, w1)
        for k, v in part_us.items():
            totals[k] += v
        idle += span_idle
    return dict(totals), idle, sum(w1 - w0 for w0, w1 in spans)


@dataclass(frozen=True)
class Breakdown:
    """One rank's profiled steps: µs per part (idle included), summed over the steps, and
    each step's own (``per_step``: (wall µs, {part: µs})), which tests across steps need."""

    timeline: str
    steps: int
    wall_us: float
    part_us: dict[str, float]
    per_step: tuple[tuple[float, dict[str, float]], ...] = ()

    @property
    def busy_us(self) -> float:
        return self.wall_us - self.part_us.get(IDLE, 0.0)

    @property
    def exposed_comm_us(self) -> float:
        return sum(v for k, v in self.part_us.items() if top(k) == COMMUNICATION)

    def to_dict(self) -> dict[str, Any]:
        """The figures a record keeps (see ``cpbench.bench.profiling``): per step, and as %
        of the step's wall time (parts + idle sum to 100) and of its busy time."""
        wall, busy = self.wall_us or 1.0, self.busy_us or 1.0
        return {"timeline": self.timeline, "steps": self.steps,
                "step_ms": round(self.wall_us / 1e3 / max(self.steps, 1), 4),
                "wall_pct": {k: round(100 * v / wall, 3) for k, v in self.part_us.items()},
                "busy_pct": {k: round(100 * v / busy, 3) for k, v in self.part_us.items()
                             if k != IDLE},
                "exposed_comm_ms": round(self.exposed_comm_us / 1e3 / max(self.steps, 1), 4),
                "exposed_comm_pct": round(100 * self.exposed_comm_us / wall, 3),
                "per_iteration": [{k: round(100 * v / (w or 1.0), 3) for k, v in parts.items()}
                                  for w, parts in self.per_step],
                "per_iteration_ms": [round(w / 1e3, 4) for w, _ in self.per_step]}


def breakdown(trace: Trace, rules: Rules) -> Breakdown:
    """The partition of ``trace``'s profiled steps (one rank's trace)."""
    events, kind = timeline(trace, rules)
    labelled = [(e.start, e.end, part(rules.group(e.name))) for e in events]
    return partition(labelled, windows(trace, events, kind), kind)


def partition(intervals: list[tuple[float, float, str]], spans: list[tuple[float, float]],
              kind: str = GPU) -> Breakdown:
    """Each instant of each step to the highest-priority part active then (else idle).
    ``intervals``: (start, end, part) with parts named as ``part()`` names them."""
    keyed = [(s, e, p, priority_of(p)) for s, e, p in intervals]
    per_step = []
    totals: dict[str, float] = defaultdict(float)
    for w0, w1 in spans:
        part_us, idle = attribute_span(keyed, w0, w1)
        part_us = {p: part_us[p] for p in sorted(part_us, key=priority_of) if part_us[p] > 0}
        part_us[IDLE] = idle
        per_step.append((w1 - w0, part_us))
        for k, v in part_us.items():
            totals[k] += v
    ordered_us = {p: totals[p] for p in ordered(totals) if totals[p] > 0 or p == IDLE}
    ordered_us.setdefault(IDLE, 0.0)
    return Breakdown(kind, len(spans), sum(w for w, _ in per_step), ordered_us,
                     tuple(per_step))


def from_file(path: str, rules: Rules) -> Breakdown:
    """The breakdown of a saved trace (what ``cpbench run --profile`` records, recomputed)."""
    trace = parsers.read(path)
    if not isinstance(trace, Trace):
        raise UsageError(f"{path}: a kernel table, not a trace: it has no timeline to "
                         f"break a step down with; give a Chrome trace")
    return breakdown(trace, rules)
