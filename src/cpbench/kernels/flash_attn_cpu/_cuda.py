"""flash-attn 2.8.3's internal functions on CUDA without flash-attn: torch's own
FlashAttention-2 (the FA2 code vendored in ATen) through ``aten._flash_attention_forward`` /
``_flash_attention_backward``, the ops ``kernels.sdpa`` runs.

Torch's op is FA2's ``mha_fwd`` / ``mha_varlen_fwd`` / ``mha_bwd`` / ``mha_varlen_bwd``
(aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp), so what flash-attn's
C++ decides is decided the same way here: (b, s, h, d) inputs with a contiguous last dim,
(total, h, d) with int32 ``cu_seqlens`` for varlen; causal and windows bottom-right, bounds
>= seqlen_k dropped, causal setting right = 0; GQA; lse (b, h, sq) fp32 dense, (h, total_q)
varlen (``unpadded_lse``); out = 0 and lse = +inf where seqlen_k == 0. Schemas read from
torch 2.13 and 2.14 (identical); ``import_error`` names what a torch lacks (torchcompat).

What torch's op cannot do is refused by the caller (``_internal``): dropout, ALiBi (its
backward takes none), softcap, paged KV, ``leftpad_k``; ``deterministic=True`` only under
``torch.use_deterministic_algorithms(True)`` (the op reads that global switch, and under it
is deterministic whatever ``deterministic`` says). fp16 / bf16
and head_dim a multiple of 8 up to 256, as flash-attn's C++ requires (its public
``flash_attn_func`` pads the head dim; the internal functions do not).

Where it differs from flash-attn, by what torch's op offers:
- the backward has no output arguments: it allocates dq, dk, dv and this copies them into
  the caller's buffers (one more read and write of each, and their memory while both live);
- it does not return ``softmax_d``: the tensor returned has flash-attn's shape and dtype and
  holds NaN, so a reader fails loudly (ring-flash-attn 0.1.8 and yunchang 0.6.4 discard it,
  a unit test reads their call sites);
- varlen without ``zero_tensors``: rows outside every sequence of the caller's dq/dk/dv get
  the op's unset values, where flash-attn leaves them as they were (unset either way).
"""

from __future__ import annotations

import torch

from cpbench import torchcompat

Tensor = torch.Tensor
_FWD, _BWD = "_flash_attention_forward", "_flash_attention_backward"
_KEYWORDS = ("scale", "window_size_left", "window_size_right")  # what this passes by name
LSE_ROWS_PAD = 128  # softmax_d's rows (and varlen segments) padded to 128, as flash-attn's


def runs(q: Tensor) -> bool:
    """Whether a call on ``q`` goes to torch's CUDA op (a fake CUDA tensor too)."""
    return q.device.type == "cuda"


def import_error() -> str | None:
    """Why this torch cannot carry flash-attn's interface on CUDA (None: it can)."""
    for name in (_FWD, _BWD):
        if why := torchcompat.aten_op_lacks(name, _KEYWORDS):
            return why
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    return None


def _op(name: str):
    return getattr(torch.ops.aten, name).default


def _last_dim_contiguous(x: Tensor) -> Tensor:
    # flash-attn's maybe_contiguous: the kernels take any strides but the last
    return x.contiguous() if x.stride(-1) != 1 else x


def check_inputs(q: Tensor) -> None:
    """flash-attn's C++ checks that the op would make only on a real GPU (fake tensors run
    its meta function, which checks nothing)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"FlashAttention-2 takes fp16 and bf16 only, got {q.dtype} (torch's "
                         f"FA2 op, as flash-attn); use --dtype bf16 or fp16")
    d = q.shape[-1]
    if d % 8 or d > 256:
        raise ValueError(f"FlashAttention-2 takes a head_dim that is a multiple of 8 up to 256, "
                         f"got {d} (flash-attn's internal functions do not pad it)")


def check_deterministic(deterministic: bool) -> None:
    if deterministic and (not torch.are_deterministic_algorithms_enabled()
                          or torch.is_deterministic_algorithms_warn_only_enabled()):
        raise NotImplementedError(
            "deterministic=True: torch's FA2 backward is deterministic only under "
            "torch.use_deterministic_algorithms(True) (warn_only=False), a global switch it "
            "reads at each call; turn that on, or pass deterministic=False")


def _check_lse(lse: Tensor, shape: tuple[int, ...], layout: str) -> None:
    # flash-attn reads softmax_lse through a bare pointer: any other shape or dtype is garbage
    if tuple(lse.shape) != shape or lse.dtype != torch.float32:
        raise ValueError(f"softmax_lse must be float32 {layout} {shape}, as the forward returns "
                         f"it; got {lse.dtype} {tuple(lse.shape)}")


def _check_cu(cu: Tensor, name: str, q: Tensor) -> None:
    if cu.dtype != torch.int32 or cu.device != q.device or not cu.is_contiguous():
        raise ValueError(f"{name} must be contiguous int32 on {q.device}, as flash-attn's; got "
                         f"{cu.dtype} on {cu.device}")


def _extras(q: Tensor) -> tuple[Tensor, Tensor]:
    """S_dmask and rng_state as flash-attn returns them without dropout: an empty tensor of
    q's dtype, and 2 int64 on the device, unset (flash-attn writes them only with dropout)."""
    return q.new_empty(0), torch.empty(2, dtype=torch.int64, device=q.device)


