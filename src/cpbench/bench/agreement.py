"""How the ranks agree on each phase of a case, so one rank's failure becomes the phase's
status on every rank.

After each phase, all ranks all-reduce a status flag (ok / OOM / failed); a failure on any
rank becomes the phase's status everywhere, with that rank's message. A rank failing *inside*
a strategy's communication, while its peers wait on it, cannot be agreed on: the collective
fails (gloo) or the watchdog aborts (NCCL). A rank that sees a collective fail does not enter
the agreement; it leaves its own error in the rendezvous store, where rank 0 reads the likely
cause, and the phase is marked ``broken``: no further collective is attempted in the case,
and the driver forms the process group again (see ``cpbench.bench.recovery``).

A rank that failed by itself waits for its peers in the agreement only ``grace_s`` (gloo):
past that they are blocked inside the strategy's communication, waiting on it, and would
wait out the whole collective timeout; it gives up on the group instead, and when it destroys
the group, gloo fails their waits at once (a closed connection).

A rank that failed by itself also says so at once, before it waits for anyone: one line on
stderr and, under a launcher that hosts a store, that store (``bench.failures``), so the case
is recorded with its own status even when the launch ends before rank 0 can record it.

A sticky CUDA error (an illegal or misaligned address, a launch failure) leaves the device's
context dead: every later call fails, collectives included. It breaks the phase like a failed
collective, and the driver stops the run (``sticky``).
"""

from __future__ import annotations

import gc
import json
import time
import traceback
from typing import Any, Callable

import torch

from cpbench import results
from cpbench.bench import failures

_STATUS_CODE = {results.OK: 0, results.OOM: 1, results.FAILED: 2}


