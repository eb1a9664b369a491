"""The shipped document-length traces: each readable, sampled in proportion to its counts
(a statistical test with a bound from the binomial spread, on a fresh seed each run), capped
at --max-document, and ``file:PATH`` reading the same histogram format."""

from __future__ import annotations

import math
import random

import pytest

from cpbench import traces
from cpbench.errors import UsageError
from cpbench.mask import parse_documents, resolve_documents
from cpbench.traces import packs


@pytest.mark.parametrize("name", list(traces.TRACES))
def test_every_trace_reads_and_fills_a_sequence(name):
    bins = traces.histogram(traces.text(name))
    assert len(bins) >= 10 and all(lo <= hi for lo, hi, _ in bins)
    assert parse_documents(f"trace:{name}") == f"trace:{name}"
    docs = resolve_documents(f"trace:{name}", 65536, seed=1, max_document=8192)
    assert sum(docs) == 65536 and max(docs) <= 8192 and min(docs) >= 1


def test_a_trace_is_sampled_in_proportion_to_its_counts():
    bins = traces.histogram(traces.text("magiattention"))
    total = sum(c for _, _, c in bins)
    seed = random.randrange(2 ** 31)
    # a sequence of many documents, uncapped: the draws themselves (less the cut last one)
    docs = resolve_documents("trace:magiattention", 10 ** 8, seed=seed,
                             max_document=10 ** 8)[:-1]
    n = len(docs)
    assert n > 10_000
    for lo, hi, count in bins:
        p = count / total
        seen = sum(lo <= d <= hi for d in docs) / n
        # 5 binomial standard deviations: a correct sampler fails ~1 in 10^6 per bin
        assert abs(seen - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1 / n, (lo, hi, seed)


def test_file_reads_the_histogram_format(tmp_path):
    path = tmp_path / "h.csv"
    path.write_text('range,number,percentage(%)\n"[10, 20]",3,75\n"[100, 100]",1,25\n')
    docs = resolve_documents(f"file:{path}", 100_000, seed=random.randrange(2 ** 31),
                             max_document=None)
    assert all(10 <= d <= 20 or d == 100 for d in docs[:-1])
    share = sum(d == 100 for d in docs[:-1]) / (len(docs) - 1)
    assert abs(share - 0.25) < 0.08
    path.write_text("range,number\n[oops\n")
    with pytest.raises(UsageError, match="histogram"):
        parse_documents(f"file:{path}")
    with pytest.raises(UsageError, match="magiattention"):
        parse_documents("trace:nope")


def test_run_help_lists_every_trace(capsys):
    from cpbench.cli import main

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for name, line in traces.lines():
        assert f"  {name}" in out and line in out


def test_split_draws_every_piece_of_the_trace_equally_likely():
    """``trace:NAME,split,midpoint`` (MagiAttention's sampler): each bin's midpoint, split at
    the cap into cap-long pieces and a remainder; pieces drawn in proportion to their number
    (a binomial bound per piece length, on a fresh seed)."""
    cap = 16384
    want: dict[int, int] = {}
    for lo, hi, count in traces.histogram(traces.text("magiattention")):
        n = (lo + hi) // 2
        want[cap] = want.get(cap, 0) + count * (n // cap)
        if n % cap:
            want[n % cap] = want.get(n % cap, 0) + count
    total = sum(want.values())
    seed = random.randrange(2 ** 31)
    docs = resolve_documents("trace:magiattention,split,midpoint", 3 * 10 ** 7, seed=seed,
                             max_document=cap)[:-1]
    n = len(docs)
    assert set(docs) <= set(want) and max(docs) == cap
    for length, count in want.items():
        p = count / total
        seen = sum(d == length for d in docs) / n
        assert abs(seen - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1 / n, (length, seed)
    # cut, not split: the long documents' rest is dropped, so far fewer cap-long ones
    cut = resolve_documents("trace:magiattention,midpoint", 10 ** 7, seed=seed,
                            max_document=cap)[:-1]
    assert sum(d == cap for d in cut) / len(cut) < 0.5 * want[cap] / total


def test_split_without_midpoint_keeps_lengths_inside_the_bins_and_the_cap():
    docs = resolve_documents("trace:magiattention,split", 65536, seed=random.randrange(2 ** 31),
                             max_document=None)
    assert sum(docs) == 65536 and max(docs) <= 65536 // 4
    with pytest.raises(UsageError, match="unknown option 'chop'.*split,midpoint"):
        parse_documents("trace:magiattention,chop")
    assert parse_documents("trace:magiattention,split") == "trace:magiattention,split"


def _their_packs(bins, pack_len, seed, chunk_ratio=0.25):
    """MagiAttention's ``DatasetSampler`` (exps/dist_attn/benchmark/utils.py at 2c641357,
    Apache-2.0): ``load_binned_distribution_len`` and ``pack_with_shuffle``, transcribed
    (drop_thres -1, as its benchmark runs), its packs in the order it hands them out."""
    import numpy as np

    rng = np.random.default_rng(seed)
    chunk_len = pack_len * chunk_ratio
    dlen2num = {(lo + hi) // 2: n for lo, hi, n in bins}
    lengths = np.array(list(dlen2num.keys()), dtype=np.int32)
    nums = np.array(list(dlen2num.values()), dtype=np.int32)
    full_parts = np.repeat(chunk_len, (lengths // chunk_len * nums).sum()).astype(np.int32)
    tails = lengths % chunk_len
    samples = np.concatenate([full_parts,
                              np.repeat(tails[tails > 0], nums[tails > 0]).astype(np.int32)])
    rng.shuffle(samples)
    samples = samples.tolist()
    sample_idx, tail, packs = 0, 0, []
    for _ in range(sum(samples) // pack_len):
        _pack, left = [], pack_len
        if tail > 0:
            _pack.append(tail)
            left -= tail
            tail = 0
        while left > 0 and sample_idx < len(samples):
            if samples[sample_idx] <= left:
                _pack.append(samples[sample_idx])
                left -= samples[sample_idx]
            else:
                _pack.append(left)
                tail = samples[sample_idx] - left
                left = 0
            sample_idx += 1
        if _pack:
            packs.append(_pack)
    rng.shuffle(packs)
    return packs


def test_packs_are_magiattentions_packs_list_for_list():
    """``packs.pack`` (whole-array) against their loop, every pack, on a fresh random
    histogram, pack length and seed."""
    rng = random.Random()
    seed = rng.randrange(2 ** 31)
    edges = sorted(rng.sample(range(1, 40000), 12))
    bins = [(lo, hi, rng.randrange(0, 400)) for lo, hi in zip([0, *edges], edges)]
    pack_len = 4 * rng.randrange(2000, 20000)
    theirs = _their_packs(bins, pack_len, seed)
    mine = [list(packs.pack(bins, pack_len, pack_len // 4, i, seed))
            for i in range(len(theirs))]
    assert mine == theirs, (bins, pack_len, seed)
    with pytest.raises(UsageError, match=f"makes {len(theirs)} packs"):
        packs.pack(bins, pack_len, pack_len // 4, len(theirs), seed)


@pytest.mark.slow
def test_trace_packs_are_the_packs_magiattentions_benchmark_timed():
    """``trace:magiattention,packs`` with seeds 0-19: the 20 packs their benchmark takes first
    at 8 GPUs x 8K (their sampler seeded 42 on the shipped trace, their loop: ~5 s)."""
    theirs = _their_packs(traces.histogram(traces.text("magiattention")), 65536, packs.SEED)
    for k in range(20):
        docs = resolve_documents("trace:magiattention,packs", 65536, seed=k, max_document=None)
        assert list(docs) == theirs[k] and sum(docs) == 65536, k


def test_packs_refuse_a_pack_too_short_to_hold_the_trace_in_memory():
    """At 256 tokens a pack, the trace's 24 G tokens are 379 M pieces: refused before any is
    made, saying what to give."""
    with pytest.raises(UsageError, match="379 M pieces .at most 64 M.; give a longer --seqlen"):
        resolve_documents("trace:magiattention,packs", 256, seed=0, max_document=None)