def _no_rng(q: Tensor) -> Tensor:
    return torch.empty(0, dtype=torch.int64, device=q.device)  # philox seed/offset: no dropout


def _window(scale: float, left: int, right: int) -> dict:
    return {"scale": float(scale), "window_size_left": int(left),
            "window_size_right": int(right)}


def _into(bufs, grads) -> None:
    """The op's fresh gradients into the caller's buffers (None: the caller keeps nothing)."""
    for buf, grad in zip(bufs, grads):
        if buf is not None:
            buf.copy_(grad)


def _nan_softmax_d(q: Tensor, shape: tuple[int, ...]) -> Tensor:
    return torch.full(shape, float("nan"), dtype=torch.float32, device=q.device)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def forward(q, k, v, softmax_scale, causal, left, right):
    """(out, softmax_lse (b, h, sq) fp32, S_dmask, rng_state) for q (b, sq, h, d)."""
    check_inputs(q)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    out, lse, *_ = _op(_FWD)(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, bool(causal),
                             False, **_window(softmax_scale, left, right))
    return (out, lse, *_extras(q))


def backward(dout, q, k, v, out, lse, bufs, softmax_scale, causal, left, right):
    """Writes the caller's dq, dk, dv (None: skipped); softmax_d (b, h, round_up(sq, 128))."""
    check_inputs(q)
    b, sq, h, _ = q.shape
    _check_lse(lse, (b, h, sq), "(b, h, sq)")
    dout, q, k, v, out = (_last_dim_contiguous(t) for t in (dout, q, k, v, out))
    # cum_seq_q / cum_seq_k None: the dense path (the op tests whether they are defined)
    grads = _op(_BWD)(dout, q, k, v, out, lse.contiguous(), None, None, sq, k.shape[1], 0.0,
                      bool(causal), _no_rng(q), _no_rng(q),
                      **_window(softmax_scale, left, right))
    _into(bufs, grads)
    return _nan_softmax_d(q, (b, h, _round_up(sq, LSE_ROWS_PAD)))


def _inside(cu: Tensor, total: int) -> Tensor:
    """(total,) bool on the device: rows some sequence covers, [cu[0], cu[-1]) (no sync)."""
    rows = torch.arange(total, device=cu.device)
    return (rows >= cu[0]) & (rows < cu[-1])


def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, left, right,
                   seqused_k, zero_tensors):
    """(out, softmax_lse (h, total_q) fp32, S_dmask, rng_state) for q (total_q, h, d)."""
    check_inputs(q)
    _check_cu(cu_q, "cu_seqlens_q", q)
    _check_cu(cu_k, "cu_seqlens_k", q)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    used = {} if seqused_k is None else {"seqused_k": seqused_k}
    out, lse, *_ = _op(_FWD)(q, k, v, cu_q, cu_k, int(max_q), int(max_k), 0.0, bool(causal),
                             False, **_window(softmax_scale, left, right), **used)
    if zero_tensors:  # flash-attn zeroes out and sets lse -inf first: rows no sequence writes
        outside = ~_inside(cu_q, q.shape[0])
        out.masked_fill_(outside[:, None, None], 0)
        lse.masked_fill_(outside[None], float("-inf"))
    return (out, lse, *_extras(q))


def varlen_backward(dout, q, k, v, out, lse, bufs, cu_q, cu_k, max_q, max_k, softmax_scale,
                    causal, left, right, zero_tensors):
    """Writes the caller's dq, dk, dv; softmax_d (h, total_q + 128 * batch)."""
    check_inputs(q)
    _check_cu(cu_q, "cu_seqlens_q", q)
    _check_cu(cu_k, "cu_seqlens_k", q)
    _check_lse(lse, (q.shape[1], q.shape[0]), "(h, total_q)")
    dout, q, k, v, out = (_last_dim_contiguous(t) for t in (dout, q, k, v, out))
    grads = _op(_BWD)(dout, q, k, v, out, lse.contiguous(), cu_q, cu_k, int(max_q), int(max_k),
                      0.0, bool(causal), _no_rng(q), _no_rng(q),
                      **_window(softmax_scale, left, right))
    if zero_tensors:  # flash-attn zeroes the buffers first: rows outside stay 0
        grads = [g.masked_fill_(~_inside(cu, g.shape[0])[:, None, None], 0)
                 for g, cu in zip(grads, (cu_q, cu_k, cu_k))]
    _into(bufs, grads)
    batch = cu_q.shape[0] - 1
    return _nan_softmax_d(q, (q.shape[1], q.shape[0] + LSE_ROWS_PAD * batch))
