"""torch-flex: PyTorch's own FlexAttention context parallel with each of its load balancers,
on real gloo ranks. Its backward does not run on CPU (torch refuses it there, and so does
cpbench's driver), so here its forward — the layout each balancer shards by, the block mask
torch makes for a rank's shard, the mask as a mask_mod — is compared with the float64
reference under documents and a window, and what it sends, traced as ``cpbench comm`` traces
it, with llama3's forward: the same all-gathers of K and V in the activation dtype."""

from __future__ import annotations

import pytest
from flex_bodies import flex_forward
from rankpool import run_ranks

from cpbench import strategies
from cpbench.config import AttentionConfig

pytestmark = pytest.mark.multirank

S = 512  # 2 ranks x 128 (torch's block) x 2
DOCS = (256, 132, 124)  # per-document: every length a multiple of 2N = 4


def _attn(**kw):
    return AttentionConfig(**{**dict(batch=1, seqlen=S, heads=4, kv_heads=2, head_dim=16,
                                     dtype="fp32", causal=True), **kw})


def _opts(balancer):
    return strategies.get("torch-flex").Options(load_balancer=balancer)


def test_torch_flex_forward_matches_the_reference_with_every_balancer():
    cases = [(_attn(documents=DOCS, window_size=(100, 0)), _opts("head-tail")),
             (_attn(documents=DOCS), _opts("per-document")),
             (_attn(documents=DOCS, window_size=(100, 0)), _opts("ptrr")),
             (_attn(causal=False, documents=DOCS), _opts("none"))]
    failures, sent = run_ranks(flex_forward, 2, cases, timeout=600)[0]
    assert not failures, "\n".join(failures)
    # llama3's forward: K and V of a rank's S/2 tokens (2 K/V heads x 16, fp32) to the other
    kv = S // 2 * 2 * 16 * 4
    assert all(s == [("all_gather", "float32", kv)] * 2 for s in sent), sent
