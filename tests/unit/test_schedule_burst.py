"""burst's declared schedule against hand-computed byte counts, node crossings and FLOPs
(planned groups only, no processes)."""

from __future__ import annotations

import pytest
from schedule_helpers import HK, B, D, H, S, attn, plan, totals

from cpbench.metrics import attention_flops


def _plan(world, rpn, rank, problem=None, **opts):
    return plan("burst", world, rpn, rank, problem, **opts)


def _sizes(n, elt, opt_bwd):
    s = S // n
    kv = 2 * B * s * HK * D * elt
    row = B * H * s * 4  # lse or delta: one fp32 per query row and head
    act = B * s * H * D * elt  # Q, dO or O
    bundle = row + 2 * act + (row if opt_bwd else act)
    dq = B * s * H * D * 4
    return kv, bundle, dq


@pytest.mark.parametrize("world,rpn", [(8, 4), (8, 2), (4, 2)])
@pytest.mark.parametrize("opt_bwd", [True, False])
def test_double_ring_bytes(world, rpn, opt_bwd):
    n, w = world, rpn
    m = n // w
    kv, bundle, dq = _sizes(n, 2, opt_bwd)
    for rank in range(world):
        got = totals(_plan(world, rpn, rank, opt_bwd=opt_bwd))
        assert got == {
            ("fwd", "outer"): (m - 1) * kv,
            ("fwd", "inner"): m * (w - 1) * kv,
            # the query bundle goes the way K/V went forward
            ("bwd", "outer"): (m - 1) * bundle,
            ("bwd", "inner"): m * (w - 1) * bundle,
            # dQ on its own groups: w inner hops and one outer hop per window
            ("bwd", "outer_dq"): m * dq,
            ("bwd", "inner_dq"): m * w * dq,
        }, rank


@pytest.mark.parametrize("opt_bwd", [True, False])
def test_flat_ring_bytes(opt_bwd):
    n = 8
    kv, bundle, dq = _sizes(n, 2, opt_bwd)
    for rank in range(n):
        got = totals(_plan(n, 4, rank, double_ring=False, opt_bwd=opt_bwd))
        assert got == {("fwd", "ring"): (n - 1) * kv, ("bwd", "ring"): (n - 1) * bundle,
                       ("bwd", "ring_dq"): n * dq}


def test_opt_bwd_saves_o_minus_delta():
    n = 4
    on = totals(_plan(n, 2, 1, opt_bwd=True))
    off = totals(_plan(n, 2, 1, opt_bwd=False))
    per_hop = B * (S // n) * H * D * 2 - B * H * (S // n) * 4
    assert sum(off.values()) - sum(on.values()) == (n - 1) * per_hop


def test_crossings():
    for rank in range(8):
        st = _plan(8, 4, rank)
        for role in ("inner", "inner_dq"):
            assert st.groups[role].ranks == ((0, 1, 2, 3) if rank < 4 else (4, 5, 6, 7))
        for step in st.schedule():
            for msg in step.messages:
                assert msg.crosses_nodes == msg.group.startswith("outer")
        flat = _plan(8, 4, rank, double_ring=False)
        assert all(m.crosses_nodes for step in flat.schedule() for m in step.messages)
    single_node = _plan(4, 4, 0)
    assert set(single_node.groups) == {"inner", "inner_dq"}
    assert not single_node.groups["inner"].crosses_nodes


def test_resolved_options_name_the_window():
    assert _plan(8, 2, 0).resolved_options() == dict(double_ring=True, opt_bwd=True, window=2)
    assert _plan(8, 2, 0, double_ring=False).resolved_options()["window"] == 8


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world,rpn,double_ring", [(8, 2, True), (8, 2, False), (4, 2, True),
                                                   (1, 1, True)])
def test_flops_sum_to_the_global_problem(world, rpn, double_ring, causal):
    problem = attn(causal=causal)
    for phase in ("fwd", "bwd"):
        total = sum(step.flops for rank in range(world)
                    for step in _plan(world, rpn, rank, problem,
                                      double_ring=double_ring).schedule()
                    if step.phase == phase)
        assert total == attention_flops(batch=B, seqlen_q=S, seqlen_k=S, heads=H, head_dim=D,
                                        causal=causal, mode=phase)
