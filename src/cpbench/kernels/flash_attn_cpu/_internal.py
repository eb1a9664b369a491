"""flash-attn 2.8.3's four internal functions, on CPU and, without flash-attn, on CUDA.

On CPU they run aten's CPU flash kernel (``_kernel``); on CUDA, torch's own FlashAttention-2
ops (``_cuda``: its docstring lists where those differ from flash-attn). Names, parameter
names, order and defaults, return values and lse layouts are those of
flash_attn/flash_attn_interface.py at tag v2.8.3 (``_flash_attn_forward`` line 77,
``_flash_attn_varlen_forward`` 143, ``_flash_attn_backward`` 238, ``_flash_attn_varlen_backward``
330), so callers that build keyword arguments with ``inspect.getfullargspec`` (ring-flash-attn's
``get_default_args``) work unchanged. They are plain functions, not torch custom ops.

Not implemented, and refused loudly rather than ignored: dropout, ALiBi, softcap, paged KV
(``block_table``), and on CUDA ``leftpad_k``. On CPU wider than flash-attn: fp32/fp64 inputs
and any head_dim are accepted, ``deterministic`` changes nothing, ``rng_state`` is zeros. On
CUDA as narrow as flash-attn: fp16/bf16, head_dim a multiple of 8 up to 256.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from cpbench.kernels.flash_attn_cpu import _cuda, _kernel

Tensor = torch.Tensor
LSE_ROWS_PAD = 128  # flash-attn pads softmax_d's rows (and varlen segments) to 128


def _refuse_unsupported(dropout_p, softcap, alibi_slopes, block_table=None) -> None:
    where = "cpbench's flash-attn interface"
    if dropout_p > 0:
        raise NotImplementedError(f"{where}: dropout_p={dropout_p} > 0 is not implemented "
                                  "(aten's CPU kernel has no dropout; torch's CUDA op keeps "
                                  "its own rng state, not flash-attn's); pass dropout_p=0.0")
    if alibi_slopes is not None:
        raise NotImplementedError(f"{where}: alibi_slopes is not implemented (torch's FA2 "
                                  "backward takes none); pass None")
    if softcap > 0:  # flash-attn treats softcap <= 0 as off
        raise NotImplementedError(f"{where}: softcap={softcap} > 0 is not implemented (no "
                                  "aten flash op takes one); pass 0.0")
    if block_table is not None:
        raise NotImplementedError(f"{where}: paged KV (block_table) is not implemented")


def _check_return_softmax(return_softmax: bool) -> None:
    # mha_fwd's own check; with dropout refused above it always applies.
    if return_softmax:
        raise ValueError("return_softmax is only supported when p_dropout > 0.0")


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, token_dims: int) -> None:
    dims = token_dims + 2  # (b, s, h, d) or, varlen, (total, h, d)
    if q.dim() != dims or k.dim() != dims or k.shape != v.shape:
        raise ValueError(f"expected q, k, v with {dims} dims and k.shape == v.shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1] or q.shape[-2] % k.shape[-2]:
        raise ValueError("q and k need the same head_dim, and heads a multiple of kv heads")
    if q.shape[:token_dims - 1] != k.shape[:token_dims - 1]:
        raise ValueError(f"q and k have different batch sizes: {q.shape[0]} != {k.shape[0]}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _check_grad_buffers(q: Tensor, k: Tensor, v: Tensor, dq, dk, dv) -> None:
    """The given dq/dk/dv checked as mha_bwd does: q/k/v's shape and dtype, last dim
    contiguous (any other strides: ring-flash-attn passes views of longer buffers)."""
    for name, buf, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if buf is not None and (buf.shape != like.shape or buf.dtype != like.dtype
                                or buf.stride(-1) != 1):
            raise ValueError(f"{name} must have shape {tuple(like.shape)} and dtype {like.dtype} "
                             f"with a contiguous last dim, got {tuple(buf.shape)} {buf.dtype} "
                             f"strides {buf.stride()}")


def _grad_buffers(q: Tensor, k: Tensor, v: Tensor, dq, dk, dv, zero: bool = False):
    """The given dq/dk/dv, checked, or new ones where None (written in place: a caller that
    passes None gets nothing back, as with flash-attn)."""
    _check_grad_buffers(q, k, v, dq, dk, dv)
    bufs = []
    for buf, like in ((dq, q), (dk, k), (dv, v)):
        if buf is None:
            buf = torch.zeros_like(like)
        elif zero:
            buf.zero_()
        bufs.append(buf)
    return bufs


def _no_softmax(q: Tensor) -> Tuple[Tensor, Tensor]:
    """S_dmask and rng_state as mha_fwd returns them without dropout: empty, and 2 int64s."""
    return q.new_empty(0), torch.zeros(2, dtype=torch.int64)


def _flash_attn_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    return_softmax: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """q (b, sq, h, d), k/v (b, sk, hk, d) -> (out, softmax_lse (b, h, sq) fp32, S_dmask,
    rng_state). Rows that see no key: out 0, lse +inf."""
    _refuse_unsupported(dropout_p, softcap, alibi_slopes)
    _check_return_softmax(return_softmax)
    _check_qkv(q, k, v, token_dims=2)
    if _cuda.runs(q):
        return _cuda.forward(q, k, v, softmax_scale, causal, window_size_left, window_size_right)
    window = _kernel.key_window(causal, window_size_left, window_size_right, k.shape[1])
    out, lse = _kernel.forward(q, k, v, float(softmax_scale), *window)
    return (out, lse, *_no_softmax(q))


def _flash_attn_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Optional[Tensor],
    dk: Optional[Tensor],
    dv: Optional[Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    deterministic: bool,
    rng_state: Optional[Tensor] = None,
) -> Tensor:
    """Writes dq, dk, dv in place (they may be strided views) and returns softmax_d
    (b, h, round_up(sq, 128)) fp32."""
    _refuse_unsupported(dropout_p, softcap, alibi_slopes)
    _check_qkv(q, k, v, token_dims=2)
    if _cuda.runs(q):
        _cuda.check_deterministic(deterministic)
        _check_grad_buffers(q, k, v, dq, dk, dv)
        return _cuda.backward(dout, q, k, v, out, softmax_lse, (dq, dk, dv), softmax_scale,
                              causal, window_size_left, window_size_right)
    bufs = _grad_buffers(q, k, v, dq, dk, dv)
    window = _kernel.key_window(causal, window_size_left, window_size_right, k.shape[1])
    grads = _kernel.backward(dout, q, k, v, out, softmax_lse, float(softmax_scale), *window)
    for buf, grad in zip(bufs, grads):
        buf.copy_(grad)
    return _kernel.softmax_d(dout, out, pad_to=LSE_ROWS_PAD)


def _segments(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, leftpad_k: Optional[Tensor] = None,
              seqused_k: Optional[Tensor] = None):
    """(q_start, q_end, k_start, k_end) per sequence, read as flash-attn's BlockInfo does: keys
    start leftpad_k[i] after cu_seqlens_k[i] and end at cu_seqlens_k[i] + seqused_k[i] if given."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    pad = leftpad_k.tolist() if leftpad_k is not None else [0] * (len(cq) - 1)
    used = seqused_k.tolist() if seqused_k is not None else None
    for i in range(len(cq) - 1):
        k_end = ck[i] + used[i] if used is not None else ck[i + 1]
        yield cq[i], cq[i + 1], ck[i] + pad[i], k_end


