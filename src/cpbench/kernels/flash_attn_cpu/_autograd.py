"""flash-attn 2.8.3's public ``flash_attn_func`` and ``flash_attn_varlen_func``, on CPU and,
without flash-attn, on CUDA.

Same parameters and defaults (flash_attn_interface.py lines 1135 and 1370 at v2.8.3), autograd
through the internal functions as upstream's ``FlashAttnFunc``/``FlashAttnVarlenFunc`` do,
head_dim zero-padded to a multiple of 8 as they do (the CUDA kernels need it; on CPU it
changes nothing). With ``return_attn_probs`` they return (out, softmax_lse, S_dmask), S_dmask
empty without dropout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpbench.kernels.flash_attn_cpu._internal import (
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
)


def _pad8(*xs):
    """Each tensor's last dim zero-padded to a multiple of 8 (upstream's head_size_og % 8)."""
    d = xs[0].shape[-1]
    return xs if d % 8 == 0 else tuple(F.pad(x, [0, 8 - d % 8]) for x in xs)


class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_softmax):
        head_dim = q.shape[-1]
        q, k, v = _pad8(q, k, v)
        out, lse, s_dmask, _ = _flash_attn_forward(
            q, k, v, dropout_p, softmax_scale, causal, window_size[0], window_size[1], softcap,
            alibi_slopes, return_softmax and dropout_p > 0)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (dropout_p, softmax_scale, causal, window_size[0], window_size[1], softcap,
                    alibi_slopes, deterministic)
        out = out[..., :head_dim]
        return (out, lse, s_dmask) if return_softmax else out

    @staticmethod
    def backward(ctx, dout, *_unused):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(*_pad8(dout), q, k, v, out, lse, dq, dk, dv, *ctx.args)
        d = dout.shape[-1]
        return (dq[..., :d], dk[..., :d], dv[..., :d]) + (None,) * 8


class _FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, block_table):
        head_dim = q.shape[-1]
        q, k, v = _pad8(q, k, v)
        out, lse, s_dmask, _ = _flash_attn_varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size[0], window_size[1], softcap, alibi_slopes,
            return_softmax and dropout_p > 0, block_table)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.args = (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size[0],
                    window_size[1], softcap, alibi_slopes, deterministic)
        out = out[..., :head_dim]
        return (out, lse, s_dmask) if return_softmax else out

    @staticmethod
    def backward(ctx, dout, *_unused):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        # Zeroed: rows outside every sequence get no gradient (flash-attn leaves them unset).
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        _flash_attn_varlen_backward(*_pad8(dout), q, k, v, out, lse, dq, dk, dv, cu_seqlens_q,
                                    cu_seqlens_k, *ctx.args)
        d = dout.shape[-1]
        return (dq[..., :d], dk[..., :d], dv[..., :d]) + (None,) * 13


def _scale(q: torch.Tensor, softmax_scale):
    return q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Attention of q (b, sq, h, d) over k/v (b, sk, hk, d), causal aligned bottom-right."""
    return _FlashAttnFunc.apply(q, k, v, dropout_p, _scale(q, softmax_scale), causal,
                                window_size, softcap, alibi_slopes, deterministic,
                                return_attn_probs)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """Packed sequences: q (total_q, h, d), k/v (total_k, hk, d), split by cu_seqlens_q/k."""
    return _FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, dropout_p, _scale(q, softmax_scale), causal,
                                      window_size, softcap, alibi_slopes, deterministic,
                                      return_attn_probs, block_table)
