"""Persistent rank pools for the multirank tests: one gloo world per size, formed once per
session, each test a task on it (TransformerEngine's CP tests run their matrix through one
set of torchrun workers the same way). A rank imports torch, the test's body module and forms
the process group once per pool, not once per test: 0.1 s a launch for a light body, about
3 s at 8 ranks for one that imports the driver and the reports, on 2 cores.

``run_ranks`` here has ``cpbench.launch.run_ranks``' signature and results. A task that fails
(a rank raised or died, the deadline passed) or leaves the world other than it found it (a
body that destroyed or formed the process group again) ends its pool: the next task at that
size forms a fresh one, so no test inherits a broken world. The launcher's own behaviour (a
rank's traceback, a hang killed at the deadline, a rank dying mid-run) is tested on
``cpbench.launch.run_ranks`` itself, which starts new processes each time.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from cpbench.launch import NCCL_ERROR_HANDLING, LaunchTimeout, RankError, _context, free_port

# the pool's process-group timeout: a body's collectives wait this long at most, unless the
# body sets its own (the driver's per-case timeout); restored after every task
POOL_PG_TIMEOUT_S = 300.0
_ids = itertools.count()


def _serve(rank: int, world: int, port: int, tasks, results, threads: int) -> None:
    """A pool rank: form the world once, then run tasks until told to stop (None)."""
    import torch
    import torch.distributed as dist

    from cpbench import topology

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), **NCCL_ERROR_HANDLING)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=POOL_PG_TIMEOUT_S))
    formed = dist.group.WORLD
    while (task := tasks.get()) is not None:
        task_id, fn, args, leave_together = task
        try:
            out = fn(rank, world, *args)
            if leave_together:
                dist.barrier()  # as run_ranks: no rank leaves a collective its peers are in
            # a body that destroyed or re-formed the world (the driver's recovery) leaves
            # one this pool cannot vouch for: the pool ends after this task
            intact = dist.is_initialized() and dist.group.WORLD is formed
            report = (task_id, rank, "ok", out, intact)
        except BaseException:  # everything goes back to the parent, as run_ranks does
            report = (task_id, rank, "error", traceback.format_exc(), False)
        results.put(report)
        if report[-1]:  # what a body may change and the next one must not inherit
            torch.set_num_threads(threads)
            topology.set_timeout(POOL_PG_TIMEOUT_S)
    results.close()
    results.join_thread()
    if dist.is_initialized():
        dist.destroy_process_group()


class Pool:
    """``world`` gloo ranks serving tasks; see the module docstring."""

    def __init__(self, world: int):
        ctx = _context()
        self.world = world
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        threads = max(1, (os.cpu_count() or 1) // world)
        port = free_port()
        self.procs = [ctx.Process(target=_serve, daemon=True,
                                  args=(r, world, port, self.tasks[r], self.results, threads))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float | None,
            leave_together: bool) -> tuple[list[Any], bool]:
        """Every rank's result, and whether the world is still the one the pool formed."""
        task_id = next(_ids)
        for q in self.tasks:
            q.put((task_id, fn, args, leave_together))
        deadline = None if timeout is None else time.monotonic() + timeout
        by_rank: dict[int, Any] = {}
        intact = True
        while len(by_rank) < self.world:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world)) - set(by_rank))
                raise LaunchTimeout(f"ranks {missing} did not finish within {timeout:.0f} s")
            try:
                got_id, rank, status, payload, still = self.results.get(timeout=min(left, 1.0))
            except queue.Empty:
                self._raise_if_dead(by_rank)
                continue
            assert got_id == task_id, "a pool that failed a task is never used again"
            if status == "error":
                raise RankError(f"rank {rank} failed:\n{payload}", by_rank)
            by_rank[rank] = payload
            intact = intact and still
        return [by_rank[r] for r in range(self.world)], intact

    def _raise_if_dead(self, by_rank: dict[int, Any]) -> None:
        dead = [r for r, p in enumerate(self.procs) if r not in by_rank and not p.is_alive()]
        if dead:
            raise RankError(f"rank {dead[0]} died with exit code "
                            f"{self.procs[dead[0]].exitcode} and no report", by_rank)

    def close(self, wait: float = 5.0) -> None:
        """Ask the ranks to leave, then kill those still there (a failed task's)."""
        for q in self.tasks:
            q.put(None)
        end = time.monotonic() + wait
        for p in self.procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_pools: dict[int, Pool] = {}


def run_ranks(fn: Callable[..., Any], nproc: int, *args, timeout: float | None = 300.0,
              leave_together: bool = True) -> list[Any]:
    """``cpbench.launch.run_ranks`` on this session's pool of ``nproc`` ranks."""
    pool = _pools.pop(nproc, None) or Pool(nproc)
    try:
        out, intact = pool.run(fn, args, timeout, leave_together)
    except BaseException:
        pool.close(wait=0.0)  # a failed world is never reused: the next task forms a new one
        raise
    if intact:
        _pools[nproc] = pool
    else:
        pool.close()
    return out


@atexit.register
def close_all() -> None:
    while _pools:
        _pools.popitem()[1].close()