def store():
    """The rendezvous store (a TCP key-value store beside the process group): it still works
    when a collective has failed, so a failing rank can leave its error there for rank 0."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # best effort: without it, rank 0 reports its own error
        return None


# -- 3. on every rank ------------------------------------------------------------------------

def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))  # the CPU allocator


# What gloo and NCCL errors say when a collective failed or timed out (gloo raises plain
# RuntimeErrors; newer torch raises DistError subclasses for some).
_COLLECTIVE_ERRORS = ("Timed out waiting", "pair closure", "Connection closed by peer",
                      "Connection reset by peer", "gloo/transport", "NCCL error",
                      "ProcessGroupNCCL", "ProcessGroupGloo")


def is_collective_error(e: BaseException) -> bool:
    """Whether ``e`` says a collective failed, leaving the process group unusable."""
    dist_error = getattr(torch.distributed, "DistError", None)
    return (dist_error is not None and isinstance(e, dist_error)) or \
        any(marker in str(e) for marker in _COLLECTIVE_ERRORS)


# what CUDA says when the context is lost for good (cudaErrorIllegalAddress,
# cudaErrorMisalignedAddress, cudaErrorLaunchFailure, cudaErrorIllegalInstruction, ...)
_STICKY_CUDA_ERRORS = ("illegal memory access", "misaligned address",
                       "unspecified launch failure", "illegal instruction",
                       "device-side assert triggered", "CUDA error: an illegal")


def is_sticky_cuda_error(e: BaseException) -> bool:
    """Whether ``e`` says the CUDA context is dead (no later call can succeed)."""
    return any(marker in str(e) for marker in _STICKY_CUDA_ERRORS)


def one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


class Agreement:
    """Runs phases of one case on this rank; after each, all ranks agree on how it went, so a
    failure on any rank becomes the phase's status on every rank. Once a collective has
    failed, the process group is unusable: the phase's status is the failing rank's own (as
    it left it in the store; else "failed" with this rank's collective error), ``broken`` is
    set, and no further collective is attempted (see the module docstring)."""

    def __init__(self, device: str, store=None, key: str = "", grace_s: float | None = None,
                 case: tuple[str, str | None] = ("", None)):
        import torch.distributed as dist

        self.dist, self.store, self.key, self.grace_s = dist, store, key, grace_s
        self.case = case  # (label, record key): what failures.leave names
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)  # allocated before any OOM
        self.status: str = results.OK
        self.error: str | None = None
        self.traceback: str | None = None
        self.broken = self.sticky = False

    def __call__(self, fn: Callable[[], Any]) -> Any:
        if self.status != results.OK or self.broken:
            return None
        # msg, tb: set with a failure (mine not OK), the only case that reads them
        mine, msg, tb, value, collective = results.OK, "", "", None, False
        try:
            value = fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            mine = results.OOM if is_oom(e) else results.FAILED
            msg, tb, collective = one_line(e), traceback.format_exc(), is_collective_error(e)
            self.sticky = is_sticky_cuda_error(e)
        if mine != results.OK:
            cleanup()  # after the except block: its traceback no longer pins tensors
            self._publish(mine, msg, tb, collective)
            if not collective:  # said before waiting on anyone: the wait may never end
                failures.leave(self.dist.get_rank(), self.case[1], self.case[0], mine, msg)
        if collective:  # a collective failed here: the group is unusable, agree on nothing
            self._break(None, msg)
            return None
        if self.sticky:  # the device is unusable: no collective on it can succeed
            self.broken = True
            me = self.dist.get_rank()
            self.status, self.error, self.traceback = mine, f"rank {me}: {msg}", tb
            return None
        try:
            self.flag.fill_(_STATUS_CODE[mine])
            self._all_reduce(failed_here=mine != results.OK)
            agreed = int(self.flag.item())
            if not agreed:
                return value
            reports: list[Any] = [None] * self.dist.get_world_size()
            self.dist.all_gather_object(reports, (mine, msg, tb))
        except Exception as e:  # the agreement is a collective too
            self._break((mine, msg, tb) if mine != results.OK else None, one_line(e))
            return None
        self.status = next(s for s, c in _STATUS_CODE.items() if c == agreed)
        rank, (_, msg, tb) = next((r, rep) for r, rep in enumerate(reports)
                                  if rep[0] == self.status)
        self.error, self.traceback = f"rank {rank}: {msg}", tb
        return None

    def _all_reduce(self, *, failed_here: bool) -> None:
        """The flag's all-reduce; bounded by ``grace_s`` on a rank that failed by itself."""
        op = self.dist.ReduceOp.MAX
        if not failed_here or self.grace_s is None:
            self.dist.all_reduce(self.flag, op=op)
            return
        work = self.dist.all_reduce(self.flag, op=op, async_op=True)
        deadline = time.monotonic() + self.grace_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the other ranks did not come to agree within "
                                   f"{self.grace_s:.0f} s: they wait on this rank inside the "
                                   f"strategy's communication")
            time.sleep(0.01)
        work.wait()

    def _publish(self, status: str, msg: str, tb: str, collective: bool) -> None:
        """Leave this rank's failure in the store, where rank 0 can read it if the group
        breaks before the agreement."""
        if self.store is None:
            return
        try:
            self.store.set(f"cpbench/{self.key}/{self.dist.get_rank()}",
                           json.dumps([status, msg, tb, collective]))
        except Exception:  # best effort
            pass

    def _peer_failure(self) -> tuple[int, str, str, str] | None:
        """The first rank's own (non-collective) failure left in the store: the likely cause
        of the collective failing. None when no rank left one."""
        if self.store is None:
            return None
        for rank in range(self.dist.get_world_size()):
            key = f"cpbench/{self.key}/{rank}"
            try:
                if not self.store.check([key]):
                    continue
                status, msg, tb, collective = json.loads(self.store.get(key))
            except Exception:  # best effort
                return None
            if not collective:
                return rank, status, msg, tb
        return None

    def _break(self, own: tuple | None, collective_msg: str) -> None:
        """The group broke (``collective_msg`` on this rank); ``own``: this rank's own
        (status, message, traceback) failure in the phase, if it had one."""
        self.broken = True
        me = self.dist.get_rank()
        cause = (me, *own) if own else self._peer_failure()
        broke = f"rank {me}: {collective_msg}"
        if cause is None:
            self.status, self.error, self.traceback = results.FAILED, broke, None
            return
        rank, status, msg, tb = cause
        self.status, self.traceback = status, tb
        self.error = f"rank {rank}: {msg}; then a collective failed ({broke})"


def first_traceback(*phases: Agreement | None) -> str | None:
    """The traceback of the first phase that failed (an OOM keeps none)."""
    return next((ph.traceback for ph in phases
                 if ph is not None and ph.status == results.FAILED), None)


def usable(*phases: Agreement | None) -> bool:
    """Whether every phase given went well and left the group usable."""
    return all(ph is None or (ph.status == results.OK and not ph.broken) for ph in phases)


def cleanup() -> None:
    """Free what a failed or finished phase left (before the next allocation)."""
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.empty_cache()
        except RuntimeError:  # a dead context (a sticky error): nothing to free
            pass
