"""The tests' fault injection for whole launches (torchrun jobs, the sweep, the sbatch
script) and for the driver's ranks in test_driver.py (imported there): ``test-oom-in-ring`` is
zigzag, except that rank 1 runs out of memory at its third attention call while its peers wait
for it in the ring.

With ``CPBENCH_TEST_WATCHDOG_S`` and ``CPBENCH_TEST_OOM_MARK`` (a path) set, it ends as a NCCL
job does under ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (what every cpbench launch path sets): the
peers stay blocked (as in a CUDA sync on a ring step that never completes) and the watchdog ends
every rank's process that many seconds after rank 1 raised, so nobody can record the case from
inside the job; the launcher has to. The failing rank's own path (its stderr line, the
launcher's store) is cpbench's real code.

Run as a script it is ``cpbench`` (first argument ``sweep``) or ``python -m cpbench.run``
(anything else) with the strategy registered: a launch's entry and the sweep's CLI alike.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

from cpbench.strategies import register
from cpbench.strategies.zigzag import Zigzag

WATCHDOG_ENV = "CPBENCH_TEST_WATCHDOG_S"
MARK_ENV = "CPBENCH_TEST_OOM_MARK"  # a file rank 1 creates as it raises


@register
class OomInRing(Zigzag):
    name = "test-oom-in-ring"
    description = "rank 1 raises torch.OutOfMemoryError at its third call (test)"

    def attention(self, q, k, v):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3 and os.environ.get(WATCHDOG_ENV):
            _watchdog(self.rank)
        if self.rank == 1 and self.calls == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected on rank 1, call 3)")
        return super().attention(q, k, v)


def _watchdog(rank: int) -> None:
    """The watchdog's end of the process (SIGABRT), on every rank, counted from rank 1's raise:
    on a busy host rank 1 reaches its third call seconds after its peers, and a peer's clock
    started at its own third call would end the job before rank 1 had raised."""
    mark = os.environ[MARK_ENV]
    if rank != 1:
        while not os.path.exists(mark):  # blocked on rank 1, which never comes
            time.sleep(0.1)
    else:
        open(mark, "w").close()
    threading.Timer(float(os.environ[WATCHDOG_ENV]), os.abort).start()
    while rank != 1:
        time.sleep(1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["sweep"]:
        from cpbench.cli import main
        sys.exit(main(sys.argv[1:]))
    from cpbench.run import main
    sys.exit(main())
