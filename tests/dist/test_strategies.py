"""Every registered strategy × world size × causal/non-causal × GQA × dtype, gathered into
global order and compared with the float64 single-process reference (out, lse, dq, dk, dv);
and every strategy's declared communication schedule against the bytes it really sends."""

from __future__ import annotations

import dataclasses

import pytest

from cpbench import strategies
from cpbench.config import AttentionConfig
from cpbench.launch import run_ranks
from cpbench.topology import Topology

from strategy_matrix import check_cases, traced_bytes

# (world, ranks per node): world 4 = 2 nodes × 2, world 8 = 2 × 4 and 4 × 2, so two-level
# strategies really have several inner rings.
TOPOLOGIES = [(2, 1), (4, 2), (8, 4), (8, 2)]
SEQLEN = 96  # divisible by 2·N·(ulysses splits) for every world size here; small but not tiny


def _cases(cls, topo):
    cases = []
    for opts in cls.variants(topo):
        for causal in (True, False):
            if cls.causal_only and not causal:
                continue
            for kv_heads, dtype in ((None, "fp32"), (2, "fp32"), (None, "bf16"), (2, "fp16")):
                attn = AttentionConfig(batch=2, seqlen=SEQLEN, heads=4, kv_heads=kv_heads,
                                       head_dim=16, dtype=dtype, causal=causal)
                cases.append((attn, opts))
    return cases


@pytest.mark.parametrize("world,rpn", TOPOLOGIES, ids=lambda x: str(x))
@pytest.mark.parametrize("name", strategies.names())
def test_matches_reference(name, world, rpn):
    cls = strategies.get(name)
    topo = Topology(world_size=world, ranks_per_node=rpn)
    cases = _cases(cls, topo)
    assert cases
    failures = run_ranks(check_cases, world, name, rpn, cases, timeout=240)[0]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world,rpn", [(4, 2), (8, 2)], ids=lambda x: str(x))
@pytest.mark.parametrize("name", strategies.names())
def test_schedule_matches_traffic(name, world, rpn):
    cls = strategies.get(name)
    topo = Topology(world_size=world, ranks_per_node=rpn)
    for opts in cls.variants(topo):
        attn = AttentionConfig(batch=1, seqlen=SEQLEN, heads=4, kv_heads=2, head_dim=8,
                               dtype="bf16", causal=True)
        for rank, (measured, declared) in enumerate(
                run_ranks(traced_bytes, world, name, rpn, attn, opts, timeout=120)):
            assert measured, f"{name} sent nothing on rank {rank}"
            assert measured == declared, f"{name} {opts} rank {rank}"
