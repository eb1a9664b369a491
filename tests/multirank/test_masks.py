"""Packed documents and sliding windows on real gloo ranks: every strategy that declares a
mask, gathered into global order and compared with the float64 reference under the same mask
(out, lse, dq, dk, dv), and held to its declared schedule. One 4-rank launch covers them all:
random document lengths, documents shorter than a rank's shard (16 tokens here), a document
spanning every rank, a window smaller than a shard and one larger (with documents)."""

from __future__ import annotations

import pytest
from strategy_matrix import check_named_cases

from cpbench import strategies
from cpbench.config import AttentionConfig
from cpbench.launch import run_ranks

pytestmark = pytest.mark.multirank

S = 64  # 4 ranks: shards of 16, zigzag chunks of 8
MASKS = [
    dict(documents=(24, 8, 32)),  # random-ish; 8 is shorter than a shard
    dict(documents=(56, 8)),  # the first spans every rank
    dict(window_size=(5, 0)),  # smaller than a shard
    dict(window_size=(40, 3), causal=False, documents=(24, 8, 32)),  # larger, both sides
]


def _cases():
    cases = []
    for name in ("ring", "zigzag", "ulysses", "llama3", "rfa-llama3"):
        cls = strategies.get(name)
        for mask in MASKS:
            if name == "rfa-llama3" and mask.get("causal") is False:
                continue  # refused: the library's window is right only when causal
            attn = AttentionConfig(batch=1, seqlen=S, heads=4, kv_heads=2, head_dim=8,
                                   dtype="fp32", **{"causal": True, **mask})
            cases.append((name, attn, cls.Options()))
    # the library's ring varlen functions are wrong in fp32 (refused there): bf16
    docs = AttentionConfig(batch=1, seqlen=S, heads=4, head_dim=8, dtype="bf16",
                           documents=(24, 8, 32))
    cases += [("rfa-zigzag", docs, strategies.get("rfa-zigzag").Options())]
    return cases


def test_masks_match_the_reference_and_the_schedule():
    failures = run_ranks(check_named_cases, 4, 2, _cases(), timeout=300)[0]
    assert not failures, "\n".join(failures)
