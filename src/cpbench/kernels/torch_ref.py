"""The readable reference backend: plain PyTorch maths, any device, fp32 accumulation."""

from __future__ import annotations

import torch

from cpbench.kernels.base import KernelBackend, check_shapes


def _expand_kv(x_bshd: torch.Tensor, heads: int) -> torch.Tensor:
    return x_bshd.repeat_interleave(heads // x_bshd.shape[2], dim=2)


def _scores(q_bshd, k_bshd, causal, softmax_scale):
    s_bhqk = torch.einsum("bqhd,bkhd->bhqk", q_bshd.float(), k_bshd.float()) * softmax_scale
    if causal:
        sq, sk = s_bhqk.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=s_bhqk.device).triu(1)
        s_bhqk = s_bhqk.masked_fill(mask, float("-inf"))
    return s_bhqk


def forward(q, k, v, *, causal: bool, softmax_scale: float):
    check_shapes(q, k, v, causal, causal_unequal=True)
    heads = q.shape[2]
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    s_bhqk = _scores(q, k, causal, softmax_scale)
    lse_bhq = torch.logsumexp(s_bhqk, dim=-1)
    p_bhqk = torch.exp(s_bhqk - lse_bhq.unsqueeze(-1))
    out = torch.einsum("bhqk,bkhd->bqhd", p_bhqk, v.float())
    return out.to(q.dtype), lse_bhq


def backward(dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float):
    check_shapes(q, k, v, causal, causal_unequal=True)
    heads, kv_heads = q.shape[2], k.shape[2]
    ke, ve = _expand_kv(k, heads).float(), _expand_kv(v, heads).float()
    s_bhqk = _scores(q, ke, causal, softmax_scale)
    # Probabilities against the *given* lse: with the merged lse this is this block's share.
    p_bhqk = torch.exp(s_bhqk - lse.float().unsqueeze(-1))
    do = dout.float()
    delta_bhq = torch.einsum("bqhd,bqhd->bhq", do, out.float())
    dv = torch.einsum("bhqk,bqhd->bkhd", p_bhqk, do)
    dp_bhqk = torch.einsum("bqhd,bkhd->bhqk", do, ve)
    ds_bhqk = p_bhqk * (dp_bhqk - delta_bhq.unsqueeze(-1)) * softmax_scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds_bhqk, ke)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds_bhqk, q.float())
    if kv_heads != heads:
        dk = dk.unflatten(2, (kv_heads, heads // kv_heads)).sum(3)
        dv = dv.unflatten(2, (kv_heads, heads // kv_heads)).sum(3)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


BACKEND = KernelBackend(
    name="torch",
    description="plain PyTorch maths, fp32 accumulation: the readable reference",
    forward=forward,
    backward=backward,
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64}),
    causal_unequal=True,  # top-left aligned, as the float64 reference
    unequal_head_dims=True,
)
