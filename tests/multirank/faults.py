"""The tests' fault injection for whole launches (torchrun jobs, the sweep, the sbatch
script) and for the driver's ranks in test_driver.py (imported there): ``test-oom-in-ring`` is
zigzag, except that rank 1 runs out of memory at its third attention call while its peers wait
for it in the ring.

With ``CPBENCH_TEST_WATCHDOG_S`` and ``CPBENCH_TEST_OOM_MARK`` (a path) set, it ends as a NCCL
job does under ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (what every cpbench launch path sets): the
peers stay blocked (as in a CUDA sync on a ring step that never completes) and the watchdog ends
every rank's process that many seconds after rank 1 reported, so nobody can record the case from
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

from cpbench.bench import failures
from cpbench.strategies import register
from cpbench.strategies.zigzag import Zigzag

WATCHDOG_ENV = "CPBENCH_TEST_WATCHDOG_S"
MARK_ENV = "CPBENCH_TEST_OOM_MARK"  # a file rank 1 creates once it has reported


@register
class OomInRing(Zigzag):
    name = "test-oom-in-ring"
    description = "rank 1 raises torch.OutOfMemoryError at its third call (test)"

    def attention(self, q, k, v):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3 and os.environ.get(WATCHDOG_ENV) and self.rank != 1:
            _blocked_until_watchdog()
        if self.rank == 1 and self.calls == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected on rank 1, call 3)")
        return super().attention(q, k, v)


def _watchdog() -> None:
    """The watchdog's end of this process (SIGABRT), that many seconds from now."""
    threading.Timer(float(os.environ[WATCHDOG_ENV]), os.abort).start()


def _blocked_until_watchdog() -> None:
    """A peer of rank 1: blocked on it for good; the watchdog counts from rank 1's report (on a
    busy host rank 1 reaches its third call, and then reports, seconds after its peers)."""
    while not os.path.exists(os.environ[MARK_ENV]):
        time.sleep(0.1)
    _watchdog()
    while True:
        time.sleep(1)


def _leave_then_mark(rank: int, *args) -> None:
    """cpbench's own report of a rank's failure, then the mark its peers' watchdogs wait for."""
    _leave(rank, *args)
    if os.environ.get(WATCHDOG_ENV):
        _watchdog()
        open(os.environ[MARK_ENV], "w").close()


_leave, failures.leave = failures.leave, _leave_then_mark


if __name__ == "__main__":
    if sys.argv[1:2] == ["sweep"]:
        from cpbench.cli import main
        sys.exit(main(sys.argv[1:]))
    from cpbench.run import main
    sys.exit(main())
