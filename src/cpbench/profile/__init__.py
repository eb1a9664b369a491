"""Where the time goes: profiles read, grouped and broken down (pure analysis: no torch).

- ``groups``: ordered (group, regex) rules as data (``groups.yaml``), extensible by a user;
- ``parsers``: torch.profiler tables, nsys kernel summaries, Chrome traces;
- ``breakdown``: one rank's step wall time partitioned into parts, idle and exposed
  communication;
- ``summary``: the grouped table of ``cpbench profile summarize`` and a run's detail lines.

``cpbench run --profile`` records traces with ``cpbench.bench.profiling`` and computes its
breakdown here, from the saved trace, so a later ``cpbench profile summarize`` of that trace
gives the same figures.
"""
