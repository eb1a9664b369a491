"""Real document-length traces, shipped as package data (sources and licences: README.md here).

Each trace is a histogram in the format MagiAttention's and LongCA-bench's benchmarks ship:
a CSV with a header ``range,number,...`` and one row per bin, ``"[LO, HI]",COUNT,...``
(inclusive bounds, the number of documents whose length fell in the bin). ``--documents
trace:NAME`` samples it (``cpbench.mask``): a bin in proportion to its count, then a length
uniform within it (the traces keep nothing finer than the bin), capped at ``--max-document``.
``file:PATH`` reads a file of this format too.
"""

from __future__ import annotations

import csv
import io
from importlib import resources

from cpbench.errors import UsageError

# name -> (file in this package, one line for --help)
TRACES = {
    "magiattention": ("magiattention.csv", "13.46 M real training documents, 0-196K "
                      "(MagiAttention's CP benchmark)"),
    "pile": ("pile.csv", "153 M documents of the Pile, up to 9.3 M (LongCA-bench)"),
    "prolong64k": ("prolong64k.csv", "25.6 M documents of ProLong's 64K data mix "
                   "(LongCA-bench)"),
    "prolong512k": ("prolong512k.csv", "20.3 M documents of ProLong's 512K data mix, up to "
                    "476K (LongCA-bench)"),
}


def lines() -> list[tuple[str, str]]:
    """(name, one line saying what it is) per trace, for ``--help``."""
    return [(name, line) for name, (_, line) in TRACES.items()]


def text(name: str) -> str:
    """The CSV text of trace ``name``; UsageError naming the traces for an unknown one."""
    if name not in TRACES:
        raise UsageError(f"--documents trace:{name}: no such trace; shipped: "
                         f"{', '.join(TRACES)}")
    return resources.files(__name__).joinpath(TRACES[name][0]).read_text()


def is_histogram(content: str) -> bool:
    return content.lstrip().lower().startswith("range,")


def histogram(content: str) -> list[tuple[int, int, int]]:
    """(low, high, count) per bin, bounds inclusive; ValueError on anything else."""
    bins = []
    for row in list(csv.reader(io.StringIO(content.strip())))[1:]:
        lo, hi = (int(x) for x in row[0].strip(" []").split(","))
        count = int(row[1])
        if lo < 0 or hi < lo or count < 0:
            raise ValueError(f"bad bin {row}")
        if count:
            bins.append((max(lo, 1), max(hi, 1), count))  # a document has a token
    if not bins:
        raise ValueError("no documents")
    return bins
