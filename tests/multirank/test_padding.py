"""Padded documents on real gloo ranks at an N no length divides (3 ranks, 3 emulated nodes
and 1): every strategy of cpbench's own that takes documents, on lengths no layout splits,
so each pads as its layout needs (zigzag layouts to 2N, contiguous ones only the tail, usp
its ring's and N) — checked against the float64 reference on fresh inputs, pad rows
included (out 0, lse -inf, no gradient), and held to its declared schedule at the padded
size. A pad-only tail (TransformerEngine #3331) arises wherever the sequence rounds up."""

from __future__ import annotations

import random

import pytest
from rankpool import run_ranks
from strategy_matrix import check_named_cases

from cpbench import kernels, strategies
from cpbench.config import AttentionConfig
from cpbench.topology import Topology

pytestmark = pytest.mark.multirank


def _documents(seqlen: int) -> tuple[int, ...]:
    """Fresh lengths each run (seeded from the clock): none need divide anything."""
    rng, docs = random.Random(), []
    while sum(docs) < seqlen:
        docs.append(min(rng.randint(1, 30), seqlen - sum(docs)))
    return tuple(docs)


def _cases():
    docs = _documents(70)  # 70: neither 3 nor 6 divides it
    attn = [AttentionConfig(batch=1, seqlen=70, heads=6, kv_heads=3, head_dim=8,
                            dtype="fp32", causal=causal, documents=docs, window_size=window)
            for causal, window in ((True, None), (False, (7, 2)))]
    cases = [(name, a, strategies.get(name).Options()) for a in attn
             for name in ("ring", "zigzag", "megatron-cp", "double-ring", "ulysses", "llama3")]
    cases += [("usp", attn[0], strategies.get("usp").Options(ulysses_degree=d))
              for d in (1, 3)]
    return cases


@pytest.mark.parametrize("rpn", [1, 3])
def test_padded_documents_match_the_reference_at_any_n(rpn):
    failures = run_ranks(check_named_cases, 3, rpn, _cases(), timeout=300)[0]
    assert not failures, "\n".join(failures)


def test_a_pad_only_tail_through_a_zigzag_ring():
    """usp 3 x 2 on 6 ranks: documents padded to 4 (its zigzag ring of 2), the sequence to
    lcm(4, 6) = 12, so a pad-only segment ends it and is cut into zigzag chunks like a
    document (TransformerEngine #3331's tail)."""
    usp = strategies.get("usp")
    opts = usp.Options(ulysses_degree=3)
    while True:  # fresh lengths whose padding needs a tail (most do)
        attn = AttentionConfig(batch=1, seqlen=70, heads=6, head_dim=8, dtype="fp32",
                               causal=True, documents=_documents(70))
        st = usp(attn, Topology(world_size=6, ranks_per_node=3), 0,
                 kernel=kernels.get("sdpa-cpu"), options=opts, create_groups=False)
        if st.padding()["tail_tokens"]:
            break
    assert st.attn.seqlen % 12 == 0
    failures = run_ranks(check_named_cases, 6, 3, [("usp", attn, opts)], timeout=300)[0]
    assert not failures, "\n".join(failures)
