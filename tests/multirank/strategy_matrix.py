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
        measured, declared = traced_bytes(st)
        if measured != declared:
            failures.append(f"{name} {topo.describe()} {opts} rank {rank}: sent {measured} "
                            f"but the schedule declares {declared}")
    return failures


def traced_bytes(st):
    """Bytes sent per (phase, op, group), measured vs declared by the schedule."""
    inputs = global_inputs(st.attn, seed=7)
    q, k, v = (st.shard(inputs[n]).detach().requires_grad_() for n in ("q", "k", "v"))
    with comm.trace() as fwd_sent:
        out, _ = st.attention(q, k, v)
    with comm.trace() as bwd_sent:
        out.backward(st.shard(inputs["dout"]))
    measured = Counter()
    for phase, sent in (("fwd", fwd_sent), ("bwd", bwd_sent)):
        for m in sent:
            measured[(phase, m.op, m.group)] += m.nbytes
    declared = Counter()
    for step in st.schedule():
        for m in step.messages:
            declared[(step.phase, m.op, m.group)] += m.nbytes
    return dict(measured), dict(declared)
