"""``cpbench sweep``: run a YAML sweep of ``cpbench run`` cases, one launch per case.

A sweep config::

    topology: {nodes: 1, gpus_per_node: 8}   # GPUs: each case under torchrun; CPU: base.nproc
    timeout: 1800                           # seconds per case (a case may set its own)
    base: {heads: 40, head_dim: 128, dtype: bf16, causal: true}
    sweep: {strategy: [ring, zigzag], seqlen: [128K, 256K]}   # the product, first key outermost
    cases: [{strategy: usp, placement: ring-first, seqlen: 1M}]  # irregular extra cases

Setting names are those of ``cpbench run`` (RunConfig and AttentionConfig fields, strategy
options) with ``_`` for ``-``, read through the same schema (``cpbench.settings``). Every case
is validated with ``bench.plan.plan`` before anything runs (``sweep.config``); every error is
listed at once, each with the case it came from.

Each case is its own launch (``sweep.runner``: ``python -m cpbench.run`` in its own process
group, appending to the sweep's ``--out``), so a crash, OOM or hang of one case becomes a
record with status ``failed`` / ``OOM`` / ``timeout`` and the sweep goes on. A case is done
when every row its plan expects has an ``ok`` record in the file, matched by
``results.record_key``, so a re-run skips it; ``--rerun-failed`` retries cases whose latest
record is not ok. A case re-run as a whole appends new rows; readers take the latest row per
key.

``cpbench sweep --run FLAGS...`` runs ``cpbench run`` flags the same way, one case per
strategy (``sweep.config.per_strategy``): what the sbatch script does, so that on NCCL a rank
failing inside one strategy costs that strategy's launch, not the job. A row a launch left
unwritten is recorded from what its failing rank left (``sweep.runner``).

GPU configs (with ``topology``) are planned as rank 0 of that torchrun job would plan them;
on a machine without CUDA the fit check is left to each launch, which plans again where it
runs.
"""

from cpbench.sweep.config import Sweep, SweepCase, SweepError, load, per_strategy
from cpbench.sweep.runner import ENTRY, command, run, run_flags

__all__ = ["ENTRY", "Sweep", "SweepCase", "SweepError", "command", "load", "per_strategy", "run",
           "run_flags"]
