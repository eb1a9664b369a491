"""``cpbench compare A B``: is run B really slower than run A, and where did the time go?

- ``match``: which records of A and B are the same case (strategy, resolved options, problem,
  topology, kernel), which are only in one run, and what else changed between the runs (the
  records' environment: versions, hosts, topology, git sha).
- ``stats``: per (case, phase), the ratio of medians B / A with a bootstrap interval, the
  Mann–Whitney U test, Holm's correction across the comparison, the verdict.
- ``profile``: the profiled parts of a step (β, Δβ, z-scores, seed 004's suspicion score).
- ``analysis``: the comparison itself (``compare``), from two lists of records.
- ``render`` (terminal, json), ``markdown`` (seed 004's report), ``plot`` (distributions).
"""

from cpbench.compare.analysis import PHASES, Comparison, PhaseTest, compare

__all__ = ["PHASES", "Comparison", "PhaseTest", "compare"]
