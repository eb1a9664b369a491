"""Sequence layouts: which global token positions each rank holds, in local order."""

from __future__ import annotations

import torch


def contiguous_index(seqlen: int, n: int, r: int) -> torch.Tensor:
    """Rank r of n holds the r-th of n equal contiguous shards."""
    s = seqlen // n
    return torch.arange(r * s, (r + 1) * s)


def zigzag_index(seqlen: int, n: int, r: int) -> torch.Tensor:
    """2n equal chunks; rank r holds chunk r then chunk 2n-1-r, so every rank does the same
    amount of causal work."""
    c = seqlen // (2 * n)
    return torch.cat([torch.arange(r * c, (r + 1) * c),
                      torch.arange((2 * n - 1 - r) * c, (2 * n - r) * c)])


def nearest_multiple(seqlen: int, multiple: int) -> int:
    return max(multiple, round(seqlen / multiple) * multiple)


def check_divisible(seqlen: int, multiple: int, why: str) -> None:
    if seqlen % multiple:
        raise ValueError(
            f"seqlen {seqlen} cannot be split: {why} needs a multiple of {multiple}; "
            f"try --seqlen {nearest_multiple(seqlen, multiple)}"
        )
