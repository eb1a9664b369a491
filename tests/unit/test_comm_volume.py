"""Every registered strategy's declared communication volume against closed forms worked out
by hand from the algorithms (the strategy docstrings and what each ``attention()`` sends),
written here as plain arithmetic, never through the strategies' own byte helpers.

Notation: N ranks in the CP ring, S global tokens, s = S/N tokens per rank, B batch, H query
heads, HK K/V heads, D head dim, e bytes per activation element (bf16 2, fp32 4). fp32
payloads (dK/dV and dQ partial sums, lse, delta) are 4 bytes per element whatever e is.
Each schedule is summed per rank, per phase, per (op, group); every rank is checked.
No processes: groups are planned, not created.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from schedule_helpers import volume

from cpbench import kernels, strategies
from cpbench.config import AttentionConfig
from cpbench.strategies.base import BWD, FWD
from cpbench.topology import Topology

E = {"bf16": 2, "fp32": 4}  # bytes per element, by hand
F32 = 4

PROBLEMS = {
    "mha-bf16": AttentionConfig(batch=1, seqlen=8192, heads=8, kv_heads=8, head_dim=64,
                                dtype="bf16"),
    "gqa-bf16": AttentionConfig(batch=1, seqlen=8192, heads=8, kv_heads=2, head_dim=64,
                                dtype="bf16"),
    "gqa-fp32-b2-full": AttentionConfig(batch=2, seqlen=4096, heads=8, kv_heads=2, head_dim=16,
                                        dtype="fp32", causal=False),
}
# (world, ranks per node): 2 nodes x 2, 2 nodes x 4, 4 nodes x 2
TOPOS = [(4, 2), (8, 4), (8, 2)]


# -- helpers -----------------------------------------------------------------------------------

def every_rank(name, world, rpn, attn, **opts):
    cls = strategies.get(name)
    topo = Topology(world_size=world, ranks_per_node=rpn)
    return [cls(attn, topo, r, kernel=kernels.get("torch"), options=cls.Options(**opts),
                create_groups=False) for r in range(world)]


def crossing(st) -> dict[str, bool]:
    """Group → the crosses_nodes flag its messages carry (one flag per group)."""
    flags = {}
    for step in st.schedule():
        for m in step.messages:
            assert flags.setdefault(m.group, m.crosses_nodes) == m.crosses_nodes, m
    return flags


def dims(a: AttentionConfig):
    return a.batch, a.seqlen, a.heads, a.num_kv_heads, a.head_dim, E[a.dtype]


def nonzero(d: dict) -> dict:
    return {k: v for k, v in d.items() if v}


def check(strats, fwd: dict, bwd: dict):
    for st in strats:
        assert volume(st, FWD) == nonzero(fwd), ("fwd", st.rank)
        assert volume(st, BWD) == nonzero(bwd), ("bwd", st.rank)


# -- closed forms shared by several strategies (mine, not the strategies') ---------------------

def kv_ring(n, kv, dkv, dkv_group="ring"):
    """ring-flash-attn's K/V ring over n positions. Forward: K and V (kv bytes together) take
    n-1 hops (the last step sends nothing). Backward: K/V again n-1 hops on "ring"; each
    block's dK/dV (fp32, dkv bytes) follows one hop behind and takes n hops to get home, so n
    sends per rank; on the same group, as ring-flash-attn (``dkv_group``: where it travels)."""
    if dkv_group == "ring":
        return ({("p2p", "ring"): (n - 1) * kv},
                {("p2p", "ring"): (n - 1) * kv + (n * dkv if n > 1 else 0)})
    return ({("p2p", "ring"): (n - 1) * kv},
            {("p2p", "ring"): (n - 1) * kv, ("p2p", dkv_group): n * dkv if n > 1 else 0})


def two_level(n, w, block):
    """LoongTrain's double ring (Burst-Attention's moves blocks the same way): n = m·w
    positions, m windows of w. A circulating block takes w-1 inner hops per window (m
    windows) and m-1 outer hops: n-1 hops in all."""
    m = n // w
    return {("p2p", "inner"): m * (w - 1) * block, ("p2p", "outer"): (m - 1) * block}


def loongtrain_dkv(n, w, first, later):
    """LoongTrain's dK/dV partial sums going home (InternEvo
    zigzag_ring_flash_attn_with_sliding_window.py L268-270, L313-315, L403-405): one inner
    hop after each of the n steps (if w > 1), one outer hop after every window, the last
    bringing them home (m hops, if m > 1). ``first``: bytes of an inner hop in the first
    window (fp32, L234-236); ``later``: every other hop (the activation dtype: upstream casts
    each window's sums before they cross, L274, L354)."""
    m = n // w
    return {("p2p", "inner_dkv"): w * first + (n - w) * later if w > 1 else 0,
            ("p2p", "outer_dkv"): m * later if m > 1 else 0}


def burst_dq(n, w, dq):
    """Burst-Attention's dQ going home over a double ring (burst_attn_interface.py L300-302,
    L393-396; comm.py double_ring_send_recv_q L187-218): before each step's kernel but the
    first, the previous step's sum moves on, across nodes at a window's first step, else
    inside the node; after the last step one outer hop, then one inner hop home. Per rank:
    m(w-1)+1 inner and m outer hops (not w inner hops per window: the window's last sum goes
    straight across from the rank that computed it)."""
    m = n // w
    return {("p2p", "inner_dq"): (m * (w - 1) + 1) * dq if w > 1 else 0,
            ("p2p", "outer_dq"): m * dq if m > 1 else 0}


def ulysses_a2a(u, B, s, H, KVH, D, e):
    """Per-rank bytes of the Ulysses all-to-alls in a group of u: a rank holds s tokens of all
    heads and sends the (H/u or KVH/u)-head chunk of each tensor to each of its u-1 peers.
    Forward: q, k, v, then out; backward: dout, then dq, dk, dv, as upstream sends them
    (yunchang 0.6.4 hybrid/attn_layer.py LongContextAttention.forward: SeqAllToAll4D of
    query, key, value, then of the output; the lse is never sent on the timed path)."""
    q = B * s * (H // u) * D * e
    kv = 2 * B * s * (KVH // u) * D * e  # k and v, one all-to-all each
    return (u - 1) * (q + kv + q), (u - 1) * (q + q + kv)


# -- ring, zigzag --------------------------------------------------------------------------------

@pytest.mark.parametrize("prob", PROBLEMS)
@pytest.mark.parametrize("world,rpn", TOPOS)
@pytest.mark.parametrize("name", ["ring", "zigzag"])
def test_ring_and_zigzag(name, world, rpn, prob):
    B, S, H, HK, D, e = dims(PROBLEMS[prob])
    N, s = world, S // world
    # ring's causal skip of future blocks skips compute, not the K/V hop: bytes as zigzag's
    fwd, bwd = kv_ring(N, kv=2 * B * s * HK * D * e, dkv=2 * B * s * HK * D * F32)
    strats = every_rank(name, world, rpn, PROBLEMS[prob])
    check(strats, fwd, bwd)
    assert all(crossing(st) == {"ring": True} for st in strats)
    # the variant: dK/dV on a group of their own (same members), both rings in flight at once
    fwd, bwd = kv_ring(N, kv=2 * B * s * HK * D * e, dkv=2 * B * s * HK * D * F32,
                       dkv_group="ring_dkv")
    check(every_rank(name, world, rpn, PROBLEMS[prob], dkv_group="separate"), fwd, bwd)


# -- megatron-cp ---------------------------------------------------------------------------------

@pytest.mark.parametrize("prob", PROBLEMS)
@pytest.mark.parametrize("world,rpn", TOPOS)
def test_megatron_cp(world, rpn, prob):
    B, S, H, HK, D, e = dims(PROBLEMS[prob])
    N, s = world, S // world
    kv = 2 * B * s * HK * D * e
    # TE v2.18 context_parallel.py: forward K/V packed in one buffer (L1690), N-1 hops
    # (L1705-1715). Backward (reverse ring, one message per step, all in the activation dtype,
    # L2397-2400): step 0 K/V only, steps 1..N-2 K/V + dK/dV of the block before, step N-1
    # dK/dV only (L2487-2492): kv + (N-2)·2kv + kv = 2(N-1)·kv
    check(every_rank("megatron-cp", world, rpn, PROBLEMS[prob]),
          {("p2p", "ring"): (N - 1) * kv},
          {("p2p", "ring"): 2 * (N - 1) * kv})


# -- double-ring ---------------------------------------------------------------------------------

@pytest.mark.parametrize("prob", PROBLEMS)
@pytest.mark.parametrize("world,rpn,window,w", [
    (4, 2, 0, 2), (8, 4, 0, 4), (8, 2, 0, 2),  # default: ranks per node
    (8, 4, 2, 2), (8, 4, 1, 1), (8, 4, 8, 8),  # two windows per node; outer only; inner only
])
def test_double_ring(world, rpn, window, w, prob):
    B, S, H, HK, D, e = dims(PROBLEMS[prob])
    N, s = world, S // world
    kv, dkv = 2 * B * s * HK * D * e, 2 * B * s * HK * D * F32
    circ = two_level(N, w, kv)  # K/V circulate both passes; dK/dV go home
    strats = every_rank("double-ring", world, rpn, PROBLEMS[prob], window=window)
    check(strats, circ, {**circ, **loongtrain_dkv(N, w, dkv, kv)})
    # the variant: every dK/dV hop in fp32
    check(every_rank("double-ring", world, rpn, PROBLEMS[prob], window=window,
                     dkv_dtype="fp32"), circ, {**circ, **loongtrain_dkv(N, w, dkv, dkv)})
    # inner rings are w consecutive ranks: inside a node iff w <= ranks per node; every outer
    # ring here links windows on different nodes
    want = {"inner": w > rpn, "inner_dkv": w > rpn} if w > 1 else {}
    if w < N:
        want |= {"outer": True, "outer_dkv": True}
    assert all(crossing(st) == want for st in strats)


# -- burst ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("prob", PROBLEMS)
@pytest.mark.parametrize("world,rpn", TOPOS)
@pytest.mark.parametrize("double_ring", [True, False])
@pytest.mark.parametrize("opt_bwd", [True, False])
@pytest.mark.parametrize("dq_dtype", ["activation", "fp32"])
def test_burst(world, rpn, double_ring, opt_bwd, dq_dtype, prob):
    B, S, H, HK, D, e = dims(PROBLEMS[prob])
    N, s = world, S // world
    kv = 2 * B * s * HK * D * e
    # backward bundle (burst_attn_interface.py L288, L296-298): delta (fp32 per token and
    # head, like lse) with opt_bwd, else out (an activation), then dout, q, lse
    row, act = B * H * s * F32, B * s * H * D * e
    bundle = row + act + act + (row if opt_bwd else act)
    # dQ partial sums in the activation dtype, as upstream (dq = zeros_like(q), L261)
    dq = B * s * H * D * (F32 if dq_dtype == "fp32" else e)
    strats = every_rank("burst", world, rpn, PROBLEMS[prob], double_ring=double_ring,
                        opt_bwd=opt_bwd, dq_dtype=dq_dtype)
    if double_ring:  # windows of a node's ranks (every topology here has >= 2 nodes)
        fwd = two_level(N, rpn, kv)
        bwd = {**two_level(N, rpn, bundle), **burst_dq(N, rpn, dq)}
        want_cross = {"inner": False, "outer": True, "inner_dq": False, "outer_dq": True}
    else:  # one flat ring: the query bundle like K/V in forward, dQ home in N hops on the
        # same communicator (upstream's dq Ring is built on the bundle's group, L265-267)
        fwd = {("p2p", "ring"): (N - 1) * kv}
        bwd = {("p2p", "ring"): (N - 1) * bundle + N * dq}
        want_cross = {"ring": True}
        separate = every_rank("burst", world, rpn, PROBLEMS[prob], double_ring=False,
                              opt_bwd=opt_bwd, dq_dtype=dq_dtype, dq_group="separate")
        check(separate, fwd, {("p2p", "ring"): (N - 1) * bundle, ("p2p", "ring_dq"): N * dq})
    check(strats, fwd, bwd)
    assert all(crossing(st) == want_cross for st in strats)


# -- ulysses -------------------------------------------------------------------------------------

@pytest.mark.parametrize("prob", PROBLEMS)
@pytest.mark.parametrize("world,rpn", TOPOS)
def test_ulysses(world, rpn, prob):
    B, S, H, HK, D, e = dims(PROBLEMS[prob])
    N, s = world, S // world
    # GQA: K/V heads are replicated until their count divides N (8 heads, 2 K/V heads on 8
    # ranks: 8 K/V heads; on 4 ranks: 4)
    KVH = math.lcm(HK, N)
    fwd, bwd = ulysses_a2a(N, B, s, H, KVH, D, e)
    strats = every_rank("ulysses", world, rpn, PROBLEMS[prob])
    check(strats, {("a2a", "ulysses"): fwd}, {("a2a", "ulysses"): bwd})
    for st in strats:  # 4 all-to-alls forward (q, k, v, out), 4 backward (dout, dq, dk, dv)
        n_msgs = Counter(s.phase for s in st.schedule() for _ in s.messages)
        assert n_msgs == {FWD: 4, BWD: 4}
        assert crossing(st) == {"ulysses": True}


# -- usp, megatron-cp-a2a+p2p ---------------------------------------------------------------------

def usp_expected(attn, world, u, ring_impl, window=None):
    """Ulysses all-to-alls in groups of u, then ``ring_impl`` over R = N/u positions, each
    holding S/R tokens of H/u heads and KVH/u K/V heads (KVH after replication)."""
    B, S, H, HK, D, e = dims(attn)
    N, R = world, world // u
    s, s_ring = S // N, S // R
    KVH = math.lcm(HK, u)
    fwd, bwd = {}, {}
    if u > 1:
        a2a_fwd, a2a_bwd = ulysses_a2a(u, B, s, H, KVH, D, e)
        fwd[("a2a", "ulysses")], bwd[("a2a", "ulysses")] = a2a_fwd, a2a_bwd
    if R > 1:
        kv = 2 * B * s_ring * (KVH // u) * D * e
        dkv = 2 * B * s_ring * (KVH // u) * D * F32
        if ring_impl in ("ring", "zigzag"):
            rf, rb = kv_ring(R, kv, dkv)
        elif ring_impl == "double-ring":
            circ = two_level(R, window, kv)
            rf, rb = circ, {**circ, **loongtrain_dkv(R, window, dkv, kv)}
        else:  # megatron-cp: N-1 K/V hops forward, 2(N-1) K/V-sized messages backward
            # (TE v2.18 context_parallel.py L1705-1715, L2458-2493: all in the activation dtype)
            rf, rb = {("p2p", "ring"): (R - 1) * kv}, {("p2p", "ring"): 2 * (R - 1) * kv}
        fwd |= rf
        bwd |= rb
    return fwd, bwd


USP_CASES = [
    # world, rpn, u, placement, ring_impl, double-ring window, {group: crosses nodes}
    (4, 2, 2, "head-first", "zigzag", None, {"ulysses": False, "ring": True}),
    (4, 2, 2, "ring-first", "zigzag", None, {"ulysses": True, "ring": False}),
    (8, 4, 4, "head-first", "zigzag", None, {"ulysses": False, "ring": True}),
    (8, 4, 4, "ring-first", "zigzag", None, {"ulysses": True, "ring": False}),
    (8, 4, 1, "head-first", "zigzag", None, {"ring": True}),  # pure ring
    (8, 4, 8, "head-first", "zigzag", None, {"ulysses": True}),  # pure ulysses
    # ring (0, 2, 4, 6) on 2x4: windows (0, 2) and (4, 6) stay inside a node
    (8, 4, 2, "head-first", "double-ring", 2, {"ulysses": False, "inner": False, "outer": True}),
    (8, 2, 2, "head-first", "ring", None, {"ulysses": False, "ring": True}),
    (8, 2, 2, "ring-first", "zigzag", None, {"ulysses": True, "ring": True}),
    # ring (0, 4) on 4x2: no two members share a node, window 1 (outer rings only)
    (8, 2, 4, "head-first", "double-ring", 1, {"ulysses": True, "outer": True}),
]


@pytest.mark.parametrize("prob", PROBLEMS)
@pytest.mark.parametrize("world,rpn,u,placement,ring_impl,window,cross", USP_CASES)
def test_usp(world, rpn, u, placement, ring_impl, window, cross, prob):
    attn = PROBLEMS[prob]
    fwd, bwd = usp_expected(attn, world, u, ring_impl, window)
    strats = every_rank("usp", world, rpn, attn, ulysses_degree=u, placement=placement,
                        ring_impl=ring_impl)
    check(strats, fwd, bwd)
    for st in strats:  # the home-bound groups carry the flag of the ring they shadow
        flags = crossing(st)
        assert {g: flags[g] for g in cross} == cross
        assert all(flags[g] == flags[g.rsplit("_", 1)[0]] for g in set(flags) - set(cross))


@pytest.mark.parametrize("prob", PROBLEMS)
@pytest.mark.parametrize("world,rpn,a2a_degree,u_mha,u_gqa", [
    # 0: the largest A dividing the ranks per node, the heads and the K/V heads (TE cannot
    # replicate K/V heads: context_parallel.py v2.18 L463-468 views h as (A, h // A))
    (4, 2, 0, 2, 2), (8, 4, 0, 4, 2), (8, 2, 0, 2, 2), (8, 4, 2, 2, 2),
    (8, 4, 4, 4, 4)])  # A = 4 over 2 K/V heads: cpbench's replication (no TE run has it)
def test_megatron_cp_a2a_p2p(world, rpn, a2a_degree, u_mha, u_gqa, prob):
    attn = PROBLEMS[prob]
    u = u_mha if attn.num_kv_heads == attn.heads else u_gqa
    # usp head-first over megatron-cp: TE v2.18 sends q, k, v, then out forward (L1486-1510,
    # L2032-2049), dout, then dq, dk, dv backward (L2407-2421, L2889-2915)
    fwd, bwd = usp_expected(attn, world, u, "megatron-cp")
    strats = every_rank("megatron-cp-a2a+p2p", world, rpn, attn, a2a_degree=a2a_degree)
    check(strats, fwd, bwd)
    assert all(crossing(st) == {"ulysses": False, "ring": True} for st in strats)


# -- local ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("world,rpn", TOPOS)
def test_local_sends_nothing(world, rpn):
    for st in every_rank("local", world, rpn, PROBLEMS["gqa-bf16"]):
        assert volume(st, FWD) == {} and volume(st, BWD) == {}


@pytest.mark.parametrize("prob", PROBLEMS)
@pytest.mark.parametrize("world,rpn", TOPOS)
@pytest.mark.parametrize("stride", [0, 1])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("dkv", ["activation", "fp32"])
def test_llama3(world, rpn, stride, layout, dkv, prob):
    """K and V all-gathered (each rank's s tokens to the N-1 others) forward and again
    backward; dK/dV of the whole sequence reduce-scattered ((N-1)/N of N·s tokens) in the
    activation dtype as ring-flash-attn (llama3_flash_attn_varlen.py L194-196, L292-293),
    or fp32 under --dkv-dtype fp32. Either layout moves the same bytes; gathering in head
    chunks moves them in more messages."""
    B, S, H, HK, D, e = dims(PROBLEMS[prob])
    N, s = world, S // world
    ag = 2 * (N - 1) * B * s * HK * D * e
    rs = 2 * (N - 1) * B * s * HK * D * (F32 if dkv == "fp32" else e)
    check(every_rank("llama3", world, rpn, PROBLEMS[prob], heads_k_stride=stride,
                     layout=layout, dkv_dtype=dkv),
          {("ag", "cp"): ag}, {("ag", "cp"): ag, ("rs", "cp"): rs})


def test_every_registered_strategy_is_covered():
    covered = {"ring", "zigzag", "megatron-cp", "double-ring", "burst", "ulysses", "usp",
               "megatron-cp-a2a+p2p", "local", "llama3"}
    assert set(strategies.own_names()) == covered


# -- inter-node volume per node ------------------------------------------------------------------

def flagged_per_node(strats, rpn) -> list[int]:
    """Per node: bytes (both phases) of its ranks' messages flagged crosses_nodes."""
    out = [0] * (len(strats) // rpn)
    for st in strats:
        for step in st.schedule():
            out[st.rank // rpn] += sum(m.nbytes for m in step.messages if m.crosses_nodes)
    return out


def leaving_per_node(strats, rpn) -> list[int]:
    """Per node: bytes (both phases) that really leave it, from each message's peers: a p2p
    hop goes to the next ring member (a ring crosses each node boundary as often in either
    direction, so megatron-cp's reverse backward ring gives the same per-node total); an
    all-to-all sends an equal share to each of the other n-1 members."""
    out = [0] * (len(strats) // rpn)
    for st in strats:
        node = st.rank // rpn
        for step in st.schedule():
            for m in step.messages:
                g = st.groups[m.group]
                if m.op == "p2p":
                    out[node] += m.nbytes * (g.next_rank // rpn != node)
                else:
                    off = sum(r // rpn != node for r in g.ranks)
                    out[node] += m.nbytes * off // (g.size - 1)
    return out


def test_inter_node_volume_usp_placements():
    """2 nodes x 4, u = 4, MHA bf16. head-first: the Ulysses group is a node, the zigzag ring
    (R = 2) pairs rank r with r+4 across nodes: each node's 4 ranks send all their ring bytes
    across. ring-first: the ring pairs neighbours inside a node and the Ulysses group (0, 2, 4,
    6) spans both nodes: 2 of each rank's 3 all-to-all peers are remote."""
    attn, rpn = PROBLEMS["mha-bf16"], 4
    B, S, H, HK, D, e = dims(attn)
    u, R, s = 4, 2, S // 8
    # ring: S/R tokens of H/u = 2 query and HK/u = 2 K/V heads; per rank, both passes:
    # K/V hops forward, (R-1) backward, R fp32 dK/dV hops
    kv, dkv = 2 * B * (S // R) * (HK // u) * D * e, 2 * B * (S // R) * (HK // u) * D * F32
    ring = (R - 1) * kv + (R - 1) * kv + R * dkv
    # all-to-all chunks (H/u heads of s tokens) to u-1 peers: q, out, dout, dq; K/V twice
    # (the lse is sent for a check only, not on the timed path)
    q_c, kv_c = B * s * (H // u) * D * e, 2 * B * s * (HK // u) * D * e
    a2a = (u - 1) * (4 * q_c + 2 * kv_c)
    head = every_rank("usp", 8, rpn, attn, ulysses_degree=4, placement="head-first")
    ring_first = every_rank("usp", 8, rpn, attn, ulysses_degree=4, placement="ring-first")
    assert flagged_per_node(head, rpn) == leaving_per_node(head, rpn) == [4 * ring] * 2
    assert flagged_per_node(ring_first, rpn) == [4 * a2a] * 2
    assert leaving_per_node(ring_first, rpn) == [4 * a2a * 2 // 3] * 2


def test_inter_node_volume_double_ring_vs_zigzag():
    """2 nodes x 4, GQA bf16, forward + backward. zigzag's flat ring crosses each node
    boundary once per hop: (N-1)·kv + (N-1)·kv + N·dkv leave a node, though every rank's
    messages carry the flag (the ring crosses nodes). double-ring (window 4): only outer hops
    leave, all 4 ranks of a node taking one per pass (M-1 = 1) plus M = 2 dK/dV outer hops,
    in the activation dtype as LoongTrain's (the size of a K/V hop): 4·(kv + kv + 2·kv),
    flagged exactly."""
    attn, rpn, N = PROBLEMS["gqa-bf16"], 4, 8
    B, S, H, HK, D, e = dims(attn)
    kv, dkv = 2 * B * (S // N) * HK * D * e, 2 * B * (S // N) * HK * D * F32
    flat = every_rank("zigzag", N, rpn, attn)
    assert leaving_per_node(flat, rpn) == [(N - 1) * kv * 2 + N * dkv] * 2
    assert flagged_per_node(flat, rpn) == [rpn * ((N - 1) * kv * 2 + N * dkv)] * 2
    two = every_rank("double-ring", N, rpn, attn)
    assert flagged_per_node(two, rpn) == leaving_per_node(two, rpn) == [4 * (2 * kv + 2 * kv)] * 2
