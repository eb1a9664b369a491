"""``usp --ring-impl double-ring --burstengine-dkv-hop`` against USP as BurstEngine's benchmark
ran it, transcribed from its source (it needs CUDA, NCCL and flash-attn; it cannot run here):
thunlp/BurstEngine @ 426eb7ae, ``evaluation/kernel_bench/benchmark_doublering.py`` (**BD**,
``attn_impl`` with ``use_ulysses``) and its copy of InternEvo's
``internlm/model/ops/ring_flash_attn/zigzag_ring_flash_attn_with_sliding_window.py`` (**IE**,
under ``evaluation/baselines/InternEvo/``). docs/upstream/burstengine_usp.md walks through it.

BD L135-142: head-first, the Ulysses (``hp``) group is a node's ranks and the ring (``cp``)
group links the same place of every node; ring-first, the other way round. BD L147-164 hands
IE the ring group as context, inter- and intra-window group and its second copy as both dK/dV
groups, so IE runs one window (L142, L364: ``world_size // local world_size``) of W = R and
then, after the window, the hop meant for the next window (L410-414) on that same dK/dV group.

Each transcription lists every message of one rank: phase, kernels done when it is posted and
when it is awaited, cpbench's name for its group, dtype and bytes. They are held against
cpbench's declared ``schedule()`` (every rank, several meshes) and, in the multirank test,
against a traced run (dtypes, bytes, group members, kernels before each post), with the check
that the hop hands each rank its ring predecessor's dK/dV.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from burstengine_bodies import usp_as_run
from rankpool import run_ranks
from schedule_helpers import plan

from cpbench.config import AttentionConfig

ACT = {"bf16": ("bfloat16", 2), "fp32": ("float32", 4)}


def burstengine_usp(world: int, rpn: int, head_first: bool, b: int, s: int, h: int, hk: int,
                    d: int, dtype: str) -> list[tuple]:
    """One rank's messages: (phase, posted, awaited, group, dtype, bytes); posted / awaited in
    kernels done before. An all-to-all sends (u-1)/u of its input (the rest stays)."""
    act, elt = ACT[dtype]
    u, r = (rpn, world // rpn) if head_first else (world // rpn, rpn)  # BD L135-142
    tokens = s // world  # BD L313-325: every rank holds S/N tokens of every head
    q = b * tokens * h * d * elt
    kv = b * tokens * hk * d * elt

    def a2a(phase, at, nbytes):
        return (phase, at, at, "ulysses", act, nbytes * (u - 1) // u)

    # in the ring: S/R tokens of h/u (hk/u) heads; K, V, dK, dV one send_recv each
    ring_kv = b * (s // r) * (hk // u) * d
    hops = [a2a("fwd", 0, q), a2a("fwd", 0, kv), a2a("fwd", 0, kv)]  # BD L144-146
    # IE forward, one window (L141-163): K and V before each kernel but the last (L61-64),
    # awaited after it (L90-93), on the ring group
    hops += [("fwd", i, i + 1, "inner", act, ring_kv * elt) for i in range(r - 1)] * 2
    hops += [a2a("fwd", r, q)]  # out, BD L165-170
    hops += [a2a("bwd", 0, q)]  # dout: the backward of out's all-to-all (BD L75-84)
    # IE backward, one window (L363-408, no K/V to a next window, L376): K and V as forward
    # (L234-237, L270-273); dK and dV after every kernel on the dK/dV group (L275-277), fp32
    # (L241-243), awaited after the next kernel (L259-261), the last at once (L279)
    hops += [("bwd", i, i + 1, "inner", act, ring_kv * elt) for i in range(r - 1)] * 2
    hops += [("bwd", i + 1, i + 1 + (i + 1 < r), "inner_dkv", "float32", ring_kv * 4)
             for i in range(r)] * 2
    # the window returns its sums cast (L281); the hop to "the next window" goes on the same
    # dK/dV group (L410-412), awaited at once (L414)
    hops += [("bwd", r, r, "inner_dkv", act, ring_kv * elt)] * 2
    hops += [a2a("bwd", r, q), a2a("bwd", r, kv), a2a("bwd", r, kv)]  # dq, dk, dv
    return hops


def declared(st) -> Counter:
    """(phase, posted, awaited, group, bytes) of every declared message, counted in kernels
    done: a step's messages go before its kernel, ``after_compute`` ones after it; awaited
    ``overlap_steps`` kernels later, or at once when exposed."""
    out, done = Counter(), {"fwd": 0, "bwd": 0}
    for step in st.schedule():
        for m in step.messages:
            post = done[step.phase] + (m.after_compute and step.block is not None)
            out[(step.phase, post, post + (m.overlap_steps if m.overlapped else 0), m.group,
                 m.nbytes)] += 1
        done[step.phase] += step.block is not None
    return out


def without_dtype(hops) -> Counter:
    return Counter((p, post, wait, g, nb) for p, post, wait, g, _, nb in hops)


MESHES = [(4, 2, True), (4, 2, False), (8, 2, True), (8, 4, False), (16, 4, True)]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("world,rpn,head_first", MESHES)
def test_the_schedule_is_burstengines(world, rpn, head_first, dtype):
    b, s, h, hk, d = 2, 32 * world, 8, 4, 16  # K/V heads: BurstEngine's all-to-all needs u | hk
    want = without_dtype(burstengine_usp(world, rpn, head_first, b, s, h, hk, d, dtype))
    for rank in range(world):
        st = plan("usp", world, rpn, rank,
                  AttentionConfig(batch=b, seqlen=s, heads=h, kv_heads=hk, head_dim=d,
                                  dtype=dtype),
                  placement="head-first" if head_first else "ring-first",
                  ring_impl="double-ring", burstengine_dkv_hop=True)
        assert declared(st) == want, rank


def _bytes(hops, phase, op_groups, dtype=None) -> int:
    return sum(nb for p, _, _, g, dt, nb in hops
               if p == phase and g in op_groups and dtype in (None, dt))


def test_the_hop_at_128k_on_4x8_is_what_the_issue_counts():
    """Seed 001's USP head-first case (BurstEngine's bench_usp.sh: 40 heads of 128, bf16,
    batch 1) at 128K on 4 x 8: the hop moves 2 x 41.9 MB per rank per backward, 9.1 % on top
    of the ring's backward p2p bytes, across nodes, exposed, on the dK/dV group."""
    hops = burstengine_usp(32, 8, True, 1, 131072, 40, 40, 128, "bf16")
    hop = [x for x in hops if x[0] == "bwd" and x[3] == "inner_dkv" and x[4] == "bfloat16"]
    assert [x[5] for x in hop] == [32768 * 5 * 128 * 2] * 2 == [41_943_040] * 2
    ring = _bytes(hops, "bwd", ("inner", "inner_dkv")) - sum(x[5] for x in hop)
    assert ring == 3 * 2 * 41_943_040 + 4 * 2 * 83_886_080  # K/V bf16, dK/dV fp32
    assert 2 * 41_943_040 / ring == pytest.approx(0.0909, abs=5e-4)
    st = plan("usp", 32, 8, 0, AttentionConfig(batch=1, seqlen=131072, heads=40,
                                                head_dim=128, dtype="bf16"),
              ring_impl="double-ring", burstengine_dkv_hop=True)
    last = [s for s in st.schedule() if s.phase == "bwd"][-2]  # before the all-to-alls
    assert last.block is None and [(m.group, m.nbytes, m.overlapped, m.crosses_nodes)
                                   for m in last.messages] == [("inner_dkv", 41_943_040,
                                                                False, True)] * 2
    plain = plan("usp", 32, 8, 0, st.attn, ring_impl="double-ring", ring_window=4)
    assert declared(st) - declared(plain) == Counter({("bwd", 4, 4, "inner_dkv",
                                                       41_943_040): 2})


