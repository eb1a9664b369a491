"""The dry run's meter counts what FlashAttention-2's backward allocates inside its C++ call
(``kernels.fa2_workspace``: dq_accum, softmax_d, GQA's expanded dK / dV), which
``torch.cuda.max_memory_allocated`` counts on a GPU and fake tensors do not show: one
backward call of flash-attn's and of torch's flash op (sdpa), dense and varlen, metered on
fake CUDA, peaks at its inputs + its results + those buffers, byte for byte."""

from __future__ import annotations

import pytest
import torch

from cpbench import kernels
from cpbench.bench.memory import StorageMeter

B, S, H, D = 2, 1000, 8, 72  # rows round up to 1024 per sequence, head dim to 96
FP32 = 4


def _tensors(kv_heads: int, packed: bool):
    def t(heads, dtype=torch.bfloat16):
        shape = (B * S, heads, D) if packed else (B, S, heads, D)
        return torch.empty(shape, dtype=dtype, device="cuda")

    q, k, v, out, dout = t(H), t(kv_heads), t(kv_heads), t(H), t(H)
    lse = torch.empty((H, B * S) if packed else (B, H, S), dtype=torch.float32, device="cuda")
    return dout, q, k, v, out, lse


def _metered(fn, inputs) -> int:
    """Bytes at the peak beyond the inputs and the results."""
    meter = StorageMeter()
    for t in inputs:
        meter.track(t)
    before = meter.current
    with meter:
        grads = fn()
    results = sum(g.untyped_storage().nbytes() for g in grads)
    return meter.peak - before - results


def _expected(kv_heads: int, packed: bool) -> int:
    rows = B * S + 128 * B if packed else B * 1024  # per sequence: the tokens, rounded / +128
    total = rows * H * 96 * FP32 + rows * H * FP32  # dq_accum, softmax_d
    if kv_heads != H:
        total += 2 * B * S * H * D * 2  # dk_expanded, dv_expanded (bf16)
    return total


@pytest.mark.parametrize("kernel", ["flash-attn", "sdpa"])
@pytest.mark.parametrize("kv_heads", [H, 2])
def test_a_dense_backward_holds_fa2s_buffers(kernel, kv_heads, fake_cuda, flash_attn):
    backend = kernels.get(kernel)
    x = _tensors(kv_heads, packed=False)
    inside = _metered(lambda: backend.backward(*x, causal=True, softmax_scale=0.1), x)
    assert inside == _expected(kv_heads, packed=False)


@pytest.mark.parametrize("kernel", ["flash-attn", "sdpa"])
@pytest.mark.parametrize("kv_heads", [H, 2])
def test_a_varlen_backward_holds_fa2s_buffers(kernel, kv_heads, fake_cuda, flash_attn):
    backend = kernels.get(kernel)
    x = _tensors(kv_heads, packed=True)
    cu = torch.tensor([0, S, 2 * S], dtype=torch.int32, device="cuda")
    inside = _metered(lambda: backend.varlen_backward(
        *x, cu, cu, S, S, causal=True, softmax_scale=0.1), (*x, cu))
    assert inside == _expected(kv_heads, packed=True)
