"""Step 2 of the driver (see ``cpbench.bench.driver``): start the ranks, or join torchrun's,
run the plan on each, and leave.

``launch`` (``--nproc``): local gloo ranks through ``cpbench.launch.run_ranks``, or ranks as
threads on one device (``--launcher threads``: ``cpbench.launch.run_threads``); a case the
ranks did not record (a rank died, the deadline passed) is recorded here as failed.
``torchrun_main``: init from torchrun's environment (NCCL on CUDA, gloo on CPU); a broken
NCCL group is aborted, not destroyed.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter
from datetime import timedelta

import torch

from cpbench import results
from cpbench.bench import agreement
from cpbench.bench import env as env_mod
from cpbench.bench.driver import _rank_main, rank_main
from cpbench.bench.plan import THREADS, Plan, failure_record

log = logging.getLogger("cpbench")

def launch(p: Plan) -> int:
    """Start ``p.world_size`` local ranks (gloo processes, or threads under --launcher
    threads) and run the plan; the exit status. When a rank dies, or the deadline passes,
    the case that was running is recorded as failed and the error (re-raised) says so and
    names the cases not run."""
    from cpbench.launch import LaunchTimeout, RankError, run_ranks

    offset = os.path.getsize(p.out) if p.out and os.path.exists(p.out) else 0
    try:
        if p.launcher == THREADS:
            return _threads(p)
        return run_ranks(rank_main, p.world_size, p, timeout=p.run.deadline,
                         collective_timeout=p.init_timeout,
                         leave_together=False)[0]
    except LaunchTimeout as e:
        lost = _record_lost_case(p, offset, f"{agreement.one_line(e)} (--deadline)")
        raise LaunchTimeout(f"{e}{lost}") from e
    except RankError as e:
        if 0 in e.reported:  # rank 0 lived on: it recorded the case and what did not run
            raise
        raise RankError(f"{e}{_record_lost_case(p, offset, agreement.one_line(e))}") from e


def _threads(p: Plan) -> int:
    """The ranks as threads of this process on one device (``launch.run_threads``); logging
    is the process's, so rank 0's thread alone speaks (``report.console``), and the tracing
    wrappers stay in place while any rank may trace (``commtrace.held``)."""
    from cpbench.bench import commtrace
    from cpbench.launch import run_threads
    from cpbench.report import console

    console.setup(0, p.run.format)
    with commtrace.held():
        return run_threads(rank_main, p.world_size, p, device=p.run.device,
                           timeout=p.run.deadline, collective_timeout=p.init_timeout)[0]


def _record_lost_case(p: Plan, offset: int, error: str) -> str:
    """After the ranks stopped: the first case of the plan with no record since ``offset``
    was running; record it as failed. What to add to the error: that, and the cases not
    run."""
    if not p.out:
        return ""
    written = Counter(results.record_key(r) for r in results.read_from(p.out, offset))
    missing = []
    for i, k in enumerate(p.keys()):  # a baseline timed at both ends has its key twice
        if written[k] > 0:
            written[k] -= 1
        else:
            missing.append(i)
    if not missing:
        return ""
    results.append(p.out, failure_record(p, missing[0], results.FAILED,
                                         f"the ranks stopped during this case: {error}"))
    note = f"\n{p.cases[missing[0]].label} is recorded as failed"
    rest = [p.cases[i] for i in missing[1:]]
    if rest:
        note += f"; not run: {', '.join(c.label for c in rest)} (re-run them with --strategy " \
                f"{','.join(dict.fromkeys(c.strategy for c in rest))})"
    return note


def torchrun_main(p: Plan) -> int:
    """Join torchrun's job (env://) and run the plan on this rank; the exit status."""
    import torch.distributed as dist

    rank, world, _ = env_mod.torchrun_world()
    device_id = None
    handling = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if p.run.device == "cuda" and handling not in ("1", "3") and rank == 0:
        # cpbench's launchers set 1; a hand-run torchrun keeps what the user set
        sys.stderr.write(f"cpbench run: TORCH_NCCL_ASYNC_ERROR_HANDLING={handling}: a "
                         f"collective that times out will not end this launch (see cpbench "
                         f"doctor); 1 lets a launcher record the case and go on\n")
    if p.run.device == "cuda":
        device_id = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device_id)
    # device_id: NCCL errors surface at init (not at the first collective), and new groups
    # can split the world's communicator instead of building their own
    dist.init_process_group("nccl" if p.run.device == "cuda" else "gloo",
                            timeout=timedelta(seconds=p.init_timeout), device_id=device_id)
    broken = True  # unless rank_main returns: then it says
    try:
        code, broken = _rank_main(rank, world, p)
        return code
    finally:
        _leave(broken)


def _leave(broken: bool) -> None:
    """Tear the process groups down: abort a broken one (destroying flushes with
    ncclCommFinalize, which can hang on a communicator in error); none left after a failed
    re-forming."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    if broken and dist.get_backend() == "nccl":
        try:
            c10d._abort_process_group()
            return
        except Exception:  # the watchdog may have aborted it already
            pass
    try:
        dist.destroy_process_group()
    except Exception as e:  # leaving anyway; the records are written
        log.debug("destroying the process group: %s", e)
