"""flash-attn 2.8.3's Python interface where flash-attn is absent, for running upstream CP
libraries' real code: on CPU, and on CUDA GPUs without a flash-attn build.

ring-flash-attn and yunchang call ``flash_attn.flash_attn_interface``'s internal functions
(``_flash_attn_forward`` and friends, lse returned) and read ``flash_attn.__version__``. This
package implements that interface with flash-attn's semantics (bottom-right causal, sliding
windows, +inf lse for rows that see no key, lse (b, h, s) and varlen (heads, total_q) fp32,
gradients written into the caller's buffers): on CPU tensors on aten's CPU flash kernel, on
CUDA tensors on torch's own FlashAttention-2 ops (``_cuda``; the strategies' ``--kernel sdpa``).
``install()`` makes it importable as ``flash_attn`` where no flash-attn is installed.
``__version__`` names the interface generation implemented, not an installed flash-attn;
``CPBENCH_CPU_INTERFACE`` marks it as cpbench's (the name predates CUDA).
``FLASH_ATTN_CPU`` is the CPU kernel backend on top of it. The package name says CPU for the
same reason.
"""

from __future__ import annotations

from cpbench.kernels.flash_attn_cpu import flash_attn_interface
from cpbench.kernels.flash_attn_cpu._cuda import import_error as cuda_import_error
from cpbench.kernels.flash_attn_cpu._install import install, is_cpu_interface
from cpbench.kernels.flash_attn_cpu.backend import FLASH_ATTN_CPU
from cpbench.kernels.flash_attn_cpu.flash_attn_interface import (
    flash_attn_func,
    flash_attn_varlen_func,
)

__version__ = "2.8.3"  # the flash-attn interface generation this implements
CPBENCH_CPU_INTERFACE = True

__all__ = [
    "CPBENCH_CPU_INTERFACE",
    "FLASH_ATTN_CPU",
    "cuda_import_error",
    "flash_attn_func",
    "flash_attn_interface",
    "flash_attn_varlen_func",
    "install",
    "is_cpu_interface",
]
