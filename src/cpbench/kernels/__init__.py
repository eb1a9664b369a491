"""Attention kernel backends: ``get(name)``, ``resolve(name, ...)``, ``available()``.

A backend is a ``KernelBackend`` (see ``base.py``). ``auto`` picks flash-attn on CUDA when it
imports, else the CPU flash kernel on CPU, else the plain-torch reference.
"""

from __future__ import annotations

import torch

from cpbench.errors import UsageError
from cpbench.kernels import flash_attn_cpu, sdpa_cpu, torch_ref
from cpbench.kernels.base import KernelBackend

_BACKENDS: dict[str, KernelBackend] = {
    b.name: b for b in (torch_ref.BACKEND, sdpa_cpu.BACKEND, flash_attn_cpu.FLASH_ATTN_CPU)
}
try:  # the GPU backends are thin argument mappings; they import flash_attn lazily
    from cpbench.kernels import flash_attn as _fa

    _BACKENDS[_fa.FLASH_ATTN.name] = _fa.FLASH_ATTN
    _BACKENDS[_fa.FLASH_ATTN3.name] = _fa.FLASH_ATTN3
except ImportError:  # pragma: no cover - only while the module is being written
    pass

AUTO = "auto"


def names() -> list[str]:
    """Every known backend name, ``auto`` first."""
    return [AUTO, *_BACKENDS]


def get(name: str) -> KernelBackend:
    if name not in _BACKENDS:
        raise UsageError(f"unknown kernel {name!r}; choose one of: {', '.join(names())}")
    return _BACKENDS[name]


def available(device: str | None = None) -> list[str]:
    """Names of the backends that can run on this machine (on ``device`` if given)."""
    return [n for n, b in _BACKENDS.items() if b.is_available(device)]


def resolve(
    name: str,
    *,
    device: str,
    dtype: torch.dtype,
    head_dim: int,
    heads: int,
    kv_heads: int,
    seqlen_q: int | None = None,
    seqlen_k: int | None = None,
    causal: bool = False,
) -> KernelBackend:
    """The backend for ``name`` (``auto`` allowed) that can run this request.

    Raises ValueError naming the backends that would work.
    """
    request = dict(device=device, dtype=dtype, head_dim=head_dim, heads=heads, kv_heads=kv_heads,
                   seqlen_q=seqlen_q, seqlen_k=seqlen_k, causal=causal)
    if name == AUTO:
        order = ["flash-attn3", "flash-attn"] if device == "cuda" else ["sdpa-cpu"]
        for candidate in [*order, "torch"]:
            b = _BACKENDS.get(candidate)
            if b is not None and b.unsupported_reason(**request) is None:
                return b
        reasons = "; ".join(b.unsupported_reason(**request) for b in _BACKENDS.values())
        raise UsageError(f"no kernel backend runs this request: {reasons}")
    backend = get(name)
    reason = backend.unsupported_reason(**request)
    if reason is not None:
        working = [n for n, b in _BACKENDS.items() if b.unsupported_reason(**request) is None]
        hint = f"use --kernel {' or '.join(working)}" if working else "no backend can run it here"
        raise UsageError(f"{reason}; {hint}")
    return backend


__all__ = ["KernelBackend", "available", "get", "names", "resolve", "AUTO"]
