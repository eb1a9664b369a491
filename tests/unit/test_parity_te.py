"""megatron-cp and megatron-cp-a2a+p2p against TransformerEngine's communication, transcribed by
hand from its source: NVIDIA/TransformerEngine tag v2.18 (commit 27486e03),
``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py`` (CP below;
docs/upstream/transformer_engine_cp.md §6.1, §6.4). TE needs GPUs, so it cannot run here: each
strategy's declared ``schedule()`` is checked against the transcription, per rank and step —
messages, bytes (elements × the dtype's size), group, posted before or after the step's kernel,
what hides it — and tests/multirank/test_strategies.py holds ``schedule()`` to what the code
really sends. Non-FP8, bshd, no bias: cpbench's scope. Only plain arithmetic here, never the
strategies' byte helpers. No processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from schedule_helpers import build

from cpbench.strategies.layout import zigzag_index
from cpbench.strategies.megatron_cp_a2a_p2p import chunks_to_members, chunks_to_ring, reorder

ELEMENT = {"bf16": 2, "fp16": 2, "fp32": 4}  # bytes per element of the activation dtype

# When TE awaits a message (the wait hides nothing behind it unless a kernel runs meanwhile):
NEXT_TILE = "awaited before the next step's tile"  # forward ring, CP L1701-1703
THIS_TILE = "awaited right after this step's tile"  # backward ring, CP L2717-2719
EXPOSED = "awaited before anything computes"  # all-to-alls (CP L431, L504, L535)


@dataclass(frozen=True)
class TEMessage:
    op: str  # "p2p" (flash_attn_p2p_communicate, CP L96-136) or "a2a" (all_to_all_single)
    group: str  # TE's cp_group (cpbench "ring") or cp_group_a2a (cpbench "ulysses")
    elements: int  # what leaves this rank, in elements
    dtype: str
    posted_after_kernel: bool
    awaited: str


@dataclass(frozen=True)
class TEStep:
    phase: str
    index: int
    tile: tuple[int, int, bool] | None  # (queries, keys, causal mask) of its kernel
    messages: tuple[TEMessage, ...]


def te_tile(section: str, s: int) -> tuple[int, int, bool]:
    """The kernel shape of each section (CP L1781-1794 comment table; q/k/v viewed as
    [b, 2, s/2, h, d], L1572-1578): "diagonal" full q and K/V, causal; "lower-triangle" full q,
    first K/V half (L736-772); "upper-triangle" second q half, full K/V (L773-805); "all"."""
    return {"diagonal": (s, s, True), "lower-triangle": (s, s // 2, False),
            "upper-triangle": (s // 2, s, False), "all": (s, s, False)}[section]


def te_p2p(n, rank, s, kv_elements, dtype, causal, index0=0) -> list[TEStep]:
    """AttnFuncWithCPAndKVP2P on a ring of ``n``, p2p rank ``rank``, ``s`` local tokens,
    ``kv_elements`` in one of K or V. Forward (L1698-1970), backward (L2460-2810)."""
    kv = 2 * kv_elements  # torch.cat((k.view(-1), v.view(-1))): one buffer (L1690)
    steps = []
    for i in range(n):  # forward
        section = ("all" if not causal else "diagonal" if i == 0
                   else "lower-triangle" if i <= rank else "upper-triangle")  # L1797-1886
        # step i posts the K/V it holds, unless it is the last (L1705-1715), before its tile
        msgs = (TEMessage("p2p", "ring", kv, dtype, False, NEXT_TILE),) if i < n - 1 else ()
        steps.append(TEStep("fwd", index0 + i, te_tile(section, s), msgs))
    for i in range(n):  # backward: reverse ring (L2229-2230), buffers (2, kv) in kv.dtype
        section = ("all" if not causal else "diagonal" if i == n - 1
                   else "lower-triangle" if i >= n - rank - 1 else "upper-triangle")  # L2581-2621
        # send_tensor[0] (K/V) at step 0, [1] (dK/dV) at step n-1, both rows between
        # (L2486-2493); posted before the tile, awaited after it (L2717-2719)
        elements = kv if i in (0, n - 1) else 2 * kv
        msgs = (TEMessage("p2p", "ring", elements, dtype, False, THIS_TILE),) if n > 1 else ()
        steps.append(TEStep("bwd", index0 + i, te_tile(section, s), msgs))
    return steps


def te_a2a(names, a, elements: dict, dtype) -> tuple[TEMessage, ...]:
    """flash_attn_a2a_communicate (CP L387-536): one all_to_all_single per tensor, in the
    order given (L421-428); the input viewed [A, b, s, h/A, d] (L463-473), so 1/A stays home."""
    return tuple(TEMessage("a2a", "ulysses", elements[x] * (a - 1) // a, dtype, False, EXPOSED)
                 for x in names)


def te_a2a_p2p(a, p, p2p_rank, b, s, h, hk, d, dtype, causal) -> list[TEStep]:
    """cp_comm_type "a2a+p2p": cp_group = [a2a group of A, p2p group of P] (CP L1409-1415).
    Forward: q, k, v all-to-alls (L1486-1510), the ring over P ranks on A·s tokens of h/A heads
    (``max_seqlen // cp_size`` of the p2p group, L1449-1450), out all-to-all (L2032-2049).
    Backward: dout (L2407-2421), the ring, dq, dk, dv (L2889-2915). No out in the backward:
    since v2.15 the forward saves the post-all-to-all out (L2096-2129)."""
    act = {"q": b * s * h * d, "k": b * s * hk * d, "v": b * s * hk * d}
    act |= {"out": act["q"], "dout": act["q"], "dq": act["q"], "dk": act["k"], "dv": act["v"]}
    ring = te_p2p(p, p2p_rank, a * s, b * a * s * (hk // a) * d, dtype, causal, index0=1)
    steps = []
    for phase, before, after in (("fwd", ("q", "k", "v"), ("out",)),
                                 ("bwd", ("dout",), ("dq", "dk", "dv"))):
        inner = [st for st in ring if st.phase == phase]
        steps += [TEStep(phase, 0, None, te_a2a(before, a, act, dtype)), *inner,
                  TEStep(phase, p + 1, None, te_a2a(after, a, act, dtype))]
    return steps


def declared(st) -> list[tuple]:
    """cpbench's schedule in the transcription's terms."""
    out = []
    for step in st.schedule():
        msgs = tuple((m.op, m.group, m.nbytes, m.after_compute, m.overlapped, m.overlap_steps)
                     for m in step.messages)
        out.append((step.phase, step.index, step.block, msgs))
    return out


def expected(te_steps, dtype) -> list[tuple]:
    """TE's steps as cpbench would declare them: a ring message has one tile to hide behind
    (awaited before the next tile or right after this one: either way one tile runs while it
    travels); an all-to-all has none."""
    out = []
    for step in te_steps:
        msgs = tuple((m.op, m.group, m.elements * ELEMENT[m.dtype], m.posted_after_kernel,
                      m.awaited != EXPOSED, 1) for m in step.messages)
        assert all(m.dtype == dtype for m in step.messages)  # non-FP8: all activation dtype
        out.append((step.phase, step.index, step.tile, msgs))
    return out


def problem(dtype, causal, kv_heads):
    return dict(batch=2, seqlen=192, heads=8, kv_heads=kv_heads, head_dim=16, dtype=dtype,
                causal=causal)


CASES = [("bf16", True, 2), ("fp16", False, None), ("fp32", True, None), ("bf16", False, 4)]


@pytest.mark.parametrize("dtype,causal,kv_heads", CASES)
@pytest.mark.parametrize("world,rpn", [(2, 1), (4, 2), (8, 4)])
def test_megatron_cp_is_te_p2p(world, rpn, dtype, causal, kv_heads):
    prob = problem(dtype, causal, kv_heads)
    s, hk = prob["seqlen"] // world, kv_heads or prob["heads"]
    for rank in range(world):
        st = build("megatron-cp", world, rpn, rank, **prob)
        te = te_p2p(world, rank, s, prob["batch"] * s * hk * prob["head_dim"], dtype, causal)
        assert declared(st) == expected(te, dtype), rank


@pytest.mark.parametrize("dtype,causal,kv_heads", CASES)
@pytest.mark.parametrize("world,rpn,a2a", [(4, 2, 2), (8, 4, 4), (8, 4, 2), (8, 2, 2)])
def test_megatron_cp_a2a_p2p_is_te_a2a_p2p(world, rpn, a2a, dtype, causal, kv_heads):
    prob = problem(dtype, causal, kv_heads)
    hk = kv_heads or prob["heads"]
    if hk % a2a:
        pytest.skip("TE cannot run K/V heads not divisible by A (CP L463-468)")
    p, s = world // a2a, prob["seqlen"] // world
    for rank in range(world):
        st = build("megatron-cp-a2a+p2p", world, rpn, rank, a2a_degree=a2a, **prob)
        te = te_a2a_p2p(a2a, p, rank // a2a, prob["batch"], s, prob["heads"], hk,
                        prob["head_dim"], dtype, causal)
        assert declared(st) == expected(te, dtype), rank


def test_a2a_p2p_default_degree_is_te_twins():
    # 8 heads, 2 K/V heads, nodes of 4: A = 2 (TE cannot split 2 K/V heads 4 ways)
    st = build("megatron-cp-a2a+p2p", 8, 4, 0, batch=1, seqlen=64, heads=8, kv_heads=2,
               head_dim=8)
    assert st.resolved_options() == {"a2a_degree": 2, "p2p_degree": 4}


@pytest.mark.parametrize("world,a2a", [(4, 2), (8, 4), (8, 2), (8, 8), (4, 1)])
def test_a2a_p2p_layout_is_te_dual_chunk_swap(world, a2a):
    """TE's layout (DualChunkSwap, CP L4956-5012): cp_rank holds chunks cp_rank and
    2N-1-cp_rank of 2N, cp_rank = A·p2p_rank + a2a_rank (L1418-1419). After the all-to-all
    (member order) and TE's reorder (L236-252, L271-282), p2p rank p holds super-chunks p and
    2P-1-p of 2P, in order: the zigzag the ring runs on; the inverse (L254-268) goes back."""
    seqlen, p = 16 * world, world // a2a
    for rank in range(world):
        st = build("megatron-cp-a2a+p2p", world, world, rank, batch=1, seqlen=seqlen,
                   heads=8, head_dim=8, a2a_degree=a2a)
        c = seqlen // (2 * world)
        chunks = [torch.arange(i * c, (i + 1) * c) for i in (rank, 2 * world - 1 - rank)]
        assert torch.equal(st.seq_index(rank), torch.cat(chunks))
        members = st.groups["ulysses"].ranks
        assert members == tuple(range(rank // a2a * a2a, (rank // a2a + 1) * a2a))
        if p > 1:  # the ring's next rank: cp_global_ranks[(p + 1) % P · A + a2a_rank]
            assert st.groups["ring"].next_rank == (rank // a2a + 1) % p * a2a + rank % a2a
        gathered = torch.cat([st.seq_index(m) for m in members]).view(1, -1)
        ring_order = reorder(gathered, 1, chunks_to_ring(a2a))
        assert torch.equal(ring_order[0], zigzag_index(seqlen, p, rank // a2a))
        assert torch.equal(reorder(ring_order, 1, chunks_to_members(a2a)), gathered)


def test_chunk_ids_are_tes():
    # CP L246-249: ids[r] = 2r, ids[r + cp] = 2cp - 2r - 1; L264-266: ids[2r] = r,
    # ids[2r + 1] = 2cp - r - 1. Written out for cp = 4:
    assert chunks_to_ring(4).tolist() == [0, 2, 4, 6, 7, 5, 3, 1]
    assert chunks_to_members(4).tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
