"""Invariants every registered strategy's schedule must satisfy (planned groups, no
processes): summed over the ranks of a problem, the kernel FLOPs it declares are exactly the
global problem's FLOPs (bench/flops.py), forward and backward, for every variant. Plus what
the ring-family strategies share: a ring of one sends nothing, the zigzag layout's seqlen
check, and resolved options that fit a record."""

from __future__ import annotations

import dataclasses
import json

import pytest
from schedule_helpers import plan

from cpbench import kernels, strategies
from cpbench.config import AttentionConfig
from cpbench.metrics import attention_flops
from cpbench.strategies.base import BWD, FWD
from cpbench.topology import Topology


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world,rpn", [(1, 1), (2, 1), (4, 2), (8, 4), (8, 2)])
@pytest.mark.parametrize("name", strategies.own_names())
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


@pytest.mark.parametrize("name", ["ring", "zigzag", "megatron-cp", "double-ring", "burst"])
def test_ring_of_one_sends_nothing(name):
    """As inside a composite strategy whose ring has one member: the kernel on the local
    block, nothing sent."""
    attn = AttentionConfig(batch=1, seqlen=64, heads=4, head_dim=8, dtype="bf16")
    st = plan(name, 4, 2, 2, attn, cp_lists=[[0], [1], [2], [3]])
    steps = st.schedule()
    assert [(s.phase, s.messages) for s in steps] == [(FWD, ()), (BWD, ())]
    for step, mode in zip(steps, ("fwd", "bwd")):
        assert step.flops == attention_flops(batch=1, seqlen_q=64, seqlen_k=64, heads=4,
                                             head_dim=8, causal=True, mode=mode)


@pytest.mark.parametrize("name", ["zigzag", "megatron-cp", "double-ring", "burst"])
def test_zigzag_layout_names_nearest_seqlen(name):
    attn = AttentionConfig(batch=1, seqlen=90, heads=4, head_dim=8)
    with pytest.raises(ValueError, match=f"{name} over 4 ranks.*divide by 8.*--seqlen 88"):
        plan(name, 4, 2, 0, attn)


@pytest.mark.parametrize("world,rpn", [(1, 1), (4, 2), (8, 4)])
@pytest.mark.parametrize("name", strategies.own_names())
def test_resolved_options_are_plain_data(name, world, rpn):
    cls = strategies.get(name)
    attn = AttentionConfig(batch=1, seqlen=96, heads=8, head_dim=8)
    for opts in cls.variants(Topology(world_size=world, ranks_per_node=rpn)):
        resolved = plan(cls, world, rpn, 0, attn, **dataclasses.asdict(opts)).resolved_options()
        assert json.loads(json.dumps(resolved)) == resolved  # goes into a JSON record as is


@pytest.mark.parametrize("name", strategies.own_names())
def test_a_step_computes_exactly_the_block_it_names(name):
    """The simulator prices a step's FLOPs at the kernel speed of its block: every step that
    computes names its (seqlen_q, seqlen_k, causal), and its FLOPs are that block's on the
    full heads or on an integer share of them (Ulysses / USP head shards)."""
    cls = strategies.get(name)
    topo = Topology(world_size=8, ranks_per_node=4)
    attn = AttentionConfig(batch=2, seqlen=96, heads=8, kv_heads=2, head_dim=16, dtype="bf16")
    for opts in cls.variants(topo):
        for rank in (0, 7):
            st = cls(attn, topo, rank, kernel=kernels.get("torch"), options=opts,
                     create_groups=False)
            for step in st.schedule():
                assert (step.flops > 0) == (step.block is not None), (name, opts, step)
                if step.block:
                    sq, sk, causal = step.block
                    share = attention_flops(batch=2, seqlen_q=sq, seqlen_k=sk, heads=8,
                                            head_dim=16, causal=causal,
                                            mode=step.phase) / step.flops
                    assert share == round(share) >= 1, (name, opts, step)
