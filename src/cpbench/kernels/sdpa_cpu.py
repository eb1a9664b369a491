"""aten's CPU flash-attention kernel, which returns a logsumexp.

Measured with torch 2.13 (and re-checked by tests/unit/test_kernels.py): layout (B, H, S, D),
strided views accepted; lse fp32, natural log, (B, H, Sq); GQA accepted, dk/dv with kv heads;
causal with Sq != Sk is top-left aligned; no dropout, no bool masks.

A fully masked row comes back as out = 0 and lse = 0 (not -inf), which would poison an LSE
merge. Strategies therefore never hand this backend a block with fully masked rows: they skip
blocks that are entirely in the future and ask for causal only on equal-length diagonal blocks.
"""

from __future__ import annotations

import torch

from cpbench import torchcompat
from cpbench.kernels.base import KernelBackend, check_shapes

_FWD = "_scaled_dot_product_flash_attention_for_cpu"
_BWD = "_scaled_dot_product_flash_attention_for_cpu_backward"


def _importable() -> bool:
    return hasattr(torch.ops.aten, _FWD) and hasattr(torch.ops.aten, _BWD)


def _bhsd(x_bshd: torch.Tensor) -> torch.Tensor:
    return x_bshd.transpose(1, 2)


def forward(q, k, v, *, causal: bool, softmax_scale: float):
    check_shapes(q, k, v, causal, causal_unequal=True)
    out_bhsd, lse_bhs = torchcompat.cpu_flash_forward(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=softmax_scale
    )
    return out_bhsd.transpose(1, 2), lse_bhs


def backward(dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float):
    check_shapes(q, k, v, causal, causal_unequal=True)
    dq, dk, dv = torchcompat.cpu_flash_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out.to(q.dtype)),
        lse.float().contiguous(), 0.0, causal, scale=softmax_scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


BACKEND = KernelBackend(
    name="sdpa-cpu",
    description="aten's CPU flash kernel (_scaled_dot_product_flash_attention_for_cpu)",
    forward=forward,
    backward=backward,
    devices=frozenset({"cpu"}),
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64}),
    causal_unequal=True,  # top-left aligned, as the float64 reference
    is_importable=_importable,
)