def test_the_option_sets_up_burstengines_ring_or_refuses():
    attn = AttentionConfig(batch=1, seqlen=256, heads=8, head_dim=16)
    st = plan("usp", 8, 2, 0, attn, ring_impl="double-ring", burstengine_dkv_hop=True)
    # one window over the ring of 4 (0, 2, 4, 6), though it crosses nodes: no outer ring
    assert (st.ulysses_degree, st.ring_degree, st.ring.window) == (2, 4, 4)
    assert {n: g.ranks for n, g in st.groups.items()} == {
        "ulysses": (0, 1), "inner": (0, 2, 4, 6), "inner_dkv": (0, 2, 4, 6)}
    assert plan("usp", 8, 2, 0, attn, ring_impl="double-ring", ring_window=4,
                burstengine_dkv_hop=True).ring.window == 4
    # u = N: no ring, nothing to hop (upstream's ring of one sends to itself)
    alone = plan("usp", 8, 2, 0, attn, ring_impl="double-ring", ulysses_degree=8,
                 burstengine_dkv_hop=True)
    assert alone.ring is None and all(m.group == "ulysses" for s in alone.schedule()
                                      for m in s.messages)
    with pytest.raises(ValueError, match="add --ring-impl double-ring"):
        plan("usp", 8, 2, 0, attn, burstengine_dkv_hop=True)
    with pytest.raises(ValueError, match="drop --ring-window or give 4"):
        plan("usp", 8, 2, 0, attn, ring_impl="double-ring", ring_window=2,
             burstengine_dkv_hop=True)


