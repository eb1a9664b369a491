"""flash-attn's Python interface on fake CUDA: the stand-in refuses real calls; the fake
implementations flash-attn registers (>= 2.7) give the shapes and lse layouts cpbench's
kernels expect, through cpbench's own mapping (kernels/flash_attn.py)."""

from __future__ import annotations

import pytest
import torch

from cpbench import kernels
from cpbench.kernels.flash_attn import FLASH_ATTN

S, H, D = 16 * 1024, 40, 128  # 16K tokens x 40 heads x 128, bf16
BF16 = torch.bfloat16


def _real_cpu(*shape):
    return torch.zeros(*shape, dtype=BF16)


def test_the_stand_in_refuses_real_tensors(flash_attn, stand_in):
    q = _real_cpu(1, 8, 2, 64)
    # any attribute is a function, and calling it with a real tensor raises
    for name in ("fwd", "bwd", "varlen_fwd", "varlen_bwd", "fwd_kvcache", "anything"):
        with pytest.raises(RuntimeError, match="stand-in: no CUDA build here"):
            getattr(stand_in, name)(q, q, q)
    # flash-attn's custom op has a CUDA kernel only: a CPU tensor stops at torch's dispatcher
    with pytest.raises(NotImplementedError, match="'CPU' backend"):
        flash_attn._flash_attn_forward(q, q, q, 0.0, 0.125, True, -1, -1, 0.0, None, False)
    # the op's Python body and the functions that are no custom op reach the stand-in
    with pytest.raises(RuntimeError, match="stand-in: no CUDA build here.*fwd"):
        flash_attn._flash_attn_forward._init_fn(q, q, q, 0.0, 0.125, True, -1, -1, 0.0,
                                                None, False)
    with pytest.raises(RuntimeError, match="stand-in: no CUDA build here.*fwd_kvcache"):
        flash_attn.flash_attn_with_kvcache(q, q, q, causal=True)
    # private names stay missing: the import machinery sees an ordinary module
    assert not hasattr(stand_in, "__path__")


def test_fake_tensors_without_a_fake_implementation_are_refused_too(stand_in, fake_cuda):
    q = torch.empty(1, 8, 2, 64, device="cuda", dtype=BF16)
    with pytest.raises(RuntimeError, match="no fake implementation"):
        stand_in.fwd_kvcache(q, q, q)


def test_cpbench_flash_attn_backend_is_importable(flash_attn):
    assert FLASH_ATTN.is_importable(), FLASH_ATTN.import_error()
    assert kernels.get("flash-attn") is FLASH_ATTN


@pytest.mark.parametrize("kv_heads", [H, 8])
def test_forward_and_backward_through_cpbench_mapping(flash_attn, fake_cuda, kv_heads):
    q = torch.empty(1, S, H, D, device="cuda", dtype=BF16)
    k, v = (torch.empty(1, S, kv_heads, D, device="cuda", dtype=BF16) for _ in range(2))
    out, lse = FLASH_ATTN.forward(q, k, v, causal=True, softmax_scale=D ** -0.5)
    assert (out.shape, out.dtype, out.device.type) == (q.shape, BF16, "cuda")
    # cpbench's convention (kernels/base.py): lse fp32, (batch, heads, seq_q)
    assert (lse.shape, lse.dtype, lse.device.type) == ((1, H, S), torch.float32, "cuda")
    dout = torch.empty_like(out)
    dq, dk, dv = FLASH_ATTN.backward(dout, q, k, v, out, lse, causal=True,
                                     softmax_scale=D ** -0.5)
    for g, t in ((dq, q), (dk, k), (dv, v)):
        assert (g.shape, g.dtype, g.device.type) == (t.shape, BF16, "cuda")


def test_varlen_forward_and_backward(flash_attn, fake_cuda):
    # the varlen contract of kernels/base.py: (tokens, heads, dim), lse (heads, tokens) fp32
    seqs = [S // 2, S // 4, S // 4]
    cu = torch.tensor([0, seqs[0], seqs[0] + seqs[1], S], dtype=torch.int32, device="cuda")
    q, k, v = (torch.empty(S, H, D, device="cuda", dtype=BF16) for _ in range(3))
    out, lse, _, _ = flash_attn._flash_attn_varlen_forward(
        q, k, v, cu, cu, max(seqs), max(seqs), 0.0, D ** -0.5, True)
    assert (out.shape, out.dtype, out.device.type) == (q.shape, BF16, "cuda")
    assert (lse.shape, lse.dtype) == ((H, S), torch.float32)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    flash_attn._flash_attn_varlen_backward(
        torch.empty_like(out), q, k, v, out, lse, dq, dk, dv, cu, cu, max(seqs), max(seqs),
        0.0, D ** -0.5, True, -1, -1, 0.0, None, False)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_direct_forward_and_backward(flash_attn, fake_cuda):
    q, k, v = (torch.empty(1, S, H, D, device="cuda", dtype=BF16) for _ in range(3))
    out, lse, _, _ = flash_attn._flash_attn_forward(q, k, v, 0.0, D ** -0.5, True, -1, -1,
                                                    0.0, None, False)
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, (1, H, S), torch.float32)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    flash_attn._flash_attn_backward(torch.empty_like(out), q, k, v, out, lse, dq, dk, dv,
                                    0.0, D ** -0.5, True, -1, -1, 0.0, None, False)
    assert dq.shape == q.shape and dq.device.type == "cuda"
