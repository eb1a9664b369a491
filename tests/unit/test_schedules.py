"""Invariants every registered strategy's schedule must satisfy (planned groups, no
processes): summed over the ranks of a problem, the kernel FLOPs it declares are exactly the
global problem's FLOPs (bench/flops.py), forward and backward, for every variant."""

from __future__ import annotations

import pytest

from cpbench import kernels, strategies
from cpbench.bench.flops import attention_flops
from cpbench.config import AttentionConfig
from cpbench.strategies.base import BWD, FWD
from cpbench.topology import Topology


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world,rpn", [(1, 1), (2, 1), (4, 2), (8, 4), (8, 2)])
@pytest.mark.parametrize("name", strategies.names())
def test_declared_flops_sum_to_the_global_problem(name, world, rpn, causal):
    cls = strategies.get(name)
    topo = Topology(world_size=world, ranks_per_node=rpn)
    attn = AttentionConfig(batch=2, seqlen=96, heads=8, kv_heads=2, head_dim=16, dtype="bf16",
                           causal=causal)
    for opts in cls.variants(topo):
        totals = {FWD: 0.0, BWD: 0.0}
        ranks = [cls(attn, topo, r, kernel=kernels.get("torch"), options=opts,
                     create_groups=False) for r in range(world)]
        for st in ranks:
            for step in st.schedule():
                totals[step.phase] += step.flops
        problems = world // ranks[0].ranks_per_problem  # `local`: every rank solves it alone
        for phase, mode in ((FWD, "fwd"), (BWD, "bwd")):
            want = attention_flops(batch=2, seqlen_q=96, seqlen_k=96, heads=8, head_dim=16,
                                   causal=causal, mode=mode)
            assert totals[phase] == pytest.approx(problems * want, rel=1e-12), (name, opts, phase)