# -- measured: a traced run and the float64 check (multirank) ------------------------------------

def _members(group: str, rank: int, world: int, rpn: int) -> tuple[int, ...]:
    """Head-first: Ulysses groups are a node's ranks, the ring the same place of each node."""
    if group == "ulysses":
        return tuple(range(rank // rpn * rpn, rank // rpn * rpn + rpn))
    return tuple(range(rank % rpn, world, rpn))


@pytest.mark.multirank
def test_a_run_sends_what_burstengine_sends_and_fails_the_check_as_it_would():
    """8 ranks, 4 nodes x 2, head-first: Ulysses pairs, rings of 4 across nodes (so a rank's
    predecessor is not its successor). Every message each rank posts (dtype, bytes, group
    members, kernels before it) equals the transcription's; what it sends equals its declared
    schedule. The float64 check FAILS on dk and dv only, and each rank's dK / dV are exactly
    those its ring predecessor gets without the hop (same double ring, window 4): the hop
    hands them on (IE L410-414 with BD L161-162's groups), nothing else is wrong. And
    ``--ring-window 2`` (two windows of the ring of 4) passes the check."""
    world, rpn = 8, 2
    attn = AttentionConfig(batch=1, seqlen=128, heads=4, kv_heads=2, head_dim=16, dtype="bf16")
    found = run_ranks(usp_as_run, world, rpn, attn, timeout=300)
    hops = burstengine_usp(world, rpn, True, 1, 128, 4, 2, 16, "bf16")
    op = {"ulysses": "all_to_all_single", "inner": "p2p", "inner_dkv": "p2p"}
    for rank, got in enumerate(found):
        assert got["sent"] == got["declared"], rank
        assert got["segments"] == got["declared_segments"], rank
        want = Counter((p, post, op[g], dt, nb, _members(g, rank, world, rpn))
                       for p, post, _, g, dt, nb in hops)
        assert got["posts"] == want, rank
        # the check's verdict, as it honestly is: upstream's defect, reproduced
        assert got["verdict"] == {"out": True, "lse": True, "dq": True, "dk": False,
                                  "dv": False}, rank
        assert got["windowed"] == (2, 2, True), rank  # --ring-window 2: two windows, exact
        before = (rank - rpn) % world  # the ring predecessor (ring = same place, every node)
        for name in ("dk", "dv"):
            assert np.array_equal(got["hop"][name], found[before]["plain"][name]), (rank, name)
            assert not np.array_equal(got["hop"][name], got["plain"][name])
