"""aten's CPU flash kernel under flash-attn 2.8.3's masking rules.

flash-attn aligns causal masks and sliding windows to the bottom-right corner: query row i of a
(seqlen_q, seqlen_k) block sees key j when
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right
(csrc/flash_attn/src/mask.h, ``Mask::apply_mask``). aten's kernel aligns ``is_causal`` top-left,
so it is used directly only where the two agree (square causal, or no mask at all); every other
case gets an additive -inf mask, built once per call. A row that sees no key comes back from
flash-attn as out = 0 and lse = +inf (softmax.h ``normalize_softmax_lse``: row_sum == 0 gives
INFINITY; flash_fwd_kernel.h's early exit writes INFINITY too), where aten gives lse = 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpbench import torchcompat

_FWD = "_scaled_dot_product_flash_attention_for_cpu"
_BWD = "_scaled_dot_product_flash_attention_for_cpu_backward"
INF = float("inf")


def importable() -> bool:
    return hasattr(torch.ops.aten, _FWD) and hasattr(torch.ops.aten, _BWD)


def key_window(causal: bool, window_size_left: int, window_size_right: int,
               seqlen_k_limit: int) -> tuple[int | None, int | None]:
    """The (left, right) bounds flash-attn's kernel applies; None means unbounded.

    Follows flash_api.cpp: ``mha_fwd``/``mha_varlen_fwd`` drop a bound >= seqlen_k (max_seqlen_k
    for varlen, hence ``seqlen_k_limit``), causal sets right = 0, then ``set_params_fprop``
    replaces an unbounded side by seqlen_k as soon as the other side is bounded.
    """
    left, right = int(window_size_left), int(window_size_right)
    if left >= seqlen_k_limit:
        left = -1
    if right >= seqlen_k_limit:
        right = -1
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None, None
    # An unbounded left side set to seqlen_k never hides a key, so it stays None. On the right
    # it can: with a left window only and seqlen_q > seqlen_k + 1, the first rows see nothing.
    # That is what the kernel does, so it is reproduced rather than the docstring's "infinite".
    return (left if left >= 0 else None), (right if right >= 0 else seqlen_k_limit)


def visible_keys(seqlen_q: int, seqlen_k: int, left: int | None,
                 right: int | None) -> torch.Tensor | None:
    """(seqlen_q, seqlen_k) bool, True where query i sees key j; None when all are visible."""
    # all visible, decided from the bounds (no matrix read back): the last row's right bound
    # reaches past the last key, the first row's left bound before the first key
    if (right is None or right >= seqlen_q - 1) and (left is None or left >= seqlen_k - 1):
        return None
    diag = torch.arange(seqlen_q).unsqueeze(1) + (seqlen_k - seqlen_q)  # bottom-right aligned
    j = torch.arange(seqlen_k)
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if right is not None:
        ok &= j <= diag + right
    if left is not None:
        ok &= j >= diag - left
    return ok


class _Plan:
    """How one call runs on aten: its is_causal flag, additive mask and rows that see nothing."""

    def __init__(self, q, seqlen_k: int, left: int | None, right: int | None):
        seqlen_q = q.shape[1]
        self.is_causal, self.mask, self.empty_rows = False, None, None
        self.nothing_visible = seqlen_q == 0 or seqlen_k == 0
        if self.nothing_visible:
            return
        if seqlen_q == seqlen_k and left is None and right == 0:
            self.is_causal = True  # square: aten's top-left diagonal is flash-attn's
            return
        ok = visible_keys(seqlen_q, seqlen_k, left, right)
        if ok is None:
            return
        # rows that see nothing, from the bounds (no matrix read back): only the first rows can
        # be empty, those whose right bound ends before the first key (i + sk - sq + right < 0)
        n_empty = 0 if right is None else min(seqlen_q, max(0, seqlen_q - seqlen_k - right))
        self.nothing_visible = n_empty == seqlen_q
        self.empty_rows = torch.arange(seqlen_q) < n_empty if n_empty else None
        # -inf and 0 are exact in every float dtype, so the mask takes q's (aten accepts it).
        self.mask = torch.zeros(ok.shape, dtype=q.dtype).masked_fill_(~ok, -INF)


def _bhsd(x_bshd: torch.Tensor) -> torch.Tensor:
    return x_bshd.transpose(1, 2)


def forward(q, k, v, softmax_scale: float, left: int | None, right: int | None):
    """(out (b, sq, h, d) contiguous, lse (b, h, sq) fp32); q (b, sq, h, d), k/v (b, sk, hk, d)."""
    plan = _Plan(q, k.shape[1], left, right)
    if plan.nothing_visible:  # mha_fwd with seqlen_k == 0 also writes out 0, lse +inf
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), INF, dtype=torch.float32)
        return torch.zeros_like(q, memory_format=torch.contiguous_format), lse
    out, lse = torchcompat.cpu_flash_forward(_bhsd(q), _bhsd(k), _bhsd(v), 0.0, plan.is_causal,
                                             attn_mask=plan.mask, scale=softmax_scale)
    out, lse = _bhsd(out).contiguous(), lse.float()  # flash-attn returns out dense in bshd
    if plan.empty_rows is not None:
        out[:, plan.empty_rows] = 0
        lse[:, :, plan.empty_rows] = INF
    return out, lse


def backward(dout, q, k, v, out, lse, softmax_scale: float, left: int | None, right: int | None):
    """(dq, dk, dv) in bshd for the probabilities exp(s - lse) with the given (merged) lse.

    Rows that see no key get zero gradients whatever their lse: every score is -inf there.
    """
    plan = _Plan(q, k.shape[1], left, right)
    if plan.nothing_visible:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32).contiguous()
    grads = torchcompat.cpu_flash_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, 0.0, plan.is_causal,
        attn_mask=plan.mask, scale=softmax_scale)
    return tuple(_bhsd(g) for g in grads)


def softmax_d(dout: torch.Tensor, out: torch.Tensor, pad_to: int = 1) -> torch.Tensor:
    """flash-attn's ``softmax_d``: rowsum(dout * out) in fp32, (b, h, sq) zero-padded along sq to
    a multiple of ``pad_to`` (flash_bwd_preprocess_kernel.h ``dot_do_o``)."""
    d = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    return F.pad(d, (0, -d.shape[-1] % pad_to)).contiguous()
