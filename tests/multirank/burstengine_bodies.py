"""Rank body for ``usp --burstengine-dkv-hop`` (tests/unit/test_parity_burstengine_usp.py):
module level so spawned ranks can import it."""

from __future__ import annotations

from collections import Counter

from strategy_matrix import declared_segments, trace_phases, traced_bytes, traced_segments

from cpbench import kernels, strategies
from cpbench.bench.check import check_strategy, global_inputs, run_local
from cpbench.bench.commtrace import traced
from cpbench.topology import Topology


def _posts(st, inputs) -> Counter:
    """(phase, kernels before, op, dtype, bytes, group members) of every call ``st`` makes."""
    q, k, v = (st.shard(inputs[n]).detach().requires_grad_() for n in ("q", "k", "v"))
    with traced() as fwd:
        out, _ = st.attention(q, k, v)
    with traced() as bwd:
        out.backward(st.shard(inputs["dout"]))
    return Counter((phase, e.kernels_before, e.op, e.dtype, e.nbytes, tuple(sorted(e.group)))
                   for phase, events in (("fwd", fwd), ("bwd", bwd)) for e in events)


def usp_as_run(rank, world, rpn, attn):
    """Head-first usp over Ulysses groups of ``rpn``: with the hop (and its check, traced
    posts, measured and declared bytes) and without it (the same one-window double ring):
    this rank's dK and dV from each (exact in fp32); and the check of a two-window ring."""
    cls, topo = strategies.get("usp"), Topology(world_size=world, ranks_per_node=rpn)
    common = dict(placement="head-first", ulysses_degree=rpn, ring_impl="double-ring")

    def build(**opts):
        return cls(attn, topo, rank, kernel=kernels.get("sdpa-cpu"),
                   options=cls.Options(**common, **opts))

    hop, plain = build(burstengine_dkv_hop=True), build(ring_window=world // rpn)
    found = {"verdict": {c.tensor: c.passed for c in check_strategy(hop, seed=11)}}
    # --ring-window reaching the double ring: two windows of 2, checked against float64
    windowed = build(ring_window=2)
    found["windowed"] = (windowed.ring.window, windowed.ring.rings.windows,
                         all(c.passed for c in check_strategy(windowed, seed=13)))
    inputs = global_inputs(hop.attn, seed=12)
    for key, st in (("hop", hop), ("plain", plain)):
        # as numpy: a tensor would travel back through shared memory the rank frees on exit
        found[key] = {n: t.float().numpy() for n, t in run_local(st, inputs).items()
                      if n in ("dk", "dv")}
    sent = trace_phases(hop)
    found["sent"], found["declared"] = traced_bytes(hop, sent)
    found["segments"], found["declared_segments"] = traced_segments(sent), \
        declared_segments(hop)
    found["posts"] = _posts(hop, inputs)
    return found
