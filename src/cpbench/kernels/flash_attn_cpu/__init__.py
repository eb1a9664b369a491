"""flash-attn 2.8.3's Python interface on CPU, for running upstream CP libraries' real code.

ring-flash-attn and yunchang call ``flash_attn.flash_attn_interface``'s internal functions
(``_flash_attn_forward`` and friends, lse returned) and read ``flash_attn.__version__``. This
package implements that interface on aten's CPU flash kernel, with flash-attn's semantics
(bottom-right causal, sliding windows, +inf lse for rows that see no key, varlen lse as
(heads, total_q)); ``install()`` makes it importable as ``flash_attn`` where no flash-attn is
installed. ``__version__`` names the interface generation implemented, not an installed
flash-attn; ``CPBENCH_CPU_INTERFACE`` marks it as cpbench's. ``FLASH_ATTN_CPU`` is the kernel
backend on top of it.
"""

from __future__ import annotations

from cpbench.kernels.flash_attn_cpu import flash_attn_interface
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
    "flash_attn_func",
    "flash_attn_interface",
    "flash_attn_varlen_func",
    "install",
    "is_cpu_interface",
]
