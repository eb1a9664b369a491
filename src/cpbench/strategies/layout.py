"""Sequence layouts: which global token positions each rank holds, in local order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from cpbench.errors import Skipped, UsageError

if TYPE_CHECKING:
    # the mixin below reads a Strategy's fields and calls its validate(); to mypy it is one
    from cpbench.strategies.base import Strategy as _MixinBase
else:
    _MixinBase = object


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


def zigzag_documents_index(documents: tuple[int, ...], n: int, r: int) -> torch.Tensor:
    """Packed documents on the zigzag layout: *each document* cut into 2n chunks, rank r
    holding chunks r and 2n-1-r of every document, document by document (ring-flash-attn's
    varlen zigzag, TransformerEngine's THD layout), so every document is balanced."""
    # one vectorised build: a packing has hundreds of documents, and the simulator asks for
    # every rank's index at every step
    lengths = np.asarray(documents, dtype=np.int64)
    c = lengths // (2 * n)
    starts = np.cumsum(lengths) - lengths
    firsts = np.stack([starts + r * c, starts + (2 * n - 1 - r) * c], 1).ravel()
    sizes = np.repeat(c, 2)
    ends = np.cumsum(sizes)
    index = np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(firsts - ends + sizes, sizes)
    return torch.from_numpy(index)


def zigzag_documents_half(documents: tuple[int, ...], n: int, half: int) -> np.ndarray:
    """The local rows of ``zigzag_documents_index`` that hold chunk r (``half`` 0) or
    2n-1-r (1) of every document: a zigzag rank's queries of one half (host side: a plan,
    never a tensor of the run)."""
    c = np.asarray(documents, dtype=np.int64) // (2 * n)
    firsts = np.cumsum(2 * c) - 2 * c + half * c
    ends = np.cumsum(c)
    return np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(firsts - ends + c, c)


def check_documents_divisible(documents: tuple[int, ...], multiple: int, who: str) -> None:
    """Refuse documents a per-document split cannot cut evenly (left so only under
    ``--document-padding refuse``; ``pad`` pads them first: ``config.padded``)."""
    bad = [d for d in documents if d % multiple]
    if bad:
        # it cuts each document into ``multiple`` chunks; padded (the default) they would be
        raise Skipped(f"{who}: {len(bad)} documents not multiples of {multiple} (e.g. "
                      f"{bad[0]}); drop --document-padding refuse")


def slice_len(part: slice, total: int) -> int:
    """How many of ``total`` positions ``part`` selects (a Block's query or key count)."""
    return len(range(total)[part])


@dataclass(frozen=True)
class Block:
    """Which local queries meet which part of a received K/V block, and whether the
    diagonal mask applies. Slices index the local (zigzag-ordered) sequence."""

    q: slice
    kv: slice
    causal: bool


def zigzag_block(me: int, src: int, local_len: int, causal: bool) -> Block:
    """The work of ring position ``me`` against the K/V block from position ``src``.

    Local tokens are [chunk me | chunk 2n-1-me]. Under causal masking:
    - src == me: the local block against itself, diagonal mask;
    - src < me: both local chunks see only the first chunk of src (its second is later);
    - src > me: only the local second chunk sees src, and it sees both of its chunks.
    Each case is the same amount of work, which is the point of the layout.
    """
    half = local_len // 2
    every = slice(0, local_len)
    if not causal:
        return Block(every, every, False)
    if src == me:
        return Block(every, every, True)
    if src < me:
        return Block(every, slice(0, half), False)
    return Block(slice(half, local_len), every, False)


def nearest_multiple(seqlen: int, multiple: int) -> int:
    return max(multiple, round(seqlen / multiple) * multiple)


def check_divisible(seqlen: int, multiple: int, why: str) -> None:
    if seqlen % multiple:
        raise UsageError(f"{why}: seqlen {seqlen} must divide by {multiple}; try --seqlen "
                         f"{nearest_multiple(seqlen, multiple)}")


class ZigzagLayout(_MixinBase):
    """Mixin for a strategy on the zigzag layout over its CP ring (put it before
    ``Strategy`` in the bases): the layout, and the sequence-length check it needs."""

    @classmethod
    def layout_multiples(cls, cp_size: int, options) -> tuple[int, int]:
        # every document in 2N chunks (documents padded to 2N: TE, Megatron, ring-flash-attn)
        return 2 * cp_size, 2 * cp_size

    def validate(self) -> None:
        n = self.cp_size
        check_divisible(self.attn.seqlen, 2 * n,
                        f"{self.name} over {n} ranks (zigzag: 2 chunks a rank)")
        if self.attn.documents:
            check_documents_divisible(self.attn.documents, 2 * n,
                                      f"{self.name} over {n} ranks")
        super().validate()

    def seq_index(self, rank: int) -> torch.Tensor:
        if self.attn.documents:
            return zigzag_documents_index(self.attn.documents, self.cp_size,
                                          self.cp_index(rank))
        return zigzag_index(self.attn.seqlen, self.cp_size, self.cp_index(rank))
