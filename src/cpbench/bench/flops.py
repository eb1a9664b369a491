"""The only FLOP formula in cpbench (flash-attention's benchmark convention).

Forward attention is two matmuls of 2·Sq·Sk·D each per head: 4·B·Sq·Sk·H·D, halved when
causal (only the lower triangle is computed); backward is 2.5 × forward (five matmuls,
counting dQ, dK, dV, dP and the recomputed S). H is the number of query heads.
"""

from __future__ import annotations

BWD_FACTOR = 2.5


def attention_flops(*, batch: int, seqlen_q: int, seqlen_k: int, heads: int, head_dim: int,
                    causal: bool, mode: str = "fwd") -> float:
    """FLOPs of one attention call. mode: "fwd", "bwd" or "fwd_bwd"."""
    fwd = 4.0 * batch * seqlen_q * seqlen_k * heads * head_dim
    if causal:
        fwd /= 2
    factor = {"fwd": 1.0, "bwd": BWD_FACTOR, "fwd_bwd": 1.0 + BWD_FACTOR}[mode]
    return fwd * factor


def tflops_per_gpu(flops: float, world_size: int, seconds: float) -> float:
    """Achieved TFLOP/s per rank: total model FLOPs shared by all ranks over the wall time."""
    return flops / world_size / seconds / 1e12
