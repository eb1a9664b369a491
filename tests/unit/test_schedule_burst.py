"""burst's declared schedule against hand-computed byte counts, node crossings and FLOPs
(planned groups only, no processes), plus a one-rank run against the reference."""

from __future__ import annotations

from collections import Counter

import pytest

from cpbench import kernels
from cpbench.bench.flops import attention_flops
from cpbench.config import AttentionConfig
from cpbench.strategies.burst import Burst
from cpbench.topology import Topology

B, S, H, HK, D = 2, 96, 4, 2, 16


def _attn(dtype="bf16", causal=True, seqlen=S):
    return AttentionConfig(batch=B, seqlen=seqlen, heads=H, kv_heads=HK, head_dim=D,
                           dtype=dtype, causal=causal)


def _plan(world, rpn, rank, attn=None, **opts):
    return Burst(attn or _attn(), Topology(world_size=world, ranks_per_node=rpn), rank,
                 kernel=kernels.get("torch"), options=Burst.Options(**opts),
                 create_groups=False)


def _bytes(steps):
    total = Counter()
    for step in steps:
        for m in step.messages:
            total[(step.phase, m.group)] += m.nbytes
    return total


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
        got = _bytes(_plan(world, rpn, rank, opt_bwd=opt_bwd).schedule())
        assert got == {
            ("fwd", "outer"): (m - 1) * kv,
            ("fwd", "inner"): m * (w - 1) * kv,
            # the query bundle goes the way K/V went forward; dQ one outer hop per window
            ("bwd", "outer"): (m - 1) * bundle + m * dq,
            ("bwd", "inner"): m * (w - 1) * bundle + m * w * dq,  # and w inner hops
        }, rank


@pytest.mark.parametrize("opt_bwd", [True, False])
def test_flat_ring_bytes(opt_bwd):
    n = 8
    kv, bundle, dq = _sizes(n, 2, opt_bwd)
    for rank in range(n):
        got = _bytes(_plan(n, 4, rank, double_ring=False, opt_bwd=opt_bwd).schedule())
        assert got == {("fwd", "ring"): (n - 1) * kv,
                       ("bwd", "ring"): (n - 1) * bundle + n * dq}


def test_opt_bwd_saves_o_minus_delta():
    n = 4
    on = _bytes(_plan(n, 2, 1, opt_bwd=True).schedule())
    off = _bytes(_plan(n, 2, 1, opt_bwd=False).schedule())
    per_hop = B * (S // n) * H * D * 2 - B * H * (S // n) * 4
    assert sum(off.values()) - sum(on.values()) == (n - 1) * per_hop


def test_crossings():
    for rank in range(8):
        st = _plan(8, 4, rank)
        assert st.groups["inner"].ranks == ((0, 1, 2, 3) if rank < 4 else (4, 5, 6, 7))
        for step in st.schedule():
            for msg in step.messages:
                assert msg.crosses_nodes == (msg.group == "outer")
        flat = _plan(8, 4, rank, double_ring=False)
        assert all(m.crosses_nodes for step in flat.schedule() for m in step.messages)
    single_node = _plan(4, 4, 0)
    assert set(single_node.groups) == {"inner"} and not single_node.groups["inner"].crosses_nodes


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world,rpn,double_ring", [(8, 2, True), (8, 2, False), (4, 2, True),
                                                   (1, 1, True)])
def test_flops_sum_to_the_global_problem(world, rpn, double_ring, causal):
    attn = _attn(causal=causal)
    for phase in ("fwd", "bwd"):
        total = sum(step.flops for rank in range(world)
                    for step in _plan(world, rpn, rank, attn, double_ring=double_ring).schedule()
                    if step.phase == phase)
        assert total == attention_flops(batch=B, seqlen_q=S, seqlen_k=S, heads=H, head_dim=D,
                                        causal=causal, mode=phase)


def test_validate():
    with pytest.raises(ValueError, match="try --seqlen 96"):
        _plan(8, 4, 0, _attn(seqlen=90))
