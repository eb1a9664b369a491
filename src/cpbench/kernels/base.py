"""The attention-kernel interface every CP strategy calls.

A backend computes attention of one (q block, k/v block) pair and returns the softmax
log-sum-exp alongside the output, so partial results from different ranks can be merged.

Conventions shared by all backends:
- tensors are (batch, seq, heads, head_dim) — "bshd";
- ``lse`` is fp32, shape (batch, heads, seq_q), natural log;
- ``causal`` with seq_q == seq_k is the usual diagonal mask; strategies only ask for causal
  on equal-length blocks (others are either fully visible or skipped). With seq_q != seq_k
  a backend that declares ``causal_unequal`` aligns the mask top-left (query i sees keys
  0..i, as the float64 reference does); flash-attn aligns it bottom-right and declares
  False, so ``resolve`` refuses such a request for it;
- k/v may have fewer heads than q (GQA, heads % kv_heads == 0); dk/dv come back with kv_heads;
- v may have its own head dim (MLA: Q/K 192, V 128) where the backend declares
  ``unequal_head_dims``; out and dout then have V's width;
- ``backward`` receives the *final* (merged) out and lse, as flash-attention's backward does,
  so a block's probabilities are exp(s - lse_global) and the block gradients add up exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

ForwardFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
BackwardFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# Varlen (packed sequences, flash-attn's convention), for masked blocks on GPUs:
#   varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, softmax_scale,
#                  window=(-1, -1)) -> (out (t_q, h, d), lse (h, t_q) fp32)
#   varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal,
#                   softmax_scale, window=(-1, -1)) -> (dq, dk, dv) at q, k, v's sizes
# q, k, v are (tokens, heads, dim); cu_q / cu_k int32 on the tensors' device; max_q / max_k
# Python ints (known when the tiles are planned: no host sync); causal and the window
# (left, right; -1: unbounded) are bottom-right aligned per sequence, as flash-attn's.
VarlenForwardFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
VarlenBackwardFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


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
    causal_unequal: bool = False  # causal with seq_q != seq_k, top-left aligned
    # V (and out) with a head dim of their own; False: the kernel takes one width (flash-attn
    # 2's and torch's CUDA flash op check that Q, K and V share it) and refuses the request
    unequal_head_dims: bool = False
    is_importable: Callable[[], bool] = field(default=lambda: True)
    # the real reason the backend does not import (the exception, one line), or None
    import_error: Callable[[], str | None] | None = None
    # what this install and this device allow beyond the fields above (a GPU generation, an
    # API generation's head dims): why not, or None; called as limits(device, dtype, head_dim)
    limits: Callable[[str, torch.dtype, int], str | None] | None = None
    # where the kernel comes from: {"distribution", "version", "path"} (None: built in)
    provenance: Callable[[], dict | None] = field(default=lambda: None)
    # packed sequences with per-sequence causal / window masks (see VarlenForwardFn); None:
    # the backend has none, and masked blocks on its device are refused
    varlen_forward: VarlenForwardFn | None = None
    varlen_backward: VarlenBackwardFn | None = None

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
        seqlen_q: int | None = None,
        seqlen_k: int | None = None,
        causal: bool = False,
        v_head_dim: int | None = None,
    ) -> str | None:
        """Why this backend cannot run the request, or None if it can. The sequence
        lengths only matter for causal attention with seqlen_q != seqlen_k; ``v_head_dim``
        (None: ``head_dim``) only where it differs."""
        why = self.import_error() if self.import_error else (
            None if self.is_importable() else "not installed")
        if why is not None:
            return f"{self.name} cannot be imported: {why}"
        if device not in self.devices:
            return f"{self.name} does not run on {device}"
        if dtype not in self.dtypes:
            return f"{self.name} does not support {dtype_name(dtype)}"
        if head_dim > self.max_head_dim or head_dim % self.head_dim_multiple:
            return (
                f"{self.name} needs head_dim <= {self.max_head_dim} and a multiple of "
                f"{self.head_dim_multiple}, got {head_dim}"
            )
        if v_head_dim not in (None, head_dim):
            if not self.unequal_head_dims:
                return (f"{self.name} takes one head dim for Q, K and V (got {head_dim}, V "
                        f"{v_head_dim})")
            if v_head_dim > self.max_head_dim or v_head_dim % self.head_dim_multiple:
                return (f"{self.name} needs v_head_dim <= {self.max_head_dim} and a multiple "
                        f"of {self.head_dim_multiple}, got {v_head_dim}")
        limit = self.limits(device, dtype, head_dim) if self.limits else None
        if limit is not None:
            return limit
        if kv_heads != heads and not self.gqa:
            return f"{self.name} does not support GQA (kv_heads != heads)"
        if causal and seqlen_q != seqlen_k and not self.causal_unequal:
            return (f"{self.name} does not support causal attention with seqlen_q "
                    f"{seqlen_q} != seqlen_k {seqlen_k}")
        return None


def cuda_flash(**fields: Any) -> KernelBackend:
    """A CUDA flash kernel (flash-attn 2 and 3, torch's flash op), with what all of them
    support: bf16 and fp16 (FA3's fp8 is forward-only), head dims up to 256 in multiples of 8
    (the internal functions do not pad; flash_attn_func does), causal bottom-right aligned
    (FlashAttention-2's convention, see ``causal_unequal``)."""
    return KernelBackend(devices=frozenset({"cuda"}),
                         dtypes=frozenset({torch.bfloat16, torch.float16}),
                         max_head_dim=256, head_dim_multiple=8, causal_unequal=False, **fields)


ALIGN_BYTES = 16  # the CUDA flash kernels' 128-bit loads (and FA3's TMA) need 16-byte bases


def flash_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the CUDA flash kernels (flash-attn 2 and 3, torch's flash op) take it: a unit
    last stride (they refuse any other) and a 16-byte-aligned base (a view starting mid-row of
    a packed buffer fails with "misaligned address", a CUDA error no later call survives);
    copied only when it is not."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t if _address(t) % ALIGN_BYTES == 0 else t.clone()


def _address(t: torch.Tensor) -> int:
    """The base address, or for a fake tensor (the dry run: no memory) its offset into its
    storage, whose own base the caching allocator aligns to far more than 16 bytes."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(t, FakeTensor):
        return int(t.storage_offset()) * t.element_size()  # an int: no symbolic shapes
    return t.data_ptr()


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


def one_width(*xs: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
    """Each of ``xs`` zero-padded on its last dim to ``width``, for an op that takes one head
    dim for Q, K and V (aten's CPU flash op: "Q/K/V should have the same head size", torch 2.5
    to 2.15). Exact: zero columns of Q and K add nothing to QKᵀ, zero columns of V give zero
    columns of out (and of dout, nothing to dP); the caller slices them off. It costs the
    wider width in both products."""
    return tuple(x if x.shape[-1] == width else torch.nn.functional.pad(
        x, (0, width - x.shape[-1])) for x in xs)


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, *,
                 causal_unequal: bool = False) -> None:
    """Invariants every backend relies on; violations are programming errors in a strategy
    (a user's request was checked by ``unsupported_reason`` before). ``causal_unequal``: the
    backend's own declaration."""
    assert q.dim() == 4 and k.dim() == 4 and v.dim() == 4, "expected (batch, seq, heads, dim)"
    assert k.shape[:3] == v.shape[:3], f"k {tuple(k.shape)} and v {tuple(v.shape)} differ"
    assert q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3]
    assert q.shape[2] % k.shape[2] == 0, "heads must be a multiple of kv_heads"
    assert not causal or causal_unequal or q.shape[1] == k.shape[1], (
        "this backend needs causal blocks of equal q/k length")
