"""What ``install()`` maps to ``flash_attn.flash_attn_interface``: flash-attn 2.8.3's internal
and public functions, on CPU and on CUDA without flash-attn (see ``_internal`` and
``_autograd``)."""

from __future__ import annotations

from cpbench.kernels.flash_attn_cpu._autograd import flash_attn_func, flash_attn_varlen_func
from cpbench.kernels.flash_attn_cpu._internal import (
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
)

# Marks this as cpbench's stand-in, so nothing mistakes it for an installed flash-attn.
CPBENCH_CPU_INTERFACE = True

__all__ = [
    "_flash_attn_backward",
    "_flash_attn_forward",
    "_flash_attn_varlen_backward",
    "_flash_attn_varlen_forward",
    "flash_attn_func",
    "flash_attn_varlen_func",
]
