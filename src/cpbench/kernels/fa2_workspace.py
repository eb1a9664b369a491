"""What FlashAttention-2's CUDA backward allocates for itself, beside its inputs and results:
bytes ``torch.cuda.max_memory_allocated`` counts while the kernel runs, and that fake tensors
(the dry run) do not show, since the buffers live inside the C++ call.

Read from flash-attn 2.8.3 ``csrc/flash_attn/flash_api.cpp`` (``mha_bwd``: rounding L834-L835,
buffers L883-L900; ``mha_varlen_bwd``: L1051-L1052, L1100-L1123) and torch's vendored copy
(``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``, ``mha_bwd`` /
``mha_varlen_bwd``: the same allocations), for the non-deterministic backward cpbench calls:

- ``softmax_d``: fp32 (b, h, ⌈s_q⌉₁₂₈); varlen (h, total_q + 128·b);
- ``dq_accum``: fp32 (b, ⌈s_q⌉₁₂₈, h, ⌈d⌉) with ⌈d⌉ = d rounded up to 32 (d ≤ 128) or to
  64; varlen (total_q + 128·b, h, ⌈d⌉): "we don't want to allocate dq_accum of size (batch,
  seqlen_q_rounded, ...)" (L1103);
- under GQA (fewer k/v heads than q heads), ``dk_expanded`` and ``dv_expanded`` in the
  activation dtype: (b, s_k, h, d), varlen (total_k, h, d), summed into dk, dv afterwards.

flash-attn's own fake implementations (``flash_attn/flash_attn_interface.py``
``_flash_attn_backward_fake`` L318, ``_flash_attn_varlen_backward_fake`` L429) allocate
``softmax_d`` (the ops return it), so for its ops only the rest is missing; torch's
meta functions for its flash ops allocate none of them. The forward's split-KV buffers (only
when b·h·⌈s_q/64⌉ is small against the GPU's SMs) and FlashAttention-3's buffers are not
counted here.
"""

from __future__ import annotations

import torch

FP32 = 4
ROWS = 128  # flash-attn rounds the query rows of its backward's buffers up to this


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def head_dim_rounded(d: int) -> int:
    return _round_up(d, 32 if d <= 128 else 64)


def backward_bytes(*, batch: int, seqlen_q: int, seqlen_k: int, heads: int, kv_heads: int,
                   head_dim: int, element_size: int, softmax_d: bool = True) -> int:
    """The dense backward's own buffers for q (b, s_q, h, d), k and v (b, s_k, h_k, d)."""
    return int(buffer_bytes(rows=batch * _round_up(seqlen_q, ROWS), keys=batch * seqlen_k,
                            heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            element_size=element_size, softmax_d=softmax_d))


def varlen_backward_bytes(*, total_q: int, total_k: int, sequences: int, heads: int,
                          kv_heads: int, head_dim: int, element_size: int,
                          softmax_d: bool = True) -> int:
    """The varlen backward's for q (total_q, h, d), k and v (total_k, h_k, d) of
    ``sequences`` sequences."""
    return int(buffer_bytes(rows=total_q + ROWS * sequences, keys=total_k, heads=heads,
                            kv_heads=kv_heads, head_dim=head_dim, element_size=element_size,
                            softmax_d=softmax_d))


def buffer_bytes(*, rows: float, keys: float, heads: float, kv_heads: float, head_dim: int,
                 element_size: int, softmax_d: bool = True) -> float:
    """The buffers for ``rows`` query rows as the kernel pads them (the simulator, whose
    figures scale with S, gives them unpadded) and ``keys`` key rows, over all batches."""
    total = rows * heads * head_dim_rounded(head_dim) * FP32  # dq_accum
    if softmax_d:
        total += rows * heads * FP32
    if kv_heads != heads:  # dk_expanded, dv_expanded
        total += 2 * keys * heads * head_dim * element_size
    return total


# the ops that run FA2's backward on CUDA: (q's layout, whether the op's fake implementation
# allocates softmax_d itself); packed (tokens, heads, dim) wherever query offsets are given
_OPS = {"flash_attn::_flash_attn_backward": ("bshd", True),
        "flash_attn::_flash_attn_varlen_backward": ("bshd", True),
        "aten::_flash_attention_backward": ("bshd", False),
        "aten::_scaled_dot_product_flash_attention_backward": ("bhsd", False)}
# the schemas' names for q, k and the query offsets (flash-attn's, then torch's)
_Q, _K, _CU = ("q", "query"), ("k", "key"), ("cu_seqlens_q", "cum_seq_q")


def op_bytes(func, args: tuple, kwargs: dict) -> int:
    """The bytes FA2's backward holds inside op ``func`` called on CUDA tensors with
    ``args`` / ``kwargs`` (0 for any other op): for a meter of what the op's fake or meta
    function allocates."""
    name = getattr(getattr(func, "_schema", None), "name", None)
    if name not in _OPS:
        return 0
    bound = _bind(func, args, kwargs)
    q = next(bound[n] for n in _Q if n in bound)
    k = next(bound[n] for n in _K if n in bound)
    cu = next((bound[n] for n in _CU if bound.get(n) is not None), None)
    if q.device.type != "cuda":
        return 0
    layout, fake_has_softmax_d = _OPS[name]
    qs, ks = list(q.shape), list(k.shape)
    if layout == "bhsd":  # as (b, s, h, d)
        qs[1:3], ks[1:3] = qs[2:0:-1], ks[2:0:-1]
    shape = dict(heads=qs[-2], kv_heads=ks[-2], head_dim=qs[-1],
                 element_size=q.element_size(), softmax_d=not fake_has_softmax_d)
    if cu is not None:
        return varlen_backward_bytes(total_q=qs[0], total_k=ks[0], sequences=cu.shape[0] - 1,
                                     **shape)
    return backward_bytes(batch=qs[0], seqlen_q=qs[1], seqlen_k=ks[1], **shape)


def _bind(func, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by their schema names."""
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return {n: v for n, v in bound.items() if isinstance(v, torch.Tensor) or v is None}
