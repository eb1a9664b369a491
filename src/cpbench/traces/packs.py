"""MagiAttention's packs: the documents its CP benchmark ran, pack by pack.

MagiAttention's ``DatasetSampler`` (exps/dist_attn/benchmark/utils.py, ``pack_with_shuffle``;
its benchmark seeds it 42 and times the first 20 packs) turns a binned trace into packs:

- every bin's documents at the bin's midpoint, each cut into ``chunk``-long pieces and its
  remainder;
- the pieces shuffled (numpy's ``default_rng(seed)``);
- packed in order into ``pack_len``-long packs, a piece that overflows a pack cut there and
  its tail opening the next (so pack k is the piece stream's tokens [k·L, (k+1)·L));
- the packs shuffled with the same generator.

This does the same with whole-array operations (its loop over 13 M pieces takes seconds); the
packs are equal to theirs, list for list (tests/unit/test_traces.py runs their loop).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

from cpbench import traces
from cpbench.errors import UsageError

SEED = 42  # MagiAttention's benchmark_conf.py SEED, which its sampler is given
# pieces held at once (12 bytes each: the shuffled lengths and their ends); a short pack cuts
# the trace into more pieces (the shipped trace: 14 M at 64K, 52 M at 2K, 379 M at 256)
MAX_PIECES = 64 * 10 ** 6


@functools.lru_cache(maxsize=4)
def trace_bins(name: str) -> tuple[tuple[int, int, int], ...]:
    """Shipped trace ``name``'s bins (``traces.histogram``), read and parsed once: a row's
    packings each ask for them."""
    return tuple(traces.histogram(traces.text(name)))


@functools.lru_cache(maxsize=2)
def _stream(bins: tuple[tuple[int, int, int], ...], pack_len: int, chunk: int, seed: int
            ) -> tuple[Any, Any]:
    """(end of each piece in the shuffled stream, the packs' shuffled order)."""
    import numpy as np  # only here: a trace read without packs needs none

    lengths = np.array([(lo + hi) // 2 for lo, hi, _ in bins], dtype=np.int64)
    nums = np.array([n for _, _, n in bins], dtype=np.int64)
    rng = np.random.default_rng(seed)
    tails = lengths % chunk
    # int32 as theirs: the shuffle's draws do not depend on the type, its result must match
    samples = np.concatenate([np.full(int((lengths // chunk * nums).sum()), chunk, np.int32),
                              np.repeat(tails[tails > 0], nums[tails > 0]).astype(np.int32)])
    rng.shuffle(samples)
    ends = np.cumsum(samples, dtype=np.int64)
    order = np.arange(int(ends[-1]) // pack_len)
    rng.shuffle(order)  # their list of packs: one draw per element, as for an array
    return ends, order


def pack(bins: Sequence[tuple[int, int, int]], pack_len: int, chunk: int, index: int,
         seed: int = SEED) -> tuple[int, ...]:
    """The document lengths of pack ``index`` (0: the first their benchmark times)."""
    import numpy as np

    pieces = sum(n * -(-((lo + hi) // 2) // chunk) for lo, hi, n in bins)
    if pieces > MAX_PIECES:
        raise UsageError(f"packs of {pack_len} tokens cut this trace into {pieces / 1e6:.0f} M "
                         f"pieces (at most {MAX_PIECES // 10 ** 6} M); give a longer --seqlen")
    ends, order = _stream(tuple(bins), pack_len, chunk, seed)
    if not 0 <= index < len(order):
        raise UsageError(f"pack {index}: this trace makes {len(order)} packs of {pack_len} "
                         f"tokens; give --seed 0 to {len(order) - 1}")
    lo = int(order[index]) * pack_len
    hi = lo + pack_len
    first = int(np.searchsorted(ends, lo, side="right"))
    last = int(np.searchsorted(ends, hi, side="left"))
    cuts = [lo, *(int(e) for e in ends[first:last]), hi]
    return tuple(b - a for a, b in zip(cuts, cuts[1:]) if b > a)
