"""Shared by the flash-attn tests: flash-attn's documented visibility rule, written from its
docstring (flash_attn_interface.py v2.8.3 lines 1154-1172), never from cpbench's kernels."""

from __future__ import annotations

import torch


def fa_visible(sq: int, sk: int, left: int = -1, right: int = -1, causal: bool = False):
    """Query i sees keys [i + sk - sq - left, i + sk - sq + right] (bottom-right aligned; -1
    unbounded; causal sets right to 0), as a (sq, sk) bool matrix."""
    if causal:
        right = 0
    diag = torch.arange(sq).unsqueeze(1) + sk - sq
    j = torch.arange(sk)
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        ok &= j <= diag + right
    if left >= 0:
        ok &= j >= diag - left
    return ok
