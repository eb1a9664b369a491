"""Make this package importable as ``flash_attn`` when, and only when, no flash-attn exists."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

MARKER = "CPBENCH_CPU_INTERFACE"
_NAMES = ("flash_attn", "flash_attn.flash_attn_interface")


def is_cpu_interface(module: types.ModuleType | None) -> bool:
    """Whether ``module`` is cpbench's CPU interface rather than a real flash-attn."""
    return getattr(module, MARKER, False) is True


def _real_flash_attn_exists() -> bool:
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):  # a broken install still counts: never shadow it
        return True


def install() -> bool:
    """Register this package as ``flash_attn`` (and its ``flash_attn_interface``) in
    ``sys.modules`` unless a flash-attn is already imported or importable. Idempotent; call it
    in every process (spawned ranks included) before importing ring-flash-attn or yunchang.

    Returns whether ``import flash_attn`` now gives the CPU interface.
    """
    current = sys.modules.get("flash_attn")
    if current is not None:
        return is_cpu_interface(current)
    if _real_flash_attn_exists():
        return False
    package = importlib.import_module("cpbench.kernels.flash_attn_cpu")
    sys.modules[_NAMES[1]] = package.flash_attn_interface
    sys.modules[_NAMES[0]] = package
    return True
