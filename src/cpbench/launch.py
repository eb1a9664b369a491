"""Start N local ranks (CPU with gloo; GPUs with NCCL for the doctor's probe) and run a
function on each.

Used by the multi-rank tests and by ``cpbench run --nproc N``. Any rank's exception is
re-raised in the parent with that rank's traceback, and a rank that dies without a word is
noticed; an optional deadline kills the whole group. A rank waiting on a live peer that
will never answer is bounded by the process groups' (collective) timeout.

``reform_world`` forms the process group again after a collective failed (the processes
stay; gloo only: on NCCL the driver isolates cases in launches instead, see
``cpbench.bench.recovery``); when a rank has died, the launcher tells the survivors through the
rendezvous store (``DEAD_KEY``), so they stop waiting for it there.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import queue
import random
import socket
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator


class RankError(RuntimeError):
    """A rank raised or died; the message carries its traceback. ``reported``: what the
    ranks that did finish returned, by rank."""

    def __init__(self, message: str, reported: dict[int, Any] | None = None):
        super().__init__(message)
        self.reported = dict(reported or {})


# set in the rendezvous store by the launcher when a rank died: reform_world stops waiting
DEAD_KEY = "cpbench/dead"


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block at ``n`` torch threads (``None``: as it is) and restore the count after.
    Process-wide: never while threads ranks compute (their shares are set by the launcher)."""
    import torch

    saved = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


# NCCL (the doctor's probe): a rank whose collective times out is ended by the watchdog
# (communicators aborted), so the launcher sees it die instead of waiting on it; set on every
# rank whatever the environment says (torchrun's default is 1 too)
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}

# after a rank dies, how long the others have to notice (gloo: a closed connection fails
# their collective at once) and report, before they are killed
DEATH_GRACE_S = 15.0


class LaunchTimeout(RuntimeError):
    """The ranks did not all finish before the deadline."""


