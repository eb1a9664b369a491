"""double-ring's declared schedule against hand-computed byte counts, node crossings and FLOPs
(planned groups only, no processes)."""

from __future__ import annotations

from collections import Counter

import pytest
from schedule_helpers import HK, B, D, H, S, attn, plan, totals

from cpbench.metrics import attention_flops


def _plan(world, rpn, rank, problem=None, **opts):
    return plan("double-ring", world, rpn, rank, problem, **opts)


@pytest.mark.parametrize("world,rpn", [(8, 4), (8, 2), (4, 2)])
@pytest.mark.parametrize("dtype,elt", [("bf16", 2), ("fp32", 4)])
def test_bytes_match_hand_formula(world, rpn, dtype, elt):
    n, w = world, rpn  # default window: ranks per node
    m = n // w
    s = S // n
    kv = 2 * B * s * HK * D * elt  # one K and one V block
    dkv = 2 * B * s * HK * D * 4  # their gradients, fp32
    for rank in range(world):
        got = totals(_plan(world, rpn, rank, attn(dtype)))
        assert got == {
            ("fwd", "outer"): (m - 1) * kv,  # the base block, once per window but the last
            ("fwd", "inner"): m * (w - 1) * kv,
            ("bwd", "outer"): (m - 1) * kv,
            ("bwd", "inner"): m * (w - 1) * kv,
            # dK/dV on their own groups: one outer hop and w inner hops per window
            ("bwd", "outer_dkv"): m * dkv,
            ("bwd", "inner_dkv"): m * w * dkv,
        }, rank


def test_inner_rings_stay_in_a_node_outer_cross():
    for rank in range(8):
        st = _plan(8, 4, rank)
        assert st.window == 4 and st.resolved_options() == {"window": 4}
        for role in ("inner", "inner_dkv"):
            assert st.groups[role].ranks == ((0, 1, 2, 3) if rank < 4 else (4, 5, 6, 7))
        for role in ("outer", "outer_dkv"):
            assert st.groups[role].ranks == (rank % 4, rank % 4 + 4)
        for step in st.schedule():
            for msg in step.messages:
                assert msg.crosses_nodes == msg.group.startswith("outer")


def test_window_option():
    st = _plan(8, 2, 0, window=4)  # inner rings of 4 span 2 nodes of 2
    assert st.groups["inner"].crosses_nodes and st.groups["outer"].crosses_nodes
    st = _plan(8, 4, 5, window=8)  # one inner ring: a plain zigzag ring, no outer group
    assert set(st.groups) == {"inner", "inner_dkv"} and st.groups["inner"].crosses_nodes
    st = _plan(8, 4, 5, window=1)  # one outer ring
    assert set(st.groups) == {"outer", "outer_dkv"}
    assert totals(st)[("fwd", "outer")] == 7 * 2 * B * (S // 8) * HK * D * 2


def test_exposed_messages():
    st = _plan(8, 2, 3)  # 4 windows of 2
    exposed = Counter(m.group for step in st.schedule() for m in step.messages
                      if not m.overlapped)
    # the last dK/dV inner hop of each window is awaited at once; the last outer hop ends it
    assert exposed == {"inner_dkv": 4, "outer_dkv": 1}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world,rpn", [(8, 2), (4, 2), (1, 1)])
def test_flops_sum_to_the_global_problem(world, rpn, causal):
    problem = attn(causal=causal)
    for phase in ("fwd", "bwd"):
        total = sum(step.flops for rank in range(world)
                    for step in _plan(world, rpn, rank, problem).schedule()
                    if step.phase == phase)
        assert total == attention_flops(batch=B, seqlen_q=S, seqlen_k=S, heads=H, head_dim=D,
                                        causal=causal, mode=phase)


def test_validate():
    with pytest.raises(ValueError, match="window 3 does not divide"):
        _plan(8, 4, 0, window=3)
    with pytest.raises(ValueError, match="try --seqlen 96"):
        _plan(8, 4, 0, attn(seqlen=100))
