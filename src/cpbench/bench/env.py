"""What a result was measured on: versions, devices, hosts, launch, code revision, time.

Goes into every record, so a number can be traced back to its machine and commit.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

# torch is imported inside the functions that read it: the CLI's bad-input line (which asks
# under_torchrun) must not wait seconds for torch's import
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
# A rank process costs roughly this much RAM before it holds any tensor (torch, gloo).
RANK_OVERHEAD_BYTES = 400 * 2 ** 20
RANKS_PER_CORE = 8  # beyond this, ranks mostly wait for a core and timings mean little


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher setting its env)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def torchrun_world() -> tuple[int, int, int]:
    """(rank, world size, local world size) from torchrun's environment."""
    return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
            int(os.environ["LOCAL_WORLD_SIZE"]))


def tell_torchrun(message: str) -> None:
    """Leave ``message`` in this worker's error file (``TORCHELASTIC_ERROR_FILE``, one per
    worker, set by torchrun's agent) in the layout torch's ``ErrorHandler`` writes: the
    agent's failure summary then shows it as the root cause instead of "To enable traceback
    see ...". The agent's own exit status stays its own (1 for any failed worker)."""
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message,
                        "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # the message is on stderr as well; the summary is a courtesy
        pass


# torchrun's agent ends the job when its first worker exits, stopping the rest: a rank other
# than 0 that found bad input waits up to this long, so that rank 0, which says the error, is
# that first worker. Under load rank 0 can start seconds after the others; stopped before it
# spoke, the user saw no line (tests/multirank/test_cli_run.py). Bad input found by a rank
# other than 0 alone costs this delay, then its error file names it.
RANK0_FIRST_S = 30.0


class _Stopped(Exception):
    pass


def _stopped(signum, frame):
    raise _Stopped


def outlive_rank0() -> None:
    """Under torchrun, on a rank other than 0 with bad input: wait, at most ``RANK0_FIRST_S``,
    until the agent stops this rank (SIGTERM) once rank 0 has said the error and exited; then
    return, for the caller to leave its error file (later than rank 0's: the summary's root
    cause is the earliest) and exit with the bad-input status."""
    import signal
    import time

    try:
        previous = signal.signal(signal.SIGTERM, _stopped)
    except ValueError:  # not the main thread: no handler, the agent's signal ends it
        previous = None
    try:
        time.sleep(RANK0_FIRST_S)
    except _Stopped:
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def bind_local_gpu() -> None:
    """Under torchrun with GPUs: make this rank's GPU (LOCAL_RANK) current before anything
    touches torch.cuda (the plan reads the device's memory), so no rank opens a context on
    GPU 0. Leaves it to the plan to refuse more local ranks than GPUs."""
    import torch

    if under_torchrun() and torch.cuda.is_available():
        local = int(os.environ["LOCAL_RANK"])
        if local < torch.cuda.device_count():
            torch.cuda.set_device(local)


def meminfo_bytes(field: str) -> int | None:
    """A ``/proc/meminfo`` figure (``MemTotal``, ``MemAvailable``, …) in bytes; None where
    there is no such file or field (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info[field].split()[0]) * 1024  # the kernel prints kB (KiB)
    except (OSError, KeyError, ValueError):
        return None


def max_local_ranks() -> int:
    """How many CPU ranks this machine can start: bounded by cores and by available RAM
    (decided once, by the process that starts them)."""
    limit = RANKS_PER_CORE * (os.cpu_count() or 1)
    available = meminfo_bytes("MemAvailable")
    if available is not None:
        limit = min(limit, available // RANK_OVERHEAD_BYTES)
    return max(1, limit)


def cpus_usable() -> int:
    """The cores this process may run on (its affinity: what Slurm's binding leaves it), not
    the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def cpu_warnings(hostnames: list[str], cpus: list[int]) -> list[str]:
    """A line for each host whose ranks have less than one usable core each (by rank:
    ``hostnames[r]``, ``cpus[r]``): e.g. an srun step bound to one core."""
    lines = []
    for host in dict.fromkeys(hostnames):
        ranks = [r for r, h in enumerate(hostnames) if h == host]
        fewest = min(cpus[r] for r in ranks)
        if fewest < len(ranks):
            lines.append(f"warning: {host}: {len(ranks)} ranks share {fewest} usable "
                         f"core(s) (less than one each: timings will be slow); give the job "
                         f"step the node's cores (srun --cpus-per-task, see "
                         f"docs/gpus-and-slurm.md)")
    return lines


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def device_name(device: str) -> str:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def nccl_version() -> str | None:
    """The NCCL torch runs with, or None (no GPU, or a build without NCCL)."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        version = torch.cuda.nccl.version()  # a tuple in recent torch, an int in old ones
    except Exception:  # NCCL absent from this build
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def capture(*, device: str, launcher: str, hostnames: list[str], world_size: int,
            ranks_per_node: int, cpus: list[int] | None = None,
            kernel_package: dict | None = None) -> dict:
    """The environment record of this run (called on rank 0; ``hostnames`` and ``cpus``, the
    usable cores, by rank). ``cpus_usable``: the fewest any rank may use. ``kernel_package``:
    the kernel's distribution, version and file (``KernelBackend.provenance``)."""
    import torch

    nccl = nccl_version()
    sha = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no")) if sha else None
    return {
        "utc": utc_now(),
        "cpbench": _version("cpbench"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "flash_attn": _version("flash-attn") or _version("flash_attn"),
        "kernel_package": kernel_package,
        "device": device,
        "device_name": device_name(device),
        "cpu_count": os.cpu_count(),
        "cpus_usable": min(cpus) if cpus else cpus_usable(),
        "threads_per_rank": torch.get_num_threads(),
        "hostnames": hostnames,
        "world_size": world_size,
        "ranks_per_node": ranks_per_node,
        "num_nodes": world_size // ranks_per_node,
        "launcher": launcher,
        "git_sha": sha,
        "git_dirty": dirty,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
