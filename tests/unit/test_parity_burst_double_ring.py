"""burst and double-ring against the schedules of the systems they are named after, which
cannot run here (CUDA, bmtrain, flash-attn), transcribed from their source:

- Burst-Attention: MayDomine/Burst-Attention @ b088c554 (the paper's official code),
  ``burst_attn/burst_attn_interface.py`` (BAI) and ``burst_attn/comm.py`` (COMM);
- LoongTrain's DoubleRing: InternEvo ``internlm/model/ops/ring_flash_attn/
  zigzag_ring_flash_attn_with_sliding_window.py`` (IE) as of InternLM/InternEvo PR #288
  (8ef21912), lines at zigzagcai/InternEvo @ 24180aa8 (the same functions as InternLM/InternEvo
  @ c712926a).

docs/upstream/burst_attention.md and docs/upstream/loongtrain_double_ring.md walk through
them. Each transcription walks upstream's loop for one rank and lists every message: phase,
when it is posted and awaited (in kernels done before it, so "posted before kernel i" is i
and "awaited after kernel i" is i + 1), the communicator (named as cpbench's group for it),
dtype and bytes. They are held against cpbench's declared ``schedule()`` (posts, awaits,
groups, bytes: every rank, several topologies) and, in the multirank tests, against traced
runs (posts, dtypes, bytes, group members). Where a ring has one member upstream sends to
itself; cpbench sends nothing, so those are left out here.
"""

from __future__ import annotations

from collections import Counter

import pytest
from rankpool import run_ranks
from schedule_helpers import plan
from strategy_matrix import check_cases

from cpbench import strategies
from cpbench.bench import commrun
from cpbench.bench import plan as planning
from cpbench.config import AttentionConfig, RunConfig

B, S, H, HK, D = 2, 96, 4, 2, 16
TOPOS = [(4, 2), (8, 4), (8, 2), (16, 4)]  # (world, ranks per node): M, W >= 2


def _sizes(elt: int, seqlen: int = S, world: int = 4, batch: int = B, heads: int = H,
           kv_heads: int = HK, head_dim: int = D) -> dict:
    """Bytes of one message of each tensor, by (name, dtype) as upstream sends it."""
    s = seqlen // world
    return {"k": batch * s * kv_heads * head_dim * elt,  # K, V, dK, dV in the activation dtype
            "k32": batch * s * kv_heads * head_dim * 4,  # dK, dV in fp32
            "q": batch * s * heads * head_dim * elt,  # Q, dO, O, dQ
            "row": batch * heads * s * 4}  # lse, delta: fp32, one per query row and head


def _hop(phase, post, wait, group, dtype, nbytes):
    return (phase, post, wait, group, dtype, nbytes)


# -- Burst-Attention ------------------------------------------------------------------------------

