"""The ``flash-attn-cpu`` kernel backend: cpbench's kernel protocol through the CPU flash-attn
2.8.3 interface's ``_flash_attn_forward``/``_flash_attn_backward``, so that interface is tested
like any kernel. Causal with seq_q != seq_k would be bottom-right aligned, as flash-attn's, so
the backend declares ``causal_unequal=False`` and ``resolve`` refuses it."""

from __future__ import annotations

import torch

from cpbench.kernels.base import KernelBackend, check_shapes
from cpbench.kernels.flash_attn_cpu import _kernel
from cpbench.kernels.flash_attn_cpu._internal import _flash_attn_backward, _flash_attn_forward


def forward(q, k, v, *, causal: bool, softmax_scale: float):
    check_shapes(q, k, v, causal)
    out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, float(softmax_scale), bool(causal),
                                         -1, -1, 0.0, None, False)
    return out, lse


def backward(dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float):
    check_shapes(q, k, v, causal)
    # out and dout may come from an fp32 merge; flash-attn wants them in q's dtype.
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_backward(dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, dq, dk, dv, 0.0,
                         float(softmax_scale), bool(causal), -1, -1, 0.0, None, False)
    return dq, dk, dv


FLASH_ATTN_CPU = KernelBackend(
    name="flash-attn-cpu",
    description="flash-attn 2.8.3's internal interface on CPU (aten's CPU flash kernel)",
    devices=frozenset({"cpu"}),
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
    forward=forward,
    backward=backward,
    causal_unequal=False,  # bottom-right aligned, unlike the float64 reference
    is_importable=_kernel.importable,
)
