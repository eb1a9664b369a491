"""Rank bodies for the strategy matrix (module level so forkserver ranks can import them)."""

from __future__ import annotations

from collections import Counter

from cpbench import comm, kernels, strategies
from cpbench.bench.check import check_strategy, global_inputs
from cpbench.topology import Topology


def check_cases(rank, world, name, rpn, cases, traffic_cases, kernel="sdpa-cpu"):
    """Run every (attn, options) case against the reference, and every traffic case against
    its declared schedule. Returns failures as readable strings."""
    topo = Topology(world_size=world, ranks_per_node=rpn)
    cls = strategies.get(name)
    failures = []
    for i, (attn, opts) in enumerate(cases):
        st = cls(attn, topo, rank, kernel=kernels.get(kernel), options=opts)
        for c in check_strategy(st, seed=1000 + i):
            if not c.passed:
                failures.append(f"{name} {topo.describe()} {opts} {attn}: {c.line()}")
    for attn, opts in traffic_cases:
        st = cls(attn, topo, rank, kernel=kernels.get(kernel), options=opts)
        traced = trace_phases(st)
        measured, declared = traced_bytes(st, traced)
        if measured != declared:
            failures.append(f"{name} {topo.describe()} {opts} rank {rank}: sent {measured} "
                            f"but the schedule declares {declared}")
        got, want = traced_segments(traced), declared_segments(st)
        if got != want:
            failures.append(f"{name} {topo.describe()} {opts} rank {rank}: messages around its "
                            f"kernels are {got} but the schedule declares {want}")
    return failures


def trace_phases(st) -> dict[str, list]:
    """Everything ``st`` sends, and its kernel calls, in order, per phase."""
    inputs = global_inputs(st.attn, seed=7)
    q, k, v = (st.shard(inputs[n]).detach().requires_grad_() for n in ("q", "k", "v"))
    sinks = inputs["sinks"].requires_grad_() if "sinks" in inputs else None
    with comm.trace() as fwd_sent:
        out, _ = st.attend(q, k, v, sinks)
    with comm.trace() as bwd_sent:
        out.backward(st.shard(inputs["dout"]))
    return {"fwd": fwd_sent, "bwd": bwd_sent}


def traced_bytes(st, traced):
    """Bytes sent per (phase, op, group), and those its layout copies passed over ("a2a
    copied"), measured vs declared by the schedule."""
    measured = Counter()
    for phase, sent in traced.items():
        for m in sent:
            if m.op != comm.KERNEL:
                measured[(phase, m.op, m.group)] += m.nbytes
                if m.copied:
                    measured[(phase, f"{m.op} copied", m.group)] += m.copied
    declared = Counter()
    for step in st.schedule():
        for m in step.messages:
            declared[(step.phase, m.op, m.group)] += m.nbytes
            if m.copied:
                declared[(step.phase, f"{m.op} copied", m.group)] += m.copied
    return dict(measured), dict(declared)


def _segments(events) -> list:
    """Messages between consecutive kernel calls, each stretch as a sorted list."""
    out, current = [], []
    for e in events:
        if e == comm.KERNEL:
            out.append(sorted(current))
            current = []
        else:
            current.append(e)
    return out + [sorted(current)]


def traced_segments(traced) -> dict:
    return {phase: _segments([m.op if m.op == comm.KERNEL else (m.op, m.group, m.nbytes)
                              for m in sent]) for phase, sent in traced.items()}


def declared_segments(st) -> dict:
    """What the schedule says happens around each kernel: a step's messages are posted before
    its kernel, those marked ``after_compute`` after it (the simulator's overlap reads this)."""
    events = {"fwd": [], "bwd": []}
    for step in st.schedule():
        seq = events[step.phase]
        seq += [(m.op, m.group, m.nbytes) for m in step.messages if not m.after_compute]
        if step.block is not None:
            seq.append(comm.KERNEL)
        seq += [(m.op, m.group, m.nbytes) for m in step.messages if m.after_compute]
    return {phase: _segments(seq) for phase, seq in events.items()}


def check_named_cases(rank, world, rpn, cases):
    """``check_cases`` for (strategy name, attn, options) triples: several strategies in one
    launch (the mask matrix), cpbench's own also held to their declared schedules (the
    adapters run a library's code and declare none)."""
    failures = []
    for name, attn, opts in cases:
        own = strategies.get(name).upstream is None
        failures += check_cases(rank, world, name, rpn, [(attn, opts)],
                                [(attn, opts)] if own else [])
    return failures


def check_each_strategy(rank, world, rpn, per_strategy, kernel="sdpa-cpu"):
    """``check_cases`` for several strategies in one launch: ``per_strategy`` is a list of
    (name, cases, traffic cases)."""
    failures = []
    for name, cases, traffic in per_strategy:
        failures += [f"{name}: {f}" for f in check_cases(rank, world, name, rpn, cases, traffic,
                                                         kernel)]
    return failures
