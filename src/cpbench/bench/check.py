"""``--check``: run a strategy on global inputs and compare with the float64 reference.

Every rank builds the same global q, k, v, dO from the seed (small S only), takes its shard
by the strategy's own layout, runs forward and backward, and the shards are gathered back
into global order and compared tensor by tensor.
"""

from __future__ import annotations

import torch

from cpbench import comm
from cpbench.config import AttentionConfig
from cpbench.reference import TENSORS, Comparison, compare, reference_attention
from cpbench.strategies.base import Strategy


def global_inputs(attn: AttentionConfig, seed: int, device="cpu") -> dict[str, torch.Tensor]:
    """Fresh random q, k, v, dout (b, s, h, d) in the activation dtype; never zeros."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    b, s, h, hk, d = attn.batch, attn.seqlen, attn.heads, attn.num_kv_heads, attn.head_dim

    def rand(heads):
        return torch.randn(b, s, heads, d, generator=gen).to(device=device, dtype=attn.torch_dtype)

    return {"q": rand(h), "k": rand(hk), "v": rand(hk), "dout": rand(h)}


def run_local(strategy: Strategy, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Forward + backward of this rank's shard; returns local out, lse, dq, dk, dv."""
    q, k, v = (strategy.shard(inputs[n]).detach().requires_grad_() for n in ("q", "k", "v"))
    out, lse = strategy.attention(q, k, v)
    out.backward(strategy.shard(inputs["dout"]))
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def check_strategy(strategy: Strategy, seed: int) -> list[Comparison]:
    """Collective: every rank calls it; every rank gets the same comparisons."""
    attn = strategy.attn
    inputs = global_inputs(attn, seed)
    local = run_local(strategy, inputs)
    ref = reference_attention(inputs["q"], inputs["k"], inputs["v"], inputs["dout"],
                              causal=attn.causal, softmax_scale=attn.softmax_scale)
    results = []
    for name in TENSORS:
        seq_dim = 2 if name == "lse" else 1
        parts = comm.all_gather(local[name]) if strategy.world_size > 1 else [local[name]]
        results.append(compare(name, strategy.unshard(parts, seq_dim=seq_dim), ref[name],
                               attn.dtype))
    return results
