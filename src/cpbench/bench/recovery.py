"""What the driver does after a case broke the process group (``bench.driver``).

A rank failing *inside* a strategy's communication, while its peers wait on it, cannot be
agreed on: its peers are blocked in the collective. The failing rank says so first (stderr and
the launcher's store: ``bench.failures``), then:

- gloo (CPU): it waits for its peers in the agreement for a short grace (one estimated step,
  at least 5 s), then destroys its groups; the closed connections fail its peers' waits at
  once. Rank 0 records the case with the failing rank's error (left in the rendezvous store),
  every rank forms the process group again under a fresh store prefix
  (``launch.reform_world``; the processes stay) and the run goes on with the next case. A rank
  that dies under ``--nproc``: the launching process tells the survivors
  (``launch.DEAD_KEY``), records the case as failed and lists the cases not run.
- NCCL (GPU): in-process recovery is not safe (after the watchdog aborts a communicator,
  blocked host syncs return garbage; torch's ``_set_pg_timeout`` says as much), so cases are
  isolated in processes instead: the sweep and the sbatch script launch one strategy per
  torchrun. The peers block until the case's collective timeout; the watchdog then ends the
  processes (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, which every cpbench launch path sets and
  torchrun gives by default) and the launcher records the case from the store or the log.
  A group that breaks without ending the process (other values) stops the run: the groups
  are aborted, never destroyed (a flush on a communicator in error can hang).
- Ranks as threads (``--launcher threads``, any device): as on gloo; the failing rank gives
  up on its threaded world (``threadpg.leave_world``), which fails its peers' waits at once,
  and every rank forms the next one.
- A sticky CUDA error (illegal or misaligned address) stops the run too: the context is dead.
- A rank stuck outside any collective (a kernel that never returns) is stopped only by
  ``--deadline`` (``--nproc``), the sweep's per-case timeout or the scheduler's time limit.
"""

from __future__ import annotations

import logging

from cpbench.bench import agreement
from cpbench.bench.plan import Case, Plan

log = logging.getLogger("cpbench")


def go_on_after(p: Plan, i: int, broken: str) -> bool:
    """Case ``i`` (1-based) broke the group (``broken``: "group" or "device"): whether the
    run goes on with case i + 1 (the group formed again); if not, the cases left are listed."""
    rest = p.cases[i:]
    why = reform(p, i) if rest and reformable(p, broken) else \
        stop_reason(p, broken) if rest else "no case left"
    if why is None:
        return True
    if rest:
        log.info("%s", not_run_note(p.cases[i - 1], rest, why))
    return False


def not_run_note(broke_in: Case, rest: tuple[Case, ...], why: str) -> str:
    names = ",".join(dict.fromkeys(c.strategy for c in rest))
    return (f"not run: {', '.join(c.label for c in rest)} — a collective failed in "
            f"{broke_in.label} and the process group could not be formed again ({why}); "
            f"re-run them with --strategy {names}")


def reform(p: Plan, i: int) -> str | None:
    """After case ``i`` broke the group: form it again for case i + 1; why not, or None."""
    from cpbench.launch import reform_world

    log.info("a collective failed: forming the process group again")
    try:
        reform_world(i, p.waits[i][0])
    except Exception as e:  # a rank died or cannot come: stop here
        return agreement.one_line(e)
    return None


def reformable(p: Plan, broken: str) -> bool:
    """In-process re-forming is proven on gloo and on ranks as threads (a fresh threaded
    world) only; NCCL cases are isolated by the launcher."""
    return broken == "group" and (p.run.device == "cpu" or not p.timed)


def stop_reason(p: Plan, broken: str) -> str:
    if broken == "device":
        return "a sticky CUDA error left this device's context unusable"
    return f"on {'NCCL' if p.run.device == 'cuda' else p.run.device} the group is not formed " \
           f"again in-process (launch one strategy per torchrun: cpbench sweep, the sbatch script)"
