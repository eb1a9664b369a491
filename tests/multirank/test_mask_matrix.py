"""Packed documents and sliding windows on real gloo ranks, and the new ``llama3``: every
strategy that declares a mask, gathered into global order and compared with the float64
reference under the same mask (out, lse, dq, dk, dv), cpbench's own also held to their
declared schedules. The mask matrix on 2 ranks and on 4 (2 nodes × 2: more ring steps, the
window of 40 over three shards) — random document lengths, lengths no zigzag layout splits
(padded: ``--document-padding pad``), a document shorter than a rank's shard, one spanning
every rank, a window smaller than a shard and one larger — and 4 ranks for llama3 without a
mask (causal and full, GQA, fp16, head chunks; rfa-llama3 causal and full), llama3's two
layouts and two dK/dV dtypes plain, under documents and under a window, beside ring / zigzag
/ llama3 / usp on documents and a window over 4 shards."""

from __future__ import annotations

import pytest
from rankpool import run_ranks
from strategy_matrix import check_named_cases

from cpbench import strategies
from cpbench.config import AttentionConfig

pytestmark = pytest.mark.multirank

S = 64  # 2 ranks: shards of 32 (zigzag chunks of 16); 4 ranks: shards of 16 (chunks of 8)
MASKS = [
    dict(documents=(24, 8, 32)),  # random-ish; 8 is shorter than a shard
    dict(documents=(23, 9, 32)),  # zigzag layouts pad 23 and 9 to 4 (2N)
    dict(documents=(56, 8)),  # the first spans every rank
    dict(window_size=(5, 0)),  # smaller than a shard
    dict(window_size=(40, 3), causal=False, documents=(24, 8, 32)),  # larger, both sides
]


def _attn(**kw):
    return AttentionConfig(**{**dict(batch=1, seqlen=S, heads=4, kv_heads=2, head_dim=8,
                                     dtype="fp32", causal=True), **kw})


def _options(name, **kw):
    return strategies.get(name).Options(**kw)


def _mask_cases():
    cases = []
    for name in ("ring", "zigzag", "megatron-cp", "double-ring", "ulysses", "llama3", "rfa-llama3"):
        for mask in MASKS:
            if name == "rfa-llama3" and mask.get("causal") is False:
                continue  # refused: the library's window is right only when causal
            cases.append((name, _attn(**mask), _options(name)))
    # the library's ring varlen functions are wrong in fp32 (refused there): bf16
    cases.append(("rfa-zigzag", _attn(kv_heads=None, dtype="bf16", documents=(24, 8, 32)),
                  _options("rfa-zigzag")))
    return cases


def _four_rank_cases():
    cases = [("llama3", _attn(causal=causal, kv_heads=kv, dtype=dtype, batch=2),
              _options("llama3"))
             for causal in (True, False) for kv, dtype in ((None, "fp32"), (2, "fp16"))]
    cases.append(("llama3", _attn(), _options("llama3", heads_k_stride=1)))
    # both layouts x both dK/dV dtypes, plain, under documents (one shorter than a zigzag
    # chunk, lengths no multiple of anything) and a window, in bf16 where the dtypes differ
    cases += [("llama3", _attn(dtype="bf16", **mask),
               _options("llama3", layout=layout, dkv_dtype=dkv, heads_k_stride=1))
              for layout in ("zigzag", "contiguous") for dkv in ("activation", "fp32")
              for mask in (dict(), dict(documents=(19, 5, 40)), dict(window_size=(11, 0)))]
    cases += [("llama3", _attn(causal=False, documents=(19, 5, 40), window_size=(9, 2)),
               _options("llama3", layout=layout)) for layout in ("zigzag", "contiguous")]
    # its upstream twin without a mask (test_upstream leaves it to this launch)
    cases += [("rfa-llama3", _attn(causal=causal), _options("rfa-llama3", heads_k_stride=1))
              for causal in (True, False)]
    cases += [(name, _attn(documents=docs), _options(name))
              for name in ("ring", "zigzag", "llama3") for docs in ((24, 8, 32), (56, 8))]
    # llama3 with every document zigzagged (TE's thd), in bf16 where the dK/dV dtypes differ
    cases += [("llama3", _attn(documents=docs, causal=causal, dtype="bf16"),
               _options("llama3", layout="zigzag-documents", dkv_dtype=dkv, heads_k_stride=1))
              for docs, causal, dkv in (((24, 8, 32), True, "activation"),
                                        ((56, 8), False, "fp32"))]
    # megatron-cp's ring; double-ring's two levels (inner rings of 2, a real outer hop)
    cases += [(name, _attn(**mask), _options(name)) for name in ("megatron-cp", "double-ring")
              for mask in (dict(documents=(56, 8)), dict(window_size=(5, 0)))]
    # a window through TE's a2a+p2p (2 × 2); usp on a double ring (its ring of 2 over nodes)
    cases += [("megatron-cp-a2a+p2p", _attn(window_size=(5, 0)), _options("megatron-cp-a2a+p2p")),
              ("usp", _attn(kv_heads=None, documents=(24, 8, 32)),
               _options("usp", ulysses_degree=2, ring_impl="double-ring"))]
    # usp: the mask through its ring (2 × 2) and through its kernel (Ulysses 4, no ring)
    cases += [("usp", _attn(kv_heads=None, documents=(56, 8)), _options("usp")),
              ("usp", _attn(kv_heads=None, window_size=(5, 0)),
               _options("usp", ulysses_degree=4, ring_impl="ring"))]
    return cases


@pytest.mark.parametrize("world,rpn", [(2, 1), (4, 2)], ids=str)
def test_masks_match_the_reference_and_the_schedule(world, rpn):
    failures = run_ranks(check_named_cases, world, rpn, _mask_cases(), timeout=300)[0]
    assert not failures, "\n".join(failures)


def test_llama3_and_documents_over_four_ranks():
    failures = run_ranks(check_named_cases, 4, 2, _four_rank_cases(), timeout=300)[0]
    assert not failures, "\n".join(failures)