# a free port can be taken by another process (a connection's ephemeral port, another
# launch) before rank 0's store listens on it: seen once in a suite of parallel gloo launches
# on a busy host; rank 0 then fails at once, before ``fn``, and the launch tries another port
PORT_TRIES, PORT_TAKEN = 3, "EADDRINUSE"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A port handed to another program that binds it seconds later (torchrun's rendezvous, a
# sweep's {port}) is drawn here, below the host's ephemeral range: free_port() and every
# outgoing connection (gloo's, NCCL's) draw from that range, and one did take a sweep's port
# before its torchrun bound it (make test, 2026-11-29): torchrun's c10d rendezvous, unable
# to bind, joined the other launch's gloo store as a client and waited there for 14 minutes.
STATIC_PORTS = (20000, 32000)
EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open(EPHEMERAL) as f:
            lo, hi = (int(w) for w in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def rendezvous_port(rng: random.Random | None = None) -> int:
    """A port nothing holds now, outside the ephemeral range (so no connection takes it before
    the program it is given to binds it): random in STATIC_PORTS below that range, else
    above it; free_port() where the range leaves no room (a host that made it everything)."""
    lo, hi = _ephemeral_range()
    first, end = STATIC_PORTS
    spans = [s for s in ((first, min(end, lo)), (hi + 1, 65536)) if s[1] - s[0] >= 100]
    rng = rng or random.Random()
    for _ in range(100 if spans else 0):
        port = rng.randrange(*rng.choice(spans))
        if _bindable(port):
            return port
    return free_port()


def _context():
    # forkserver with torch preloaded: each rank forks from a process that has already paid
    # the torch import, which is most of a rank's start-up time on a 2-core machine.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "cpbench.strategies"])
    return ctx


def _worker(fn, rank, nproc, port, args, results, threads, pg_timeout_s, leave_together,
            backend):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nproc), **NCCL_ERROR_HANDLING)
    torch.set_num_threads(threads)
    try:
        device_id = None
        if backend == "nccl":  # one GPU per rank, current before anything touches CUDA
            device_id = torch.device("cuda", rank)
            torch.cuda.set_device(device_id)
        dist.init_process_group(backend, rank=rank, world_size=nproc,
                                timeout=timedelta(seconds=pg_timeout_s), device_id=device_id)
        out = fn(rank, nproc, *args)
        if leave_together:
            dist.barrier()  # gloo can abort when peers close connections first
        report = (rank, "ok", out)
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        report = (rank, "error", traceback.format_exc())
    # on the wire before the teardown, which can abort the process on a broken group
    results.put(report)
    results.close()
    results.join_thread()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], nproc: int, *args, timeout: float | None = 300.0,
              collective_timeout: float | None = None, threads: int | None = None,
              leave_together: bool = True, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` gloo ranks; return results by rank.

    ``fn`` must be importable by name (defined at module level). Raises RankError with the
    first failing rank's traceback, or LaunchTimeout after ``timeout`` seconds (None: no
    deadline). ``collective_timeout``: the process group's timeout (default: the deadline,
    at least 30 s; 600 s without one). ``leave_together``: a barrier after ``fn`` (False
    when ``fn`` leaves by itself, e.g. skipping the barrier on a broken group). ``backend``:
    "nccl" gives rank r GPU r (``cpbench doctor``'s probe on a GPU node).
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if collective_timeout is None:
        collective_timeout = 600.0 if timeout is None else max(30.0, timeout)
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    for attempt in range(PORT_TRIES):
        try:
            return _run_ranks(fn, nproc, args, timeout, collective_timeout, threads,
                              leave_together, backend, free_port())
        except RankError as e:
            if e.reported or PORT_TAKEN not in str(e) or attempt == PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _run_ranks(fn, nproc: int, args, timeout: float | None, collective_timeout: float,
               threads: int, leave_together: bool, backend: str, port: int) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, daemon=True,
                    args=(fn, r, nproc, port, args, results, threads, collective_timeout,
                          leave_together, backend))
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    by_rank: dict[int, Any] = {}
    try:
        _collect(procs, results, by_rank, timeout, port)
    finally:
        for p in procs:
            if p.is_alive() and len(by_rank) < nproc:
                p.kill()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [by_rank[r] for r in range(nproc)]


def run_threads(fn: Callable[..., Any], nproc: int, *args, device: str = "cpu",
                timeout: float | None = 300.0, collective_timeout: float | None = None
                ) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` ranks as threads of this process,
    on one device (``device``: "cpu", or "cuda": GPU 0 for every rank), over the threaded
    process group (``cpbench.threadpg``); return results by rank.

    Raises RankError naming the first rank that raised, with its traceback, once the others
    stopped (a failing rank's peers stop waiting on it at once), or LaunchTimeout after
    ``timeout`` seconds. ``collective_timeout``: how long a collective or receive waits for
    its peers before it raises, naming the rank and the op (default as for ``run_ranks``)."""
    import torch

    from cpbench import ranklocal, threadpg

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if collective_timeout is None:
        collective_timeout = 600.0 if timeout is None else max(30.0, timeout)
    launch, done = threadpg.Launch(nproc), threading.Condition()
    by_rank: dict[int, Any] = {}
    errors: dict[int, str] = {}

    def body(rank: int) -> None:
        ranklocal.enter(rank)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
        try:
            threadpg.init(launch, rank, device, collective_timeout)
            by_rank[rank] = fn(rank, nproc, *args)
        except BaseException:  # report everything, as a rank process does
            errors[rank] = traceback.format_exc()
            launch.abort(f"rank {rank} failed")  # its peers stop waiting on it
            launch.store.set(DEAD_KEY, str(rank))  # and do not form a group again with it
        finally:
            threadpg.finish()
            ranklocal.leave()
            with done:
                done.notify_all()

    with threadpg.installed(), torch_threads(None):  # the ranks set their shares
        threads = [threading.Thread(target=body, args=(r,), name=f"cpbench-rank{r}",
                                    daemon=True) for r in range(nproc)]
        for t in threads:
            t.start()
        _join_threads(threads, done, timeout, launch, errors)
    if errors:  # the first to fail: the others' errors follow from it
        rank = next(iter(errors))
        raise RankError(f"rank {rank} failed:\n{errors[rank]}", by_rank)
    return [by_rank[r] for r in range(nproc)]


def _join_threads(threads: list, done, timeout: float | None, launch, errors: dict) -> None:
    """Wait for every rank thread; past the deadline, or DEATH_GRACE_S after a rank failed,
    give up on those still running (a thread cannot be killed: it is left, as a daemon, in a
    world every wait of which now fails)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    grace_end = None
    with done:
        while any(t.is_alive() for t in threads):
            now = time.monotonic()
            if errors and grace_end is None:
                grace_end = now + DEATH_GRACE_S
            if grace_end is not None and now > grace_end:
                launch.abort("the launch gave up on the ranks")
                return
            if deadline is not None and now > deadline:
                running = [r for r, t in enumerate(threads) if t.is_alive()]
                launch.abort("the launch gave up on the ranks (deadline)")
                raise LaunchTimeout(f"ranks {running} did not finish within {timeout:.0f} s")
            done.wait(0.5)


def _collect(procs: list, results, by_rank: dict[int, Any], timeout: float | None,
             port: int) -> None:
    """Fill ``by_rank`` with every rank's report; raise on the first failure, on a rank that
    died without one, or past the deadline."""
    nproc = len(procs)
    deadline = None if timeout is None else time.monotonic() + timeout
    while len(by_rank) < nproc:
        left = 1.0 if deadline is None else deadline - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(nproc)) - set(by_rank))
            raise LaunchTimeout(f"ranks {missing} did not finish within {timeout:.0f} s")
        try:
            rank, status, payload = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if r not in by_rank and p.exitcode not in (None, 0)]
            if dead:
                _tell_survivors(port, dead)
                _drain(procs, results, by_rank, dead)
                raise RankError(f"rank {dead[0]} died with exit code "
                                f"{procs[dead[0]].exitcode} and no report", by_rank) from None
            continue
        if status == "error":
            raise RankError(f"rank {rank} failed:\n{payload}", by_rank)
        by_rank[rank] = payload


