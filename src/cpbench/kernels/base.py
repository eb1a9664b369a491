"""The attention-kernel interface every CP strategy calls.

A backend computes attention of one (q block, k/v block) pair and returns the softmax
log-sum-exp alongside the output, so partial results from different ranks can be merged.

Conventions shared by all backends:
- tensors are (batch, seq, heads, head_dim) — "bshd";
- ``lse`` is fp32, shape (batch, heads, seq_q), natural log;
- ``causal`` with seq_q == seq_k is the usual diagonal mask; strategies only ask for causal
  on equal-length blocks (others are either fully visible or skipped);
- k/v may have fewer heads than q (GQA, heads % kv_heads == 0); dk/dv come back with kv_heads;
- ``backward`` receives the *final* (merged) out and lse, as flash-attention's backward does,
  so a block's probabilities are exp(s - lse_global) and the block gradients add up exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

ForwardFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
BackwardFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, kw_only=True)
class KernelBackend:
    """A named attention backend and what it supports."""

    name: str
    description: str
    forward: ForwardFn
    backward: BackwardFn
    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    max_head_dim: int = 1024
    head_dim_multiple: int = 1
    gqa: bool = True
    causal_unequal: bool = True
    is_importable: Callable[[], bool] = field(default=lambda: True)

    def is_available(self, device: str | None = None) -> bool:
        """Whether this backend can run here (on ``device`` if given)."""
        if not self.is_importable():
            return False
        if device is not None:
            return device in self.devices and _device_present(device)
        return any(_device_present(d) for d in self.devices)

    def unsupported_reason(
        self,
        *,
        device: str,
        dtype: torch.dtype,
        head_dim: int,
        heads: int,
        kv_heads: int,
    ) -> str | None:
        """Why this backend cannot run the request, or None if it can."""
        if not self.is_importable():
            return f"{self.name} is not installed"
        if device not in self.devices:
            return f"{self.name} does not run on {device}"
        if dtype not in self.dtypes:
            return f"{self.name} does not support {dtype_name(dtype)}"
        if head_dim > self.max_head_dim or head_dim % self.head_dim_multiple:
            return (
                f"{self.name} needs head_dim <= {self.max_head_dim} and a multiple of "
                f"{self.head_dim_multiple}, got {head_dim}"
            )
        if kv_heads != heads and not self.gqa:
            return f"{self.name} does not support GQA (kv_heads != heads)"
        return None


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                torch.float64: "fp64"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _device_present(device: str) -> bool:
    if device == "cpu":
        return True
    if device == "cuda":
        return torch.cuda.is_available()
    return False


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """Invariants every backend relies on; violations are programming errors in a strategy."""
    assert q.dim() == 4 and k.dim() == 4 and v.dim() == 4, "expected (batch, seq, heads, dim)"
    assert k.shape == v.shape, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ"
    assert q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3]
    assert q.shape[2] % k.shape[2] == 0, "heads must be a multiple of kv_heads"
    assert not causal or q.shape[1] == k.shape[1], "causal blocks must have equal q/k length"
