"""burst's declared schedule against hand-computed byte counts, node crossings and FLOPs
(planned groups only, no processes)."""

from __future__ import annotations

import pytest
from schedule_helpers import HK, B, D, H, S, attn, plan, totals

from cpbench.metrics import attention_flops


def _plan(world, rpn, rank, problem=None, **opts):
    return plan("burst", world, rpn, rank, problem, **opts)


def _sizes(n, elt, opt_bwd, dq_elt=None):
    s = S // n
    kv = 2 * B * s * HK * D * elt
    row = B * H * s * 4  # lse or delta: one fp32 per query row and head
    act = B * s * H * D * elt  # Q, dO or O
    bundle = row + 2 * act + (row if opt_bwd else act)
    # dQ partial sums in the activation dtype, as Burst-Attention's (burst_attn_interface.py
    # L261: dq = zeros_like(q)); fp32 only as the --dq-dtype variant
    dq = B * s * H * D * (dq_elt or elt)
    return kv, bundle, dq


@pytest.mark.parametrize("world,rpn", [(8, 4), (8, 2), (4, 2)])
@pytest.mark.parametrize("opt_bwd", [True, False])
@pytest.mark.parametrize("dq_dtype,dq_elt", [("activation", None), ("fp32", 4)])
def test_double_ring_bytes(world, rpn, opt_bwd, dq_dtype, dq_elt):
    n, w = world, rpn
    m = n // w
    kv, bundle, dq = _sizes(n, 2, opt_bwd, dq_elt)
    for rank in range(world):
        got = totals(_plan(world, rpn, rank, opt_bwd=opt_bwd, dq_dtype=dq_dtype))
        assert got == {
            ("fwd", "outer"): (m - 1) * kv,
            ("fwd", "inner"): m * (w - 1) * kv,
            # the query bundle goes the way K/V went forward
            ("bwd", "outer"): (m - 1) * bundle,
            ("bwd", "inner"): m * (w - 1) * bundle,
            # dQ on its own groups (comm.py double_ring_send_recv_q L187-218): w-1 inner
            # hops per window, the window's last sum straight across (one outer hop per
            # window), and the final inner hop home
            ("bwd", "outer_dq"): m * dq,
            ("bwd", "inner_dq"): (m * (w - 1) + 1) * dq,
        }, rank


@pytest.mark.parametrize("opt_bwd", [True, False])
def test_flat_ring_bytes(opt_bwd):
    n = 8
    kv, bundle, dq = _sizes(n, 2, opt_bwd)
    for rank in range(n):
        # dQ on the query ring's own communicator, as upstream's flat mode (L265-267)
        got = totals(_plan(n, 4, rank, double_ring=False, opt_bwd=opt_bwd))
        assert got == {("fwd", "ring"): (n - 1) * kv, ("bwd", "ring"): (n - 1) * bundle + n * dq}
        separate = totals(_plan(n, 4, rank, double_ring=False, opt_bwd=opt_bwd,
                                dq_group="separate"))
        assert separate == {("fwd", "ring"): (n - 1) * kv, ("bwd", "ring"): (n - 1) * bundle,
                            ("bwd", "ring_dq"): n * dq}


def test_messages_per_hop():
    """K and V two messages (burst_attn_interface.py L219); the backward bundle four, in
    upstream's order delta, dO, Q, lse (L288, L296-298); dQ one."""
    n, s = 8, S // 8
    row, act = B * H * s * 4, B * s * H * D * 2
    st = _plan(n, 4, 2)
    steps = st.schedule()
    fwd0 = [m.nbytes for m in steps[0].messages]
    assert sorted(fwd0) == [B * s * HK * D * 2] * 4  # outer and inner: K, V each
    bwd1 = [m.nbytes for m in steps[n + 1].messages if m.group == "inner"]
    assert bwd1 == [row, act, act, row]
    assert [m.group for m in steps[n + 1].messages if m.group.endswith("_dq")] == ["inner_dq"]


@pytest.mark.parametrize("world,rpn", [(8, 4), (8, 2), (4, 2)])
def test_dq_hops_posted_and_awaited_as_upstream(world, rpn):
    """(post, wait) in kernels completed, per dQ hop. Upstream (burst_attn_interface.py
    L300-302 before the kernel, L375-378 after it; comm.py L191-216): an inner hop before
    every kernel but a window's first, awaited after it; an outer hop before a window's
    first kernel, awaited at the next boundary (W kernels later); after the last kernel one
    outer then one inner hop, each awaited at once: 2 exposed."""
    n, w = world, rpn
    m = n // w
    want = sorted([(i, i + 1, "inner_dq") for i in range(n) if i % w] +
                  [(j * w, (j + 1) * w, "outer_dq") for j in range(1, m)] +
                  [(n, n, "outer_dq"), (n, n, "inner_dq")])
    for rank in range(world):
        got = []
        for step in _plan(world, rpn, rank).schedule():
            for msg in step.messages:
                if step.phase == "bwd" and msg.group.endswith("_dq"):
                    post = step.index + msg.after_compute
                    got.append((post, post + msg.overlap_steps * msg.overlapped, msg.group))
        assert sorted(got) == want, rank


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
        assert set(flat.groups) == {"ring"}
        assert all(m.crosses_nodes for step in flat.schedule() for m in step.messages)
    single_node = _plan(4, 4, 0)
    assert set(single_node.groups) == {"inner", "inner_dq"}
    assert not single_node.groups["inner"].crosses_nodes


def test_dq_group_separate_is_for_the_flat_ring():
    assert set(_plan(8, 4, 0, double_ring=False, dq_group="separate").groups) == \
        {"ring", "ring_dq"}
    with pytest.raises(ValueError, match="applies to the flat ring"):
        _plan(8, 4, 0, dq_group="separate")


def test_resolved_options_name_the_window():
    assert _plan(8, 2, 0).resolved_options() == dict(
        double_ring=True, opt_bwd=True, dq_dtype="activation", dq_group="shared", window=2)
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
