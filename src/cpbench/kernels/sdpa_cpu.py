"""aten's CPU flash-attention kernel, which returns a logsumexp.

Measured with torch 2.13 (and re-checked by tests/unit/test_kernels.py): layout (B, H, S, D),
strided views accepted; lse fp32, natural log, (B, H, Sq); GQA accepted, dk/dv with kv heads;
causal with Sq != Sk is top-left aligned; no dropout, no bool masks. One head dim for Q, K
and V ("Q/K/V should have the same head size", 2.11 and 2.13 run): a V of its own width (MLA)
is zero-padded to the wider for the call and sliced back into a tensor of its own
(``base.one_width``; exact).

A fully masked row comes back as out = 0 and lse = 0 (not -inf), which would poison an LSE
merge. Strategies therefore never hand this backend a block with fully masked rows: they skip
blocks that are entirely in the future and ask for causal only on equal-length diagonal blocks.
"""

from __future__ import annotations

import torch

from cpbench import torchcompat
from cpbench.kernels.base import KernelBackend, check_shapes, one_width

_FWD = "_scaled_dot_product_flash_attention_for_cpu"
_BWD = "_scaled_dot_product_flash_attention_for_cpu_backward"


def _importable() -> bool:
    return hasattr(torch.ops.aten, _FWD) and hasattr(torch.ops.aten, _BWD)


def _bhsd(x_bshd: torch.Tensor) -> torch.Tensor:
    return x_bshd.transpose(1, 2)


def flash_forward(q, k, v, *args, **kwargs):
    """aten's CPU flash forward on (b, s, h, d) tensors, V of any width: (out bshd, lse)."""
    dv = v.shape[-1]
    q, k, v = one_width(q, k, v, width=max(q.shape[-1], dv))
    out_bhsd, lse_bhs = torchcompat.cpu_flash_forward(_bhsd(q), _bhsd(k), _bhsd(v), *args,
                                                      **kwargs)
    return _own(out_bhsd.transpose(1, 2), dv), lse_bhs


def flash_backward(dout, q, k, v, out, *args, **kwargs):
    """Its backward on (b, s, h, d) tensors: (dq, dk, dv) at q, k, v's widths."""
    d, dv = q.shape[-1], v.shape[-1]
    width = max(d, dv)
    grads = torchcompat.cpu_flash_backward(
        *(_bhsd(x) for x in one_width(dout, q, k, v, out, width=width)), *args, **kwargs)
    return tuple(_own(g.transpose(1, 2), w) for g, w in zip(grads, (d, d, dv)))


def _own(x_bshd: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` cut back to ``width`` columns, in a tensor of its own when cut (as a GPU kernel
    writes it): a strided slice would cost every all-to-all after it one more copy."""
    return x_bshd if x_bshd.shape[-1] == width else x_bshd[..., :width].contiguous()


def forward(q, k, v, *, causal: bool, softmax_scale: float):
    check_shapes(q, k, v, causal, causal_unequal=True)
    return flash_forward(q, k, v, 0.0, causal, scale=softmax_scale)


def backward(dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float):
    check_shapes(q, k, v, causal, causal_unequal=True)
    return flash_backward(dout, q, k, v, out.to(q.dtype), lse.float().contiguous(), 0.0,
                          causal, scale=softmax_scale)


BACKEND = KernelBackend(
    name="sdpa-cpu",
    description="aten's CPU flash kernel (_scaled_dot_product_flash_attention_for_cpu)",
    forward=forward,
    backward=backward,
    devices=frozenset({"cpu"}),
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64}),
    causal_unequal=True,  # top-left aligned, as the float64 reference
    unequal_head_dims=True,  # V zero-padded to the Q/K width for the op (flash_forward)
    is_importable=_importable,
)
