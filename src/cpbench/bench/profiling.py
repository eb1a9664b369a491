"""``cpbench run --profile DIR``: where a case's step time goes.

After the timing (so the timed samples stay unprofiled), every rank runs the case's step a
few more times under torch.profiler with its own short schedule: one warm-up step the
profiler discards (its start-up, CUPTI's on GPU, stays out of the figures), then
``PROFILED_STEPS`` recorded steps, each lined up by a barrier as the timer does and marked
``cpbench/step`` (on GPU the mark ends after a synchronize, so it holds all its kernels).
Each rank writes ``DIR/<case index>_<strategy>_<case digest>/rank{r}.trace.json.gz`` (the
digest of the record's key keeps a sweep's cases, each a run of its own, apart) (Perfetto,
chrome://tracing and HTA read it), then computes its breakdown (``cpbench.profile``) **from
the saved file**: a later ``cpbench profile summarize`` of that trace gives the same figures,
which figures computed from the profiler's in-memory events would not (the export rounds
and shifts timestamps).

The record's ``profile`` section is the breakdown of the slowest rank (the longest mean
profiled step: a step ends when its last rank finishes), as ``section`` builds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import warnings
from pathlib import Path
from typing import Callable, Iterator

from cpbench.profile import breakdown, groups

PROFILED_STEPS = 3


def trace_paths(directory: str, index: int, strategy: str, world_size: int,
                key: str = "") -> list[str]:
    """Every rank's trace file of case ``index`` (1-based, the run's case order) whose
    record key (``results.case_key``) is ``key``."""
    digest = f"_{hashlib.sha1(key.encode()).hexdigest()[:8]}" if key else ""
    case_dir = Path(directory).resolve() / f"{index}_{strategy}{digest}"
    return [str(case_dir / f"rank{r}.trace.json.gz") for r in range(world_size)]


@contextlib.contextmanager
def _native_stderr_muted() -> Iterator[None]:
    """Kineto prints "profiler_start" / "profiler_stop" lines from C++ on every rank (no
    setting turns them off): file descriptor 2 goes to /dev/null meanwhile, so only rank 0's
    own lines reach the terminal. Python exceptions still propagate, after it is restored."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def profile_rank(step: Callable[[], None], *, path: str, device: str,
                 barrier: Callable[[], None], steps: int = PROFILED_STEPS) -> dict:
    """Profile ``steps`` calls of ``step`` on this rank (collective: every rank calls it),
    write the trace to ``path``, and return the breakdown of the saved trace
    (``Breakdown.to_dict()``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    os.environ.setdefault("KINETO_LOG_LEVEL", "4")  # no "Completed Stage" lines per rank
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    plan = schedule(wait=0, warmup=1, active=steps, repeat=1)
    with warnings.catch_warnings(), _native_stderr_muted():
        # one cycle is all this records: torch's note that cycles do not accumulate is noise
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        with profile(activities=activities, schedule=plan,
                     on_trace_ready=lambda prof: prof.export_chrome_trace(path)) as prof:
            for _ in range(1 + steps):
                sync()
                barrier()  # every rank starts the step together, as in the timing
                sync()  # the barrier's own kernel (NCCL) ends before the step's window
                with record_function(breakdown.STEP_MARK):
                    step()
                    sync()
                prof.step()
    return breakdown.from_file(path, groups.load()).to_dict()


def gather(mine: dict) -> list[dict]:
    """Every rank's breakdown, rank order (a collective)."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def section(everyone: list[dict], traces: list[str]) -> dict:
    """The record's ``profile``: the slowest rank's breakdown, every rank's step time and
    exposed communication beside it, and every rank's trace."""
    slowest = max(range(len(everyone)), key=lambda r: (everyone[r]["step_ms"], -r))
    return {"rank": slowest, **everyone[slowest],
            "step_ms_by_rank": [b["step_ms"] for b in everyone],
            "exposed_comm_ms_by_rank": [b["exposed_comm_ms"] for b in everyone],
            "traces": traces}
