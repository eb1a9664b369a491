"""The attention mask beyond causal: packed documents and sliding windows.

Query i sees key j when both lie in one document, ``j <= i`` under ``--causal``, and
``i - left <= j <= i + right`` under ``--window-size LEFT,RIGHT`` (flash-attn's
``window_size``; -1 is unbounded; causal caps the right side at 0). For one query the visible
keys are therefore one interval of global positions, ``key_interval`` — everything else
(the float64 reference's mask, a block's visibility, the attended area per rank and per ring
step) follows from it.

``--documents`` takes explicit lengths (``4k,2k,1k,1k``) or a distribution sampled with the
run's seed until the sequence is full (``uniform:MIN-MAX``, ``lognormal:MEDIAN,SIGMA``,
``trace:NAME`` of ``cpbench.traces``, ``file:PATH``), each length capped at
``--max-document`` (default a quarter of the sequence, MagiAttention's benchmark's cap).
A capped draw is cut to the cap; ``trace:NAME,split`` keeps the rest instead, as
MagiAttention's benchmark does, and ``trace:NAME,packs`` gives its packs themselves
(``TRACE_OPTIONS``). ``--document-padding pad`` pads them per
strategy (``pad_documents``).
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from cpbench import traces
from cpbench.errors import UsageError
from cpbench.traces import packs

if TYPE_CHECKING:  # torch is imported where a mask meets tensors: parsing a mask needs none
    import torch

DISTRIBUTIONS = ("uniform", "lognormal", "file", "trace")
# ``trace:NAME,OPTION,...``: how a trace is drawn. Both options are what MagiAttention's CP
# benchmark does (exps/dist_attn/benchmark/utils.py, DatasetSampler: chunk_ratio 0.25, a
# binned CSV read as each bin's midpoint), so its published varlen runs can be re-sampled.
TRACE_OPTIONS = {
    "split": "a document over the cap becomes cap-long pieces and its remainder, all kept "
             "and drawn in proportion to their number (the trace's tokens, not its documents: "
             "a long document is not cut to the cap and its rest dropped)",
    "midpoint": "each bin is drawn as its midpoint (LO+HI)//2, not uniformly inside it",
    "packs": "its sampler itself: pieces as split and midpoint, shuffled (seed 42) and packed in "
             "order, a piece that overflows a pack cut and its tail opening the next, the "
             "packs shuffled; --seed K is its pack K (--packings 20: the 20 it timed)",
}


_SIZE_SUFFIX = {"k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30}


def parse_size(text: str) -> int:
    """A positive token count: ``524288``, ``8k``, ``128K``, ``1M`` (binary: 8k = 8192).
    Here rather than in ``config``, which imports it: document lengths are sizes too."""
    t = str(text).strip().lower()
    scale = _SIZE_SUFFIX.get(t[-1:], 1)
    digits = t[:-1] if scale > 1 else t
    if not digits.lstrip("-").isdigit():
        raise UsageError(f"cannot read {text!r} as a size; use an integer or a size like "
                         f"8k, 128K, 1M")
    if int(digits) < 1:
        raise UsageError(f"a size must be positive, got {text!r}; use e.g. 8k, 128K, 1M")
    return int(digits) * scale


_size = parse_size


def size_text(n: int) -> str:
    """A token count as the flags take it, ``parse_size``'s inverse: 524288 → 512K."""
    for unit, scale in (("M", 2 ** 20), ("K", 2 ** 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def parse_documents(text: str) -> tuple[int, ...] | str:
    """``4k,2k,1k,1k`` → the lengths; a distribution spec is checked and kept as text (it is
    sampled once the sequence length and seed are known: ``resolve_documents``)."""
    t = str(text).strip()
    kind, sep, rest = t.partition(":")
    if sep:
        if kind not in DISTRIBUTIONS:
            raise UsageError(f"--documents {t!r}: unknown distribution {kind!r}; use lengths "
                             f"(4k,2k,1k,1k), uniform:MIN-MAX, lognormal:MEDIAN,SIGMA, "
                             f"trace:NAME ({', '.join(traces.TRACES)}) or file:PATH")
        _sampler(t)  # reads the parameters now, so a typo fails before anything runs
        return t
    return tuple(_size(part) for part in t.split(",") if part.strip())


def parse_window(text: str) -> tuple[int, int]:
    """``1023,0`` → (1023, 0): flash-attn's ``window_size`` (-1: unbounded on that side)."""
    parts = str(text).split(",")
    try:
        left, right = (int(p) for p in parts)
    except ValueError:
        raise UsageError(f"--window-size {text!r}: give LEFT,RIGHT as integers, e.g. 1023,0 "
                         f"(-1: unbounded on that side)") from None
    if left < -1 or right < -1:
        raise UsageError(f"--window-size {text!r}: each side is >= 0, or -1 for unbounded")
    return left, right


Sampler = Callable[[random.Random], int]


def _trace_spec(spec: str) -> tuple[str, list[str]]:
    """``trace:NAME,OPTION,...`` → (NAME, [OPTION, ...]), stripped; the options unchecked
    (``_sampler`` refuses an unknown one)."""
    name, *options = (part.strip() for part in spec.partition(":")[2].split(","))
    return name, options


def _sampler(spec: str, cap: int | None = None) -> Sampler:
    """A function rng -> one document length for a distribution spec (``cap``: the longest
    document, which a ``split`` trace splits at; None only to check the spec)."""
    kind, _, rest = spec.partition(":")
    if kind == "trace":
        name, options = _trace_spec(spec)
        unknown = [o for o in options if o not in TRACE_OPTIONS]
        if unknown:
            raise UsageError(f"--documents {spec}: unknown option {unknown[0]!r}; give "
                             f"trace:NAME or trace:NAME,{','.join(TRACE_OPTIONS)}")
        draw, longest = _histogram_sampler(traces.text(name), spec, "midpoint" in options)
        return _split(draw, longest, cap or longest) if "split" in options else draw
    try:
        if kind == "uniform":
            lo, hi = (_size(x) for x in rest.split("-"))
            if lo > hi:
                raise ValueError
            return lambda rng: rng.randint(lo, hi)
        if kind == "lognormal":
            median, sigma = rest.split(",")
            mu, sd = math.log(_size(median)), float(sigma)
            return lambda rng: max(1, round(rng.lognormvariate(mu, sd)))
        content = Path(rest).read_text()
        if traces.is_histogram(content):
            return _histogram_sampler(content, spec)[0]
        lengths = [int(line) for line in content.split() if line.strip()]
        if not lengths or min(lengths) < 1:
            raise ValueError
        return lambda rng: rng.choice(lengths)
    except OSError as e:
        raise UsageError(f"--documents {spec}: cannot read {rest} ({e.strerror}); give a "
                         f"file with one document length a line") from None
    except (ValueError, UsageError):
        raise UsageError(f"--documents {spec!r}: cannot read it; use uniform:MIN-MAX "
                         f"(MIN <= MAX), lognormal:MEDIAN,SIGMA or file:PATH (one positive "
                         f"length a line, or a histogram: range,number header, then "
                         f'"[LO, HI]",COUNT rows)') from None


def _histogram_sampler(content: str, spec: str, midpoint: bool = False
                       ) -> tuple[Sampler, int]:
    """(A bin drawn in proportion to its count, then a length uniform inside it or its
    midpoint; the longest length it draws)."""
    try:
        bins = traces.histogram(content)
    except (ValueError, IndexError):
        raise UsageError(f"--documents {spec}: not a histogram this reads: give a CSV with "
                         f'a range,number header and "[LO, HI]",COUNT rows') from None
    cum = list(itertools.accumulate(count for _, _, count in bins))

    def draw(rng: random.Random) -> int:
        lo, hi, _ = rng.choices(bins, cum_weights=cum)[0]
        return (lo + hi) // 2 if midpoint else rng.randint(lo, hi)

    longest = max((lo + hi) // 2 if midpoint else hi for lo, hi, _ in bins)
    return draw, longest


def _split(draw: Sampler, longest: int, cap: int) -> Sampler:
    """One piece of ``draw``'s documents split at ``cap`` (``TRACE_OPTIONS["split"]``): a
    document of n tokens has ceil(n / cap) pieces, so it is taken with probability
    proportional to that (rejection against the longest's count), then one of its pieces
    uniformly: every piece of the trace equally likely, as a shuffle of all of them."""
    most = -(-longest // cap)

    def piece(rng: random.Random) -> int:
        while True:
            n = draw(rng)
            pieces = -(-n // cap)
            if rng.random() * most < pieces:
                return cap if rng.randrange(pieces) < n // cap else n % cap

    return piece


def resolve_documents(documents: str | Iterable[int] | None, seqlen: int, seed: int,
                      max_document: int | None) -> tuple[int, ...] | None:
    """The document lengths of a run: explicit lengths as given (they must sum to the
    sequence), or a distribution sampled with ``seed`` until the sequence is full, every
    length capped (default: a quarter of the sequence; a ``split`` trace splits at it);
    the last one is cut to fit."""
    if documents is None:
        return None
    if not isinstance(documents, str):
        given = tuple(int(x) for x in documents)
        if sum(given) != seqlen or min(given, default=0) < 1:
            raise UsageError(f"--documents lengths sum to {sum(given)}, not --seqlen "
                             f"{seqlen}; give lengths that add up to --seqlen")
        return given
    cap = max_document or max(1, seqlen // 4)
    if documents.partition(":")[0] == "trace":
        name, options = _trace_spec(documents)
        if "packs" in options:
            return packs.pack(packs.trace_bins(name), seqlen, cap, seed)
    draw, rng, total = _sampler(documents, cap), random.Random(seed), 0
    lengths: list[int] = []
    while total < seqlen:
        lengths.append(min(draw(rng), cap, seqlen - total))
        total += lengths[-1]
    return tuple(lengths)


def pad_documents(documents: tuple[int, ...], seqlen: int, doc_multiple: int,
                  seq_multiple: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(layout lengths, pad tokens at the end of each) of ``documents`` padded as deployed
    context parallelism pads them (TransformerEngine's ``cu_seqlens_padded``, Megatron's
    packing to 2 × CP): each document up to a multiple of ``doc_multiple``, then one
    pad-only segment at the tail up to a multiple of ``seq_multiple`` (and never below
    ``seqlen``). Lengths already fitting are returned as they are, unpadded."""
    seq_multiple = math.lcm(seq_multiple, doc_multiple)
    layout = [-(-d // doc_multiple) * doc_multiple for d in documents]
    padding = [p - d for p, d in zip(layout, documents)]
    total = max(sum(layout), seqlen)
    tail = -(-total // seq_multiple) * seq_multiple - sum(layout)
    if tail:
        layout.append(tail)
        padding.append(tail)
    return tuple(layout), tuple(padding)


@dataclass(frozen=True)
class Mask:
    """The whole problem's mask in global positions. ``padding``: pad tokens at the end of
    each document (``pad_documents``); a pad token attends to nothing and nothing attends to
    it (TransformerEngine's semantics of the gap between cu_seqlens and cu_seqlens_padded)."""

    causal: bool
    documents: tuple[int, ...] | None = None
    window: tuple[int, int] | None = None
    padding: tuple[int, ...] | None = None

    @property
    def plain(self) -> bool:
        """Causal or full over one sequence: what every kernel does natively."""
        return self.documents is None and self.window is None

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(k for k, v in (("documents", self.documents),
                                        ("window", self.window)) if v is not None)

    @functools.cached_property
    def _doc_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(lengths, ends, padding) of the documents on the CPU, built once per mask: a
        packing has hundreds of documents, and a schedule asks at every step."""
        import torch

        lengths = torch.tensor(self.documents)
        pad = None if self.padding is None else torch.tensor(self.padding)
        return lengths, lengths.cumsum(0), pad

    def key_interval(self, q_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For each query position, the first and last key position it sees (inclusive)."""
        import torch

        q = q_pos.long()
        lo, hi = torch.full_like(q, -(2 ** 62)), torch.full_like(q, 2 ** 62)
        if self.documents is not None:
            lengths, ends, pad = self._doc_tables
            lengths, ends = lengths.to(q.device), ends.to(q.device)
            doc = torch.searchsorted(ends, q, right=True)
            lo = ends[doc] - lengths[doc]
            hi = ends[doc] - 1
            if pad is not None:
                real_end = hi - pad.to(q.device)[doc]
                # a real query stops before its document's pad; a pad query sees nothing
                hi = torch.where(q <= real_end, real_end, lo - 1)
        if self.causal:
            hi = torch.minimum(hi, q)
        if self.window is not None:
            left, right = self.window
            if left >= 0:
                lo = torch.maximum(lo, q - left)
            if right >= 0:
                hi = torch.minimum(hi, q + right)
        return lo, hi

    def run_key(self, pos: torch.Tensor) -> torch.Tensor:
        """Positions made non-consecutive across a document boundary, so that runs of
        consecutive keys (``kernels.masked.runs``) never span two documents."""
        import torch

        if self.documents is None:
            return pos
        ends = self._doc_tables[1].to(pos.device)
        return pos.long() + torch.searchsorted(ends, pos.long(), right=True) * 2 ** 40

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """(len q, len k) bool: True where the query sees the key."""
        lo, hi = self.key_interval(q_pos)
        k = k_pos.long().to(q_pos.device)
        return (k >= lo[:, None]) & (k <= hi[:, None])

    def pairs(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> int:
        """How many (query, key) pairs of these positions are visible, without the matrix
        (sorted keys, two binary searches per query), so it is cheap at any length."""
        import torch

        lo, hi = self.key_interval(q_pos)
        k = k_pos.long().to(q_pos.device)
        if not bool((k[1:] >= k[:-1]).all()):  # layouts mostly hold sorted positions
            k = torch.sort(k).values
        n = torch.searchsorted(k, hi, right=True) - torch.searchsorted(k, lo)
        return int(n.clamp(min=0).sum())


def mask_of(attn: object) -> Mask:
    """The mask of an ``AttentionConfig`` (or its dict form, as records hold it)."""
    # object: AttentionConfig lives in cpbench.config, a layer above this one
    get: Callable[[str], Any] = (attn.get if isinstance(attn, dict)
                                 else (lambda k: getattr(attn, k)))
    docs, window = get("documents"), get("window_size")
    padding = attn.get("padding") if isinstance(attn, dict) else getattr(attn, "padding", None)
    return Mask(bool(get("causal")), tuple(docs) if docs else None,
                tuple(window) if window else None,
                tuple(padding) if docs and padding and any(padding) else None)
