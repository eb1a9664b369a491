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
