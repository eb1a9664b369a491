"""usp's (and megatron-cp-a2a+p2p's) declared schedule against hand-computed volumes: the
Ulysses all-to-alls plus the ring strategy's K/V ring on heads/u; node crossing per placement;
the default degree and the errors for impossible splits. No processes."""

from __future__ import annotations

import pytest
from schedule_helpers import build, totals

from cpbench.strategies.usp import Usp
from cpbench.topology import Topology


def _build(world, rpn, rank=0, name="usp", **kw):
    return build(name, world, rpn, rank, **kw)


def _totals(st):
    return totals(st, ("phase", "op", "group"))


def _ulysses_bytes(b, S, h, kv_total, d, elt, n, u):
    """Per rank: it holds s = S/N tokens of every head; each all-to-all keeps 1/u at home."""
    s = S // n
    q = (u - 1) * b * s * h * d * elt // u
    kv = (u - 1) * 2 * b * s * kv_total * d * elt // u
    return {"fwd": q + kv + q, "bwd": q + q + kv}  # q, k, v, out; dout, dq, dk, dv


def _ring_bytes(b, S, kv_heads_ring, d, elt, r):
    """Ring/zigzag over R positions, each holding S/R tokens of heads/u heads: R-1 K/V hops in
    each pass, R dK/dV hops (fp32) in backward on the same group (as ring-flash-attn)."""
    block = 2 * b * (S // r) * kv_heads_ring * d
    return {"fwd": (r - 1) * block * elt, "bwd": (r - 1) * block * elt, "dkv": r * block * 4}


def _ring_totals(ring):
    return {("fwd", "p2p", "ring"): ring["fwd"],
            ("bwd", "p2p", "ring"): ring["bwd"] + ring["dkv"]}


@pytest.mark.parametrize("ring_impl", ["ring", "zigzag"])
@pytest.mark.parametrize("kv_heads,kv_total", [(None, 8), (2, 4), (1, 4)])
def test_bytes_hand_computed(ring_impl, kv_heads, kv_total):
    # 8 ranks = 4 (Ulysses) x 2 (ring); K/V heads after replication to a multiple of 4
    b, S, h, d, elt = 2, 64, 8, 16, 2
    st = _build(8, 4, rank=5, batch=b, seqlen=S, heads=h, kv_heads=kv_heads, head_dim=d,
                dtype="fp16", ulysses_degree=4, ring_impl=ring_impl)
    uly = _ulysses_bytes(b, S, h, kv_total, d, elt, n=8, u=4)
    ring = _ring_bytes(b, S, kv_total // 4, d, elt, r=2)
    assert _totals(st) == {("fwd", "a2a", "ulysses"): uly["fwd"],
                           ("bwd", "a2a", "ulysses"): uly["bwd"], **_ring_totals(ring)}
    if kv_heads is None and ring_impl == "ring":  # the numbers, once
        assert uly == {"fwd": 3 * 2 * 8 * 8 * 16 * 2 // 4 * 4,  # q, k, v, out (no lse)
                       "bwd": 3 * 2 * 8 * 8 * 16 * 2 // 4 * 4}
        assert ring == {"fwd": 2 * 2 * 32 * 2 * 16 * 2, "bwd": 8192, "dkv": 2 * 8192 * 2}


def test_pure_ring_and_pure_ulysses_ends():
    b, S, h, d, elt = 1, 64, 8, 8, 4
    ring_only = _build(8, 4, batch=b, seqlen=S, heads=h, head_dim=d, ulysses_degree=1,
                       ring_impl="ring")
    ring = _ring_bytes(b, S, h, d, elt, r=8)
    assert _totals(ring_only) == _ring_totals(ring)
    uly_only = _build(8, 4, batch=b, seqlen=S, heads=h, head_dim=d, ulysses_degree=8)
    assert uly_only.ring is None and set(uly_only.groups) == {"ulysses"}
    uly = _ulysses_bytes(b, S, h, h, d, elt, n=8, u=8)
    assert _totals(uly_only) == {("fwd", "a2a", "ulysses"): uly["fwd"],
                                 ("bwd", "a2a", "ulysses"): uly["bwd"]}


@pytest.mark.parametrize("placement,uly_crosses,ring_crosses",
                         [("head-first", False, True), ("ring-first", True, False)])
def test_node_crossing_by_placement(placement, uly_crosses, ring_crosses):
    for rank in range(8):
        st = _build(8, 4, rank=rank, batch=1, seqlen=64, heads=8, head_dim=8,
                    ulysses_degree=4, placement=placement)
        for step in st.schedule():
            for m in step.messages:
                want = {"ulysses": uly_crosses, "ring": ring_crosses}
                assert m.crosses_nodes is want[m.group]
                if m.op == "a2a":  # the ring needs their result: nothing to hide behind
                    assert not m.overlapped


def test_flops_are_the_ring_strategys_on_heads_over_u():
    st = _build(8, 4, batch=1, seqlen=64, heads=8, head_dim=16, ulysses_degree=4,
                ring_impl="zigzag", causal=True)
    # zigzag balances: every step is half a (S/R)^2 block; R steps; heads/u heads
    s_ring, hu = 64 // 2, 8 // 4
    fwd = 2 * (4 * 1 * s_ring * s_ring * hu * 16 / 2)
    assert sum(s.flops for s in st.schedule() if s.phase == "fwd") == fwd
    assert [s.index for s in st.schedule() if s.phase == "bwd"] == [0, 1, 2, 3]


def test_double_ring_inside_usp():
    # 2-way Ulysses inside a node leaves rings [0,2,4,6]... with 2 members per node
    st = _build(8, 4, rank=2, batch=1, seqlen=64, heads=8, head_dim=8, ulysses_degree=2,
                ring_impl="double-ring")
    assert st.groups["inner"].ranks == (0, 2) and not st.groups["inner"].crosses_nodes
    assert st.groups["outer"].ranks == (2, 6) and st.groups["outer"].crosses_nodes
    assert st.ring.attn.heads == 4


def test_default_degree():
    def default(heads, world, rpn):
        return _build(world, rpn, batch=1, seqlen=8 * world, heads=heads, head_dim=8,
                      ulysses_degree=0).ulysses_degree

    assert default(heads=32, world=16, rpn=8) == 8
    assert default(heads=4, world=8, rpn=8) == 4
    assert default(heads=6, world=8, rpn=4) == 2
    assert default(heads=8, world=8, rpn=1) == 1
    st = _build(8, 2, batch=1, seqlen=64, heads=8, head_dim=8)
    assert (st.ulysses_degree, st.ring_degree, st.ring_impl) == (2, 4, "zigzag")
    assert st.resolved_options() == dict(ulysses_degree=2, ring_degree=4,
                                         placement="head-first", ring_impl="zigzag")


@pytest.mark.parametrize("name", ["usp", "megatron-cp-a2a+p2p"])
def test_default_degree_stays_in_a_node(name):
    # 3 divides 12 ranks and 6 heads, but a group of 3 on nodes of 4 straddles [3, 4, 5]
    for rank in range(12):
        st = _build(12, 4, rank, name=name, batch=1, seqlen=96, heads=6, head_dim=8)
        assert st.ulysses_degree == 2 and st.ring_degree == 6
        assert not st.groups["ulysses"].crosses_nodes


def test_resolved_options_of_the_ring_inside():
    st = _build(8, 4, rank=2, batch=1, seqlen=64, heads=8, head_dim=8, ulysses_degree=2,
                ring_impl="double-ring")
    assert st.resolved_options() == dict(ulysses_degree=2, ring_degree=4,
                                         placement="head-first", ring_impl="double-ring",
                                         ring_options={"window": 2})
    a2a = _build(8, 4, name="megatron-cp-a2a+p2p", batch=1, seqlen=64, heads=8, head_dim=8)
    assert a2a.resolved_options() == {"a2a_degree": 4, "p2p_degree": 2}


def test_impossible_splits():
    with pytest.raises(ValueError, match="ulysses degree 3 must divide 8 ranks and 8 heads; "
                                         "these do: 1, 2, 4 or 8$"):
        _build(8, 4, batch=1, seqlen=64, heads=8, head_dim=8, ulysses_degree=3)
    with pytest.raises(ValueError, match="these do: 1, 2 or 4$"):
        _build(8, 4, batch=1, seqlen=64, heads=4, head_dim=8, ulysses_degree=8)
    with pytest.raises(ValueError, match="try --seqlen 64"):
        _build(8, 4, batch=1, seqlen=60, heads=8, head_dim=8)
    with pytest.raises(ValueError, match="zigzag"):  # the ring strategy's own check (2R chunks)
        _build(8, 1, batch=1, seqlen=8, heads=8, head_dim=8, ulysses_degree=1)


def test_variants_are_modest_and_distinct():
    for world, rpn in ((2, 1), (4, 2), (8, 4), (8, 2), (32, 8)):
        vs = Usp.variants(Topology(world_size=world, ranks_per_node=rpn))
        assert len(vs) == len(set(vs)) <= 5
        assert Usp.Options() in vs


def test_a2a_p2p_is_head_first_over_megatron_cp():
    b, S, h, d, elt = 1, 64, 8, 8, 2
    st = _build(8, 4, rank=6, name="megatron-cp-a2a+p2p", batch=b, seqlen=S, heads=h,
                head_dim=d, dtype="bf16")
    assert st.ring_impl == "megatron-cp" and st.ulysses_degree == 4
    assert st.groups["ulysses"].ranks == (4, 5, 6, 7) and not st.groups["ulysses"].crosses_nodes
    assert st.groups["ring"].ranks == (2, 6) and st.groups["ring"].crosses_nodes
    uly = _ulysses_bytes(b, S, h, h, d, elt, n=8, u=4)
    tot = _totals(st)
    assert tot[("fwd", "a2a", "ulysses")] == uly["fwd"]
    assert tot[("bwd", "a2a", "ulysses")] == uly["bwd"]
    # TE's forward ring: R-1 hops of packed K/V for heads/u heads
    assert tot[("fwd", "p2p", "ring")] == (2 - 1) * 2 * b * (S // 2) * (h // 4) * d * elt
    with pytest.raises(ValueError, match="ulysses degree 3 must divide 8 ranks.*these do"):
        _build(8, 4, name="megatron-cp-a2a+p2p", batch=1, seqlen=64, heads=8, head_dim=8,
               a2a_degree=3)


def test_a2a_p2p_differs_from_usp_where_te_does():
    kw = dict(batch=1, seqlen=64, heads=8, kv_heads=2, head_dim=8)
    usp, te = _build(8, 4, rank=6, **kw), _build(8, 4, rank=6, name="megatron-cp-a2a+p2p", **kw)
    # TE cannot split 2 K/V heads 4 ways (context_parallel.py v2.18 L463-468): A = 2
    assert (usp.ulysses_degree, te.ulysses_degree) == (4, 2)
    # layout: usp cuts its ring position's zigzag set in pieces; TE gives cp_rank 6 of 8
    # chunks 6 and 9 of 16 (DualChunkSwap, L4956-5012)
    assert te.seq_index(6).tolist() == [24, 25, 26, 27, 36, 37, 38, 39]
    # TE needs 2 chunks per rank (L1569-1571): S divisible by 2N, not just by 2R
    with pytest.raises(ValueError, match="TE's zigzag"):
        _build(8, 4, name="megatron-cp-a2a+p2p", batch=1, seqlen=40, heads=8, head_dim=8,
               a2a_degree=4)


def test_ring_window_reaches_the_double_ring():
    # 2 nodes x 8, u = 2: rings of 8 ranks (0, 2, ..., 14), 4 per node; window 2 cuts each
    # into 4 windows (0, 2), (4, 6), ... linked by outer rings (2, 6, 10, 14) across nodes
    b, S, h, d = 1, 256, 8, 16
    st = _build(16, 8, rank=2, batch=b, seqlen=S, heads=h, head_dim=d, dtype="bf16",
                ulysses_degree=2, ring_impl="double-ring", ring_window=2)
    assert st.resolved_options()["ring_options"] == {"window": 2}
    assert st.groups["inner"].ranks == (0, 2) and not st.groups["inner"].crosses_nodes
    assert st.groups["outer"].ranks == (2, 6, 10, 14) and st.groups["outer"].crosses_nodes
    # R = 8 = M 4 x W 2; a K or V block: S/R tokens of h/u heads, bf16
    kv = b * (S // 8) * (h // 2) * d * 2
    circ = {"inner": 4 * (2 - 1) * 2 * kv, "outer": (4 - 1) * 2 * kv}  # K and V, both passes
    # dK/dV: W hops per window, fp32 in the first and bf16 after; M outer hops in bf16
    dkv = {"inner_dkv": 2 * 2 * 2 * kv + 3 * 2 * 2 * kv, "outer_dkv": 4 * 2 * kv}
    ring = {k: v for k, v in _totals(st).items() if k[2] != "ulysses"}
    assert ring == {**{("fwd", "p2p", g): n for g, n in circ.items()},
                    **{("bwd", "p2p", g): n for g, n in {**circ, **dkv}.items()}}
    default = _build(16, 8, rank=2, batch=b, seqlen=S, heads=h, head_dim=d, dtype="bf16",
                     ulysses_degree=2, ring_impl="double-ring")
    assert default.ring.window == 4 and _totals(default) != _totals(st)


def test_ring_window_refusals():
    kw = dict(batch=1, seqlen=256, heads=8, head_dim=16, ulysses_degree=2)
    with pytest.raises(ValueError, match="--ring-window sets up the double ring: add "
                                         "--ring-impl double-ring"):
        _build(16, 8, ring_window=2, **kw)
    with pytest.raises(ValueError, match="does not divide its ring of 8 ranks; use one of: "
                                         "1, 2, 4, 8"):
        _build(16, 8, ring_impl="double-ring", ring_window=3, **kw)
    # no ring (u = N): no window to refuse, so a sweep's --ring-window leaves this case be
    assert _build(8, 4, ring_impl="double-ring", ring_window=3,
                  **{**kw, "ulysses_degree": 8}).ring is None
    with pytest.raises(ValueError, match="--ring-window -1 does not divide"):
        _build(8, 4, ring_impl="double-ring", ring_window=-1, **{**kw, "ulysses_degree": 8})
