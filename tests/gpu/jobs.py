"""Running a GPU test's job so that a hung one never outlives its test: each subprocess in its
own session, killed as a group on timeout (NCCL workers left behind keep the GPUs, and the
next test then hangs or runs out of memory), and each test's own timeout above its
subprocess's, so the subprocess's limit fires first and its output is reported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpbench.sweep.runner import kill_group  # the sweep's: SIGTERM, grace, SIGKILL

HERE = Path(__file__).resolve().parent
FAULTS = HERE.parent / "multirank" / "faults.py"  # test-oom-in-ring, and the CLI with it
JOB_TIMEOUT_S = 600
# pytest-timeout's limit for a test running one job: above the job's, with room to kill it
TEST_TIMEOUT_S = JOB_TIMEOUT_S + 120
# what cpbench's launch paths set (cpbench.sweep.runner, the sbatch script)
ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def run(cmd: list[str], *, env: dict | None = None, timeout: float = JOB_TIMEOUT_S,
        cwd=None, keep_env: bool = False) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout kill its whole process group and fail the
    test with what it printed. ``keep_env``: the environment as is (no error handling set)."""
    full = dict(os.environ, **({} if keep_env else ERROR_HANDLING), **(env or {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full, cwd=cwd, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout:.0f} s (its process group was "
                    f"killed):\n{out[-8000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def torchrun(*args, nproc: int = 2, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(nproc), *map(str, args)], **kw)


def cpbench(*args, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "cpbench.cli", *map(str, args)], **kw)
