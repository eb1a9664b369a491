"""megatron-cp's declared schedule against hand-computed bytes and FLOPs (no processes)."""

from __future__ import annotations

import pytest
from schedule_helpers import plan, step_bytes

from cpbench.config import AttentionConfig
from cpbench.strategies.base import BWD, FWD
from cpbench.strategies.megatron_cp import _bwd_src, _fwd_src


def _plan(attn, world, rpn, rank, cp_lists=None):
    return plan("megatron-cp", world, rpn, rank, attn, cp_lists=cp_lists)


@pytest.mark.parametrize("b,seqlen,h,hk,d,dtype,elt,world", [
    (2, 96, 4, 2, 16, "bf16", 2, 4),
    (1, 256, 8, None, 64, "fp32", 4, 8),
    (2, 96, 4, 2, 16, "fp16", 2, 2),
])
def test_bytes(b, seqlen, h, hk, d, dtype, elt, world):
    attn = AttentionConfig(batch=b, seqlen=seqlen, heads=h, kv_heads=hk, head_dim=d,
                           dtype=dtype, causal=True)
    n, s = world, seqlen // world
    kv = 2 * b * s * (hk or h) * d * elt  # K and V packed, activation dtype
    for rank in range(world):
        st = _plan(attn, world, 2, rank)
        # forward: N-1 hops of the packed K/V
        assert step_bytes(st, FWD) == [kv] * (n - 1) + [0]
        # backward: K/V only, then K/V + dK/dV (activation dtype, same size), then dK/dV only
        assert step_bytes(st, BWD) == [kv] + [2 * kv] * (n - 2) + [kv]
        assert sum(step_bytes(st, BWD)) == (n - 1) * 2 * kv
        # one message per step at most, all hidden behind that step's tile
        assert all(len(s.messages) <= 1 and all(m.overlapped for m in s.messages)
                   for s in st.schedule())


def test_bytes_example():
    # b=2, s_local=24, hk=2, d=16, bf16: K+V = 2*(2*24*2*16*2) = 6144 bytes
    attn = AttentionConfig(batch=2, seqlen=96, heads=4, kv_heads=2, head_dim=16, dtype="bf16")
    st = _plan(attn, 4, 2, 2)
    assert sum(step_bytes(st, FWD)) == 3 * 6144
    assert sum(step_bytes(st, BWD)) == 6144 + 2 * 12288 + 6144


def test_crosses_nodes():
    attn = AttentionConfig(batch=1, seqlen=64, heads=4, head_dim=8, dtype="bf16")
    assert all(m.crosses_nodes for s in _plan(attn, 4, 2, 0).schedule() for m in s.messages)
    assert not any(m.crosses_nodes for s in _plan(attn, 4, 4, 0).schedule() for m in s.messages)
    # inside rings of a bigger job (as a hierarchical a2a+p2p strategy would run it)
    st = _plan(attn, 8, 4, 5, cp_lists=[[0, 4], [1, 5], [2, 6], [3, 7]])
    assert st.cp_size == 2 and st.cp_index(5) == 1
    assert all(m.crosses_nodes for s in st.schedule() for m in s.messages)
    st = _plan(attn, 8, 4, 5, cp_lists=[[0, 1, 2, 3], [4, 5, 6, 7]])
    assert not any(m.crosses_nodes for s in st.schedule() for m in s.messages)
    assert sum(step_bytes(st, FWD)) == 3 * 2 * (1 * 16 * 4 * 8 * 2)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_ring_directions(n):
    for me in range(n):
        # forward starts on the own (diagonal) block, backward ends on it, from the other side
        assert _fwd_src(me, 0, n) == me and _bwd_src(me, n - 1, n) == me
        assert _bwd_src(me, 0, n) == _fwd_src(me, n - 1, n)  # where the forward stopped
        for step in range(n - 1):
            # the next step's block is the neighbour's current one: previous rank in forward,
            # next rank in backward
            assert _fwd_src(me, step + 1, n) == _fwd_src((me - 1) % n, step, n)
            assert _bwd_src(me, step + 1, n) == _bwd_src((me + 1) % n, step, n)