def _tell_survivors(port: int, dead: list[int]) -> None:
    """Leave DEAD_KEY in the rendezvous store (rank 0 hosts it: gone if rank 0 died)."""
    if 0 in dead:
        return
    try:
        from torch.distributed import TCPStore

        TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2),
                 wait_for_workers=False).set(DEAD_KEY, ",".join(map(str, dead)))
    except Exception:  # best effort: the survivors' re-forming then times out
        pass


def _base_store(store):
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def reform_world(generation: int, timeout_s: float) -> None:
    """Destroy every process group and form the world again, over the same rendezvous store
    under a fresh prefix (``generation``: the same on every rank); the processes stay.
    Collective. Raises RuntimeError when a rank does not come within ``timeout_s`` or the
    launcher reported one dead; the caller then stops."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from cpbench import threadpg, topology

    rank, world, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    base = _base_store(c10d._get_default_store())
    if threadpg.threaded():  # the peers still blocked in this world stop waiting now
        threadpg.leave_world(f"rank {rank} gave up on the process group")
    device_id = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    topology.forget_groups()
    gc.collect()  # the last references to the old groups: their connections close now
    dist.destroy_process_group()
    store = dist.PrefixStore(f"cpbench/reform/{generation}", base)
    store.set(f"arrived/{rank}", "1")
    waiting = [f"arrived/{r}" for r in range(world)]
    deadline = time.monotonic() + timeout_s
    while not store.check(waiting):
        if base.check([DEAD_KEY]):
            raise RuntimeError(f"rank {base.get(DEAD_KEY).decode()} died: the process group "
                               f"cannot be formed again")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every rank came to form the process group again within "
                               f"{timeout_s:.0f} s")
        time.sleep(0.05)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s), device_id=device_id)


def _drain(procs: list, results, by_rank: dict[int, Any], dead: list[int]) -> None:
    """A rank died: let the others report what they finished (rank 0 records the case its
    peer broke) for up to DEATH_GRACE_S, before they are killed."""
    deadline = time.monotonic() + DEATH_GRACE_S
    while time.monotonic() < deadline and any(
            r not in by_rank and r not in dead and p.exitcode is None
            for r, p in enumerate(procs)):
        try:
            rank, status, payload = results.get(timeout=0.5)
        except queue.Empty:
            continue
        if status == "ok":
            by_rank[rank] = payload
