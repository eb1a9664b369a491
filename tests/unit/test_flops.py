"""The one FLOP formula reproduces the published per-GPU TFLOPs of seeds 000 and 001."""

import pytest

from cpbench.metrics import attention_flops, tflops_per_gpu
from cpbench.results import derive


def _seed_tflops(seqlen, fwd_bwd_ms, world=32, heads=40, head_dim=128, batch=1):
    flops = attention_flops(batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, heads=heads,
                            head_dim=head_dim, causal=True, mode="fwd_bwd")
    return tflops_per_gpu(flops, world, fwd_bwd_ms / 1e3)


def test_seed001_double_ring_524288():
    # DoubleRing, S = 524288, FWD+BWD 1985.06 ms on 32 ranks, H = 40, D = 128, B = 1, causal
    assert round(_seed_tflops(524288, 1985.06), 2) == 155.09


@pytest.mark.parametrize("seqlen,ms,published", [
    (131072, 180.39, 106.66), (262144, 463.70, 165.98),  # seed 001 DoubleRing
    (524288, 1985.43, 155.06), (524288, 3347.21, 91.98),  # seed 001 USP head-/ring-first
    (524288, 1941.49, 158.57),  # seed 000 zigzag
])
def test_other_seed_rows(seqlen, ms, published):
    assert _seed_tflops(seqlen, ms) == pytest.approx(published, abs=0.011)


def test_formula_parts():
    kw = dict(batch=2, seqlen_q=64, seqlen_k=32, heads=3, head_dim=16)
    full = attention_flops(causal=False, **kw)
    assert full == 4 * 2 * 64 * 32 * 3 * 16
    assert attention_flops(causal=True, **kw) == full / 2
    assert attention_flops(causal=False, mode="bwd", **kw) == 2.5 * full
    assert attention_flops(causal=False, mode="fwd_bwd", **kw) == 3.5 * full


def test_record_tflops_divide_by_ranks_per_problem():
    """A record's TFLOPs come from its samples: the seed figure for 32 ranks sharing the
    problem, 32x that when each rank solved it alone (the local baseline)."""
    record = {
        "config": {"attention": {"batch": 1, "seqlen": 524288, "heads": 40, "kv_heads": None,
                                 "head_dim": 128, "dtype": "bf16", "causal": True}},
        "status": "ok", "ranks_per_problem": 32, "memory_bytes": [1],
        "samples_ms": {"fwd": [[471.94]] * 32, "fwd_bwd": [[1985.06]] * 32},
    }
    assert round(derive(record)["fwd_bwd_tflops"], 2) == 155.09
    record["ranks_per_problem"] = 1
    assert derive(record)["fwd_bwd_tflops"] == pytest.approx(155.09 * 32, rel=1e-4)