def _burst_block_hops(phase, n, w, double, tensors):
    """COMM ``double_ring_send_recv`` (L221-254) for rounds r = 1..n-1 (BAI L218-220 forward,
    L295-299 backward: posted before round r's kernel, awaited after it, L239-242 / L374).
    Flat: every tensor on the process group (L227). Double: at a window's first round but the
    last window's, a copy goes to the next window (L229-237), awaited after the window's last
    kernel (L238-251 mark it, the caller's wait takes it: L301-306); at a window's last round
    no inner hop (L238-251: the block that came across is swapped in); else the inner ring
    (L254). One P2P op per tensor (L159-171)."""
    m = n // w if double else 1
    hops = []
    for r in range(1, n):
        if m == 1:
            hops += [_hop(phase, r - 1, r, "ring", dt, nb) for dt, nb in tensors]
            continue
        if r % w == 1 and r // w != m - 1:
            end = ((r - 1) // w + 1) * w
            hops += [_hop(phase, r - 1, end, "outer", dt, nb) for dt, nb in tensors]
        if r % w != 0:
            hops += [_hop(phase, r - 1, r, "inner", dt, nb) for dt, nb in tensors]
    return hops


def _burst_dq_hops(n, w, double, dq):
    """dQ (BAI L261: ``zeros_like(q)``, the activation dtype). Rounds r = 2..n: the sum of the
    previous round's queries is posted after the bundle, before round r's kernel (L300-302),
    and, unless it went across, awaited after it (L375-378); round n+1 after the loop
    (L393-396). COMM ``double_ring_send_recv_q`` (L187-218): flat, on the bundle's own
    communicator (L188-189; BAI L265-267 falls back to the bundle's groups); double, at a
    window's first round the sum goes straight across (L191-205), awaited at the next
    boundary before the add (L201), and the new base starts at zero (L206-208); after the
    last round one outer hop then one inner hop, each awaited at once (L209-216)."""
    m = n // w if double else 1
    hops = []
    for r in range(2, n + 2):
        last = r == n + 1
        if m == 1:
            hops.append(_hop("bwd", r - 1, min(r, n), "ring", *dq))
        elif r % w == 1:
            hops.append(_hop("bwd", r - 1, n if last else r - 1 + w, "outer_dq", *dq))
            if last:
                hops.append(_hop("bwd", n, n, "inner_dq", *dq))
        else:
            hops.append(_hop("bwd", r - 1, r, "inner_dq", *dq))
    return hops


def burst_upstream(n, w, double, opt_bwd, act, sz) -> list[tuple]:
    """One rank's messages in Burst-Attention (``burst_attn_func``): forward K, V (BAI L219);
    backward the bundle delta, dO, Q, lse (L288, L296-298), delta = rowsum(O*dO) in fp32
    with optimize_bwd_comm (L271-278), else O itself (L269-270); then dQ."""
    delta = ("float32", sz["row"]) if opt_bwd else (act, sz["q"])
    bundle = [delta, (act, sz["q"]), (act, sz["q"]), ("float32", sz["row"])]
    return (_burst_block_hops("fwd", n, w, double, [(act, sz["k"])] * 2)
            + _burst_block_hops("bwd", n, w, double, bundle)
            + _burst_dq_hops(n, w, double, (act, sz["q"])))


# -- LoongTrain (InternEvo) -----------------------------------------------------------------------

def _kv_hops(phase, n, w, act, kv):
    """IE forward L144-159 (backward L362-372): at window j's start K and V go to the next
    window (one send_recv each), awaited when window j+1 starts (L146-149, L364-367: after
    window j's last kernel); inside a window K and V go round before each kernel but the last
    and are awaited after it (L58-61/L87-90, L227-230/L263-266, ...)."""
    m, hops = n // w, []
    for j in range(m):
        if j + 1 < m:
            hops += [_hop(phase, j * w, (j + 1) * w, "outer", act, kv)] * 2
        for i in range(j * w, (j + 1) * w - 1):  # none before a window's last kernel
            hops += [_hop(phase, i, i + 1, "inner", act, kv)] * 2
    return hops


def loongtrain_upstream(n, w, act, sz) -> list[tuple]:
    """One rank's messages in ``zigzag_double_ring_flash_attn_forward/backward``. dK/dV: after
    every kernel dK and dV go to the next inner rank (L268-270, L313-315, L348-350), awaited
    after the next kernel (L252-254, L297-300) or, after a window's last, at once (L272, L317,
    L352); in fp32 in the first window (L234-236), after it in the activation dtype (each
    window returns its sums cast, L274, L354, and the next window adds into what came across,
    L374-377). After every window they go across (L403-405), awaited after the next window's
    first kernel (L302-303, L337-338), the last at the end (L407)."""
    m, hops = n // w, []
    hops += _kv_hops("fwd", n, w, act, sz["k"]) + _kv_hops("bwd", n, w, act, sz["k"])
    for i in range(n):
        j, t = divmod(i, w)
        if w > 1:
            dt, nb = ("float32", sz["k32"]) if j == 0 else (act, sz["k"])
            hops += [_hop("bwd", i + 1, i + 1 + (t + 1 < w), "inner_dkv", dt, nb)] * 2
        if m > 1 and t == w - 1:
            wait = i + 2 if j + 1 < m else n
            hops += [_hop("bwd", i + 1, wait, "outer_dkv", act, sz["k"])] * 2
    return hops


# -- cpbench's declared schedule in the same terms ------------------------------------------------

def declared(st) -> Counter:
    """(phase, post, wait, group, bytes) of every declared message: posted before the step's
    kernel, or after it (``after_compute``); awaited ``overlap_steps`` kernels later, or at
    once when exposed."""
    out = Counter()
    for step in st.schedule():
        for msg in step.messages:
            post = step.index + msg.after_compute
            wait = post + (msg.overlap_steps if msg.overlapped else 0)
            out[(step.phase, post, wait, msg.group, msg.nbytes)] += 1
    return out


def without_dtype(hops) -> Counter:
    return Counter((p, post, wait, g, nb) for p, post, wait, g, _, nb in hops)


DTYPES = [("bf16", "bfloat16", 2), ("fp32", "float32", 4)]


@pytest.mark.parametrize("dtype,act,elt", DTYPES)
@pytest.mark.parametrize("world,rpn", TOPOS)
@pytest.mark.parametrize("opt_bwd", [True, False])
@pytest.mark.parametrize("double", [True, False])
def test_burst_schedule_is_burst_attentions(world, rpn, double, opt_bwd, dtype, act, elt):
    want = without_dtype(burst_upstream(world, rpn, double, opt_bwd, act,
                                        _sizes(elt, world=world)))
    for rank in range(world):
        st = plan("burst", world, rpn, rank,
                  AttentionConfig(batch=B, seqlen=S, heads=H, kv_heads=HK, head_dim=D,
                                  dtype=dtype), double_ring=double, opt_bwd=opt_bwd)
        assert declared(st) == want, rank


@pytest.mark.parametrize("dtype,act,elt", DTYPES)
@pytest.mark.parametrize("world,rpn", TOPOS)
def test_double_ring_schedule_is_loongtrains(world, rpn, dtype, act, elt):
    want = without_dtype(loongtrain_upstream(world, rpn, act, _sizes(elt, world=world)))
    for rank in range(world):
        st = plan("double-ring", world, rpn, rank,
                  AttentionConfig(batch=B, seqlen=S, heads=H, kv_heads=HK, head_dim=D,
                                  dtype=dtype))
        assert declared(st) == want, rank


def test_the_transcriptions_count_what_the_issue_says():
    """Issue "upstream parity" on burst: M(W-1)+1 inner and M outer dQ hops, 2 exposed;
    on double-ring: the outer dK/dV hop has one kernel to hide behind."""
    n, w = 8, 4
    dq = [h for h in burst_upstream(n, w, True, True, "bfloat16", _sizes(2, world=n))
          if h[3].endswith("_dq")]
    assert Counter(h[3] for h in dq) == {"inner_dq": 2 * 3 + 1, "outer_dq": 2}
    assert sum(post == wait for _, post, wait, *_ in dq) == 2
    outer = [h for h in loongtrain_upstream(n, w, "bfloat16", _sizes(2, world=n))
             if h[3] == "outer_dkv"]
    assert [wait - post for _, post, wait, *_ in outer] == [1, 1, 0, 0]
    assert {h[4] for h in outer} == {"bfloat16"}


# -- measured: traced runs against the transcriptions (multirank) ---------------------------------

TRACE_PROBLEM = {"batch": 1, "seqlen": 128, "heads": 8, "kv_heads": 2, "head_dim": 16,
                 "dtype": "bf16"}


def _members(role: str, rank: int, n: int, w: int) -> tuple[int, ...]:
    """The ranks of ``rank``'s group of that role (rank = ring position here)."""
    if role.startswith("inner"):
        return tuple(range(rank // w * w, rank // w * w + w))
    if role.startswith("outer"):
        return tuple(range(rank % w, n, w))
    return tuple(range(n))


def _upstream_posts(hops, rank, n, w) -> Counter:
    return Counter((phase, post, dtype, nbytes, _members(group, rank, n, w))
                   for phase, post, _, group, dtype, nbytes in hops)


def _traced_posts(events) -> Counter:
    return Counter((phase, e.kernels_before, e.dtype, e.nbytes, tuple(sorted(e.group)))
                   for phase, evs in events.items() for e in evs)


@pytest.mark.multirank
# 4 nodes x 2 as well: outer rings of 4 (more than one outer hop), 8-rank messages
@pytest.mark.parametrize("world,rpn", [(4, 2), (8, 2)])
def test_traced_runs_send_what_upstream_sends(world, rpn):
    """burst (double ring with opt_bwd, flat without: its two variants) and double-ring,
    traced at torch.distributed: every message each rank posts, with its dtype, bytes, group
    members and how many kernels ran before it, equals the transcription's."""
    run = RunConfig(strategy=("burst", "double-ring"), nproc=world, ranks_per_node=rpn,
                    out="none", warmup=0, iters=1)
    p = planning.plan(run, dict(TRACE_PROBLEM), {}, launcher="self")
    found = run_ranks(commrun.rank_comm, world, p, timeout=240)[0]
    assert [c["error"] for c in found] == [None] * len(p.cases)
    sz = _sizes(2, seqlen=128, world=world, batch=1, heads=8, kv_heads=2)
    for case, got in zip(p.cases, found):
        o = case.options
        if case.strategy == "burst":
            hops = burst_upstream(world, rpn, o.double_ring, o.opt_bwd, "bfloat16", sz)
            w = rpn if o.double_ring else world
        else:
            hops, w = loongtrain_upstream(world, rpn, "bfloat16", sz), rpn
        for rank, events in enumerate(got["events"]):
            assert _traced_posts(events) == _upstream_posts(hops, rank, world, w), \
                (got["strategy"], rank)


OPTION_CASES = {
    "burst": [dict(dq_dtype="fp32"), dict(double_ring=False, dq_group="separate"),
              dict(double_ring=False, opt_bwd=True, dq_dtype="fp32")],
    "double-ring": [dict(dkv_dtype="fp32"), dict(dkv_await="window-end"),
                    dict(dkv_dtype="fp32", dkv_await="window-end")],
}


@pytest.mark.multirank
@pytest.mark.parametrize("name", OPTION_CASES)
def test_the_named_variants_are_exact_and_send_what_they_declare(name):
    """cpbench's variants kept as options: against the float64 reference, and their declared
    schedules against what they send, on 4 nodes x 2 (four windows)."""
    cls = strategies.get(name)
    cases = []
    for causal, kv_heads, dtype in ((True, 2, "bf16"), (False, None, "fp32")):
        attn = AttentionConfig(batch=1, seqlen=96, heads=8, kv_heads=kv_heads, head_dim=16,
                               dtype=dtype, causal=causal)
        cases += [(attn, cls.Options(**o)) for o in OPTION_CASES[name]]
    failures = run_ranks(check_cases, 8, name, 2, cases, cases[::2], timeout=240)[0]
    assert not failures, "\n".join(failures)
