"""zigzag's declared schedule against hand-computed bytes and FLOPs (no processes)."""

from __future__ import annotations

import pytest
from schedule_helpers import plan, totals

from cpbench.config import AttentionConfig
from cpbench.metrics import attention_flops
from cpbench.strategies.base import BWD, FWD


def _plan(attn, world, rpn, rank, cp_lists=None):
    return plan("zigzag", world, rpn, rank, attn, cp_lists=cp_lists)


def _bytes(st, phase):
    return totals(st, ("phase",))[phase]


@pytest.mark.parametrize("b,seqlen,h,hk,d,dtype,elt,world", [
    (2, 96, 4, 2, 16, "bf16", 2, 4),
    (1, 256, 8, None, 64, "fp32", 4, 8),
])
def test_bytes(b, seqlen, h, hk, d, dtype, elt, world):
    attn = AttentionConfig(batch=b, seqlen=seqlen, heads=h, kv_heads=hk, head_dim=d,
                           dtype=dtype, causal=True)
    n, s = world, seqlen // world
    kv_heads = hk or h
    for rank in range(world):
        st = _plan(attn, world, 2, rank)
        # N-1 hops of K and V in the activation dtype, forward and again in backward
        kv = (n - 1) * 2 * b * s * kv_heads * d * elt
        # N hops of dK and dV in fp32 (the last brings them home)
        dkv = n * 2 * b * s * kv_heads * d * 4
        assert _bytes(st, FWD) == kv
        assert _bytes(st, BWD) == kv + dkv
        # dK/dV on the K/V ring's group, as ring-flash-attn (both RingComms on one group)
        assert set(st.groups) == {"ring"}
        # K and V travel as two messages, as ring-flash-attn's send_recv_kv
        fwd_msgs = [m for s in st.schedule() if s.phase == FWD for m in s.messages]
        assert len(fwd_msgs) == 2 * (n - 1) and all(m.nbytes == kv // (2 * (n - 1))
                                                    for m in fwd_msgs)
        steps = st.schedule()
        assert [s.index for s in steps if s.phase == FWD] == list(range(n))
        # only the final dK/dV hop (dK and dV) is exposed
        exposed = [(s.phase, s.index) for s in steps for m in s.messages if not m.overlapped]
        assert exposed == [(BWD, n - 1)] * 2


def test_bytes_example():
    # b=2, s_local=24, hk=2, d=16, bf16: one K block is 2*24*2*16*2 = 3072 bytes
    attn = AttentionConfig(batch=2, seqlen=96, heads=4, kv_heads=2, head_dim=16, dtype="bf16")
    st = _plan(attn, 4, 2, 1)
    assert _bytes(st, FWD) == 3 * 2 * 3072
    assert _bytes(st, BWD) == 3 * 2 * 3072 + 4 * 2 * 6144


def test_crosses_nodes():
    attn = AttentionConfig(batch=1, seqlen=64, heads=4, head_dim=8, dtype="bf16")
    assert all(m.crosses_nodes for s in _plan(attn, 4, 2, 0).schedule() for m in s.messages)
    assert not any(m.crosses_nodes for s in _plan(attn, 4, 4, 0).schedule() for m in s.messages)
    # a ring inside one node of a two-node job (as a composite strategy would run it)
    st = _plan(attn, 4, 2, 3, cp_lists=[[0, 1], [2, 3]])
    assert st.cp_size == 2 and st.cp_index(3) == 1
    assert not any(m.crosses_nodes for s in st.schedule() for m in s.messages)
    assert _bytes(st, FWD) == 1 * 2 * (1 * 32 * 4 * 8 * 2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_flops_sum_to_global(world, causal):
    attn = AttentionConfig(batch=2, seqlen=16 * world, heads=4, kv_heads=2, head_dim=16,
                           dtype="bf16", causal=causal)
    g = dict(batch=2, seqlen_q=attn.seqlen, seqlen_k=attn.seqlen, heads=4, head_dim=16,
             causal=causal)
    c = attn.seqlen // (2 * world)
    full = attention_flops(batch=2, seqlen_q=2 * c, seqlen_k=2 * c, heads=4, head_dim=16,
                           causal=False)
    totals = {FWD: 0.0, BWD: 0.0}
    for rank in range(world):
        for step in _plan(attn, world, 2, rank).schedule():
            totals[step.phase] += step.flops
            mode = 1.0 if step.phase == FWD else 2.5
            # balanced: every causal step is half a full (2c x 2c) block, no rank idles
            assert step.flops == mode * (full / 2 if causal else full)
    assert totals[FWD] == attention_flops(**g, mode="fwd")
    assert totals[BWD] == attention_flops(**g, mode="bwd")