def _flash_attn_varlen_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    return_softmax: bool = False,
    block_table: Optional[Tensor] = None,
    leftpad_k: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    zero_tensors: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """q (total_q, h, d), k/v (total_k, hk, d) -> (out, softmax_lse (h, total_q) fp32, S_dmask,
    rng_state), each sequence attended on its own. Rows outside every sequence come back as
    out 0 and lse -inf, what flash-attn gives with zero_tensors (it leaves them unset without)."""
    _refuse_unsupported(dropout_p, softcap, alibi_slopes, block_table)
    _check_return_softmax(return_softmax)
    _check_qkv(q, k, v, token_dims=1)
    if _cuda.runs(q):
        if leftpad_k is not None:
            raise NotImplementedError("cpbench's flash-attn interface: leftpad_k is not "
                                      "implemented on CUDA (torch's FA2 op takes none)")
        return _cuda.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, softmax_scale, causal, window_size_left,
                                    window_size_right, seqused_k, zero_tensors)
    window = _kernel.key_window(causal, window_size_left, window_size_right, int(max_seqlen_k))
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((q.shape[1], q.shape[0]), -_kernel.INF, dtype=torch.float32)
    for qs, qe, ks, ke in _segments(cu_seqlens_q, cu_seqlens_k, leftpad_k, seqused_k):
        if qe > qs:
            o, l_ = _kernel.forward(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke],
                                    float(softmax_scale), *window)
            out[qs:qe], lse[:, qs:qe] = o[0], l_[0]
    return (out, lse, *_no_softmax(q))


def _flash_attn_varlen_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    dq: Optional[Tensor],
    dk: Optional[Tensor],
    dv: Optional[Tensor],
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    deterministic: bool,
    rng_state: Optional[Tensor] = None,
    zero_tensors: bool = False,
) -> Tensor:
    """Writes each sequence's rows of dq, dk, dv in place (other rows are left as they are,
    zeroed first with zero_tensors) and returns softmax_d (h, total_q + 128 * batch) fp32,
    sequence i's rows starting at cu_seqlens_q[i] + 128 * i (flash_bwd_preprocess_kernel.h)."""
    _refuse_unsupported(dropout_p, softcap, alibi_slopes)
    _check_qkv(q, k, v, token_dims=1)
    if _cuda.runs(q):
        _cuda.check_deterministic(deterministic)
        _check_grad_buffers(q, k, v, dq, dk, dv)
        return _cuda.varlen_backward(dout, q, k, v, out, softmax_lse, (dq, dk, dv),
                                     cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     softmax_scale, causal, window_size_left,
                                     window_size_right, zero_tensors)
    dq, dk, dv = _grad_buffers(q, k, v, dq, dk, dv, zero=zero_tensors)
    window = _kernel.key_window(causal, window_size_left, window_size_right, int(max_seqlen_k))
    segments = list(_segments(cu_seqlens_q, cu_seqlens_k))
    d_rows = torch.zeros(q.shape[1], q.shape[0] + LSE_ROWS_PAD * len(segments))
    for i, (qs, qe, ks, ke) in enumerate(segments):
        grads = _kernel.backward(dout[None, qs:qe], q[None, qs:qe], k[None, ks:ke],
                                 v[None, ks:ke], out[None, qs:qe], softmax_lse[None, :, qs:qe],
                                 float(softmax_scale), *window)
        for buf, grad, (start, end) in zip((dq, dk, dv), grads, ((qs, qe), (ks, ke), (ks, ke))):
            buf[start:end].copy_(grad[0])
        start = qs + LSE_ROWS_PAD * i
        d_rows[:, start:start + qe - qs] = _kernel.softmax_d(dout[None, qs:qe], out[None, qs:qe])[0]
    return d_rows
