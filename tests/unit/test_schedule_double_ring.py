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
@pytest.mark.parametrize("dkv_dtype", ["mixed", "fp32"])
def test_bytes_match_hand_formula(world, rpn, dtype, elt, dkv_dtype):
    n, w = world, rpn  # default window: ranks per node
    m = n // w
    s = S // n
    kv = 2 * B * s * HK * D * elt  # one K and one V block
    dkv32 = 2 * B * s * HK * D * 4  # their gradients, fp32
    # LoongTrain (InternEvo zigzag_ring_flash_attn_with_sliding_window.py): fp32 inside the
    # first window (L234-236), the activation dtype once a window's sums are cast to cross
    # nodes (L274, L354) and in the later windows that carry them on
    later = dkv32 if dkv_dtype == "fp32" else kv
    for rank in range(world):
        got = totals(_plan(world, rpn, rank, attn(dtype), dkv_dtype=dkv_dtype))
        assert got == {
            ("fwd", "outer"): (m - 1) * kv,  # the base block, once per window but the last
            ("fwd", "inner"): m * (w - 1) * kv,
            ("bwd", "outer"): (m - 1) * kv,
            ("bwd", "inner"): m * (w - 1) * kv,
            # dK/dV on their own groups: one outer hop and w inner hops per window
            ("bwd", "outer_dkv"): m * later,
            ("bwd", "inner_dkv"): w * dkv32 + (m - 1) * w * later,
        }, rank


def test_k_and_v_travel_as_two_messages():
    """InternEvo sends K and V (and dK and dV) with one send_recv each (L59-60, L152-153,
    L268-269, L403-404): two messages per hop, of one block each."""
    st = _plan(8, 4, 1)
    kv = B * (S // 8) * HK * D * 2
    for step in st.schedule():
        by_group = Counter(m.group for m in step.messages)
        assert all(c % 2 == 0 for c in by_group.values()), step
        for m in step.messages:
            assert m.nbytes in (kv, 2 * kv), m  # bf16 K or V; dK or dV in fp32 in window 0


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
    # (dK and dV: two messages each; InternEvo L272, L317, L407)
    assert exposed == {"inner_dkv": 4 * 2, "outer_dkv": 2}


@pytest.mark.parametrize("dkv_await,wait", [("first-kernel", 1), ("window-end", 2)])
def test_outer_dkv_hop_is_awaited_after_the_next_windows_first_kernel(dkv_await, wait):
    """LoongTrain awaits the outer dK/dV hop right after the next window's first kernel
    (InternEvo L302-303, L337-338): one kernel to hide it behind; ``window-end`` (a cpbench
    variant) gives it the whole next window."""
    st = _plan(8, 2, 3, dkv_await=dkv_await)
    outer = [(step.index, m) for step in st.schedule() if step.phase == "bwd"
             for m in step.messages if m.group == "outer_dkv"]
    assert [i for i, _ in outer] == [1, 1, 3, 3, 5, 5, 7, 7]  # after each window's last kernel
    assert all(m.after_compute for _, m in outer)
    assert [m.overlap_steps for _, m in outer if m.overlapped] == [wait] * 6


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
