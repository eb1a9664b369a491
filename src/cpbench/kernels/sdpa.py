"""torch's own CUDA flash kernel (the FlashAttention-2 code vendored in ATen), called through
the aten ops that ``scaled_dot_product_attention`` dispatches to, so the lse comes back.

Dense: ``aten._scaled_dot_product_flash_attention`` → (out, logsumexp, cum_seq_q, cum_seq_k,
max_q, max_k, rng_state, unused, debug_attn_mask) and its backward, which has no defaults for
the forward's extras: cum_seq_q, cum_seq_k, max_q, max_k and philox_seed / philox_offset
(the forward's rng_state / unused, as torch's derivatives.yaml passes them). Varlen:
``aten._flash_attention_forward`` / ``_flash_attention_backward`` on (tokens, heads, dim) with
cum_seq_q / cum_seq_k, max_q / max_k and window_size_left / right. Schemas read from torch
2.13 and 2.14 (identical; tests check them against the installed op).

Limits, as torch's own dispatch (sdp_utils.cpp ``can_use_flash_attention``) states them:
bf16 / fp16 only (fp32 is refused: the memory-efficient op would take it, but it is another
kernel, and the row would not compare with flash-attn's), head_dim a multiple of 8 up to 256
(the op does not pad; the public SDPA does), sm80 or newer, GQA native. Causal with
seq_q != seq_k: the op is FlashAttention-2's, bottom-right aligned (torch's public SDPA
therefore never routes such a causal call to flash), so ``causal_unequal=False``; the varlen
op is bottom-right per sequence, as flash-attn's. Every tensor passes the guard flash-attn's
do (``kernels.base.flash_ready``): the op refuses a last dimension that is not contiguous,
and a base off 16 bytes ends in "misaligned address", so such a view is copied first.
"""

from __future__ import annotations

import torch

from cpbench import torchcompat
from cpbench.kernels.base import check_shapes, cuda_flash, flash_ready

_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_flash_attention_forward", "_flash_attention_backward")
# forward outputs the backward takes under another name (derivatives.yaml)
_RENAMED = {"rng_state": "philox_seed", "unused": "philox_offset"}
# what the callers give the backward themselves; the rest comes from the forward
_GIVEN = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal",
          "scale", "attn_mask")


def import_error() -> str | None:
    """Why this torch cannot run the kernel: a CPU-only build has the ops but no CUDA kernel."""
    for op in _OPS:
        if why := torchcompat.aten_op_lacks(op):
            return why
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    return None


def backward_extras(fwd, bwd, rest) -> dict:
    """The arguments of backward op ``bwd`` that come from forward op ``fwd``, by name (the
    schemas name them): ``rest`` is the forward's outputs after (out, logsumexp). On CUDA the
    flash backward takes cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset with
    no defaults; the CPU op takes none. Raises TypeError naming an argument the backward needs
    that neither the forward nor the caller gives (a torch cpbench does not know)."""
    names = [_RENAMED.get(r.name, r.name) for r in fwd._schema.returns[2:]]
    by_name = dict(zip(names, rest))
    wanted = [a for a in bwd._schema.arguments if a.name not in _GIVEN]
    missing = [a.name for a in wanted if a.name not in by_name and not a.has_default_value()]
    if missing:
        raise TypeError(f"{bwd._schema.name} needs {missing}, which its forward does not "
                        f"return: unsupported torch version")
    return {a.name: by_name[a.name] for a in wanted if a.name in by_name}


def _op(name: str):
    return getattr(torch.ops.aten, name).default


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _ready(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(flash_ready(t) for t in tensors)


def forward(q, k, v, *, causal: bool, softmax_scale: float):
    check_shapes(q, k, v, causal)
    q, k, v = _ready(q, k, v)
    out, lse, *_ = _op(_OPS[0])(_bhsd(q), _bhsd(k), _bhsd(v), 0.0, bool(causal),
                                scale=float(softmax_scale))
    return _bhsd(out), lse


def backward(dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float):
    """The kernel runs a fresh backward from the final (merged) out and lse; the dense
    forward's extras are empty tensors (cum_seq_*), the lengths and no rng (no dropout)."""
    check_shapes(q, k, v, causal)
    sq, sk = q.shape[1], k.shape[1]
    none = torch.empty(0, dtype=torch.int64, device=q.device)  # no dropout: rng unused
    dout, q, k, v, out, lse = _ready(dout.to(q.dtype), q, k, v, out.to(q.dtype),
                                     lse.float().contiguous())
    dq, dk, dv = _op(_OPS[1])(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, None, None, sq, sk, 0.0,
        bool(causal), none, none, scale=float(softmax_scale))
    return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, softmax_scale,
                   window=(-1, -1)):
    """Packed (tokens, heads, dim); causal and window bottom-right per sequence. lse (h, t)."""
    q, k, v = _ready(q, k, v)
    out, lse, *_ = _op(_OPS[2])(q, k, v, cu_q, cu_k, int(max_q), int(max_k), 0.0, bool(causal),
                                False, scale=float(softmax_scale),
                                window_size_left=int(window[0]),
                                window_size_right=int(window[1]))
    return out, lse


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal,
                    softmax_scale, window=(-1, -1)):
    none = torch.empty(0, dtype=torch.int64, device=q.device)  # rng_state, unused: no dropout
    dout, q, k, v, out, lse = _ready(dout.to(q.dtype), q, k, v, out.to(q.dtype),
                                     lse.float().contiguous())
    dq, dk, dv = _op(_OPS[3])(
        dout, q, k, v, out, lse, cu_q, cu_k, int(max_q), int(max_k), 0.0, bool(causal), none,
        none, scale=float(softmax_scale), window_size_left=int(window[0]),
        window_size_right=int(window[1]))
    return dq, dk, dv


def limits_for(capability: tuple[int, int] | None) -> str | None:
    """Why the flash op cannot run on this GPU (pure; None: unknown GPU or fine)."""
    if capability is not None and capability[0] < 8:
        return (f"sdpa (torch's flash kernel) needs an sm80 or newer GPU; this one is "
                f"sm{capability[0]}{capability[1]}")
    return None


def _limits(device: str, dtype: torch.dtype, head_dim: int) -> str | None:
    cuda = device == "cuda" and torch.cuda.is_available()
    return limits_for(torch.cuda.get_device_capability() if cuda else None)


BACKEND = cuda_flash(  # FlashAttention-2's limits and bottom-right alignment (see above)
    name="sdpa",
    description="torch's CUDA flash kernel (aten._scaled_dot_product_flash_attention)",
    forward=forward,
    backward=backward,
    is_importable=lambda: import_error() is None,
    import_error=import_error,
    limits=_limits,
    provenance=lambda: {"distribution": "torch", "version": torch.__version__,
                        "path": torch.__file__, "cuda": torch.version.cuda},
    varlen_forward=varlen_forward,
    varlen_backward=varlen_backward,
)
