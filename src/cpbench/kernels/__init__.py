"""Attention kernel backends: ``get(name)``, ``resolve(name, ...)``, ``available()``.

A backend is a ``KernelBackend`` (see ``base.py``). ``auto`` picks, on CUDA, FlashAttention-3
where it can run (an sm90 GPU, a build whose API runs the request), else flash-attn 2, else
torch's own flash kernel (``sdpa``), and never the plain-torch reference (full S × S scores:
out of memory at long S, or ~10× slower): with none of them it is an error with each one's
reason. On CPU it picks the CPU flash kernel
(sdpa-cpu), else the reference.
"""

from __future__ import annotations

from typing import Any

from cpbench.errors import UsageError, unknown
from cpbench.kernels import flash_attn_cpu, sdpa, sdpa_cpu, torch_ref
from cpbench.kernels.base import KernelBackend

_BACKENDS: dict[str, KernelBackend] = {
    b.name: b for b in (torch_ref.BACKEND, sdpa_cpu.BACKEND, flash_attn_cpu.FLASH_ATTN_CPU,
                        sdpa.BACKEND)
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
        raise UsageError(unknown("kernel", name, names(), "docs/run.md"))
    return _BACKENDS[name]


def available(device: str | None = None) -> list[str]:
    """Names of the backends that can run on this machine (on ``device`` if given)."""
    return [n for n, b in _BACKENDS.items() if b.is_available(device)]


def resolve(name: str, *, notes: list[str] | None = None, **request: Any) -> KernelBackend:
    """The backend for ``name`` (``auto`` allowed) that can run ``request``: the keyword
    arguments of ``KernelBackend.unsupported_reason`` (device, dtype, head_dim, heads,
    kv_heads; the sequence lengths and causal where they matter).

    Raises ValueError naming the backends that would work. ``notes``: where ``auto`` passed
    over a backend that is installed (FA3 on a non-Hopper GPU), a line saying why.
    """
    if name == AUTO:
        return _auto(request["device"], request, [] if notes is None else notes)
    backend = get(name)
    reason = backend.unsupported_reason(**request)
    if reason is not None:
        working = [n for n, b in _BACKENDS.items() if b.unsupported_reason(**request) is None]
        hint = f"use --kernel {' or '.join(working[:2])}" if working else \
            "no backend can run it here"
        raise UsageError(f"{reason}; {hint}")
    return backend


# auto's candidates by device, best first; on CUDA never the reference
AUTO_ORDER = {"cuda": ("flash-attn3", "flash-attn", "sdpa"), "cpu": ("sdpa-cpu", "torch")}


def _auto(device: str, request: dict, notes: list[str]) -> KernelBackend:
    order = [n for n in AUTO_ORDER.get(device, ()) if n in _BACKENDS]
    reasons = {n: _BACKENDS[n].unsupported_reason(**request) for n in order}
    for i, n in enumerate(order):
        if reasons[n] is None:
            notes += [f"{m} ({reasons[m]}): using {n}" for m in order[:i]
                      if _BACKENDS[m].is_importable()]
            return _BACKENDS[n]
    why = "; ".join(r for r in reasons.values() if r) or f"no kernel backend for {device}"
    if device == "cuda":
        raise UsageError(
            f"--kernel auto found no flash kernel that runs this on CUDA: {why}; fix that "
            f"(pip install flash-attn --no-build-isolation; --dtype bf16 or fp16), or ask "
            f"for the plain-torch reference with --kernel torch (full S x S scores: far "
            f"slower, out of memory at long sequences)")
    raise UsageError(f"no kernel backend runs this request: {why}")


__all__ = ["KernelBackend", "available", "get", "names", "resolve", "AUTO"]
