"""The GPU paths no CPU test reaches, on a machine with 2 or more GPUs (`make test-gpu`;
skipped elsewhere): NCCL after a rank fails inside a ring, flash-attn on odd shapes (the
alignment the kernels need), torchrun's device binding, and `cpbench doctor`'s NCCL probe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpbench import results

HERE = Path(__file__).resolve().parent
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs"),
]


def _torchrun(*args, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_nccl_oom_inside_a_ring_is_recorded_and_the_next_case_runs(tmp_path):
    """With TORCH_NCCL_ASYNC_ERROR_HANDLING=2 the processes survive the watchdog's abort:
    the failing case is recorded OOM with rank 1's message, the group is formed again and
    zigzag runs."""
    out = tmp_path / "r.jsonl"
    done = _torchrun(str(HERE / "faulty_run.py"), "--strategy", "test-oom-in-ring,zigzag",
                     "--seqlen", "16k", "--collective-timeout", "60", "--out", str(out),
                     env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"})
    records = results.read(out)
    assert [(r["config"]["strategy"], r["status"]) for r in records] == [
        ("test-oom-in-ring", "OOM"), ("zigzag", "ok")], done.stdout + done.stderr
    assert "injected on rank 1, call 3" in records[0]["error"]


def test_flash_attn_on_odd_shapes_every_strategy(tmp_path):
    """5 heads, S = 200 on 2 GPUs (zigzag halves of 50 rows), bf16: no "misaligned address",
    every check passes; the kernel's package is in the record."""
    out = tmp_path / "r.jsonl"
    done = _torchrun("-m", "cpbench.run", "--strategy", "all", "--heads", "5", "--seqlen",
                     "200", "--head-dim", "64", "--check", "--warmup", "1", "--iters", "2",
                     "--out", str(out))
    assert "misaligned" not in done.stdout + done.stderr
    records = results.read(out)
    assert records and all(r["status"] == "ok" for r in records), done.stderr
    assert all(r["derived"]["check_passed"] for r in records)
    assert records[0]["env"]["kernel_package"]["version"]


def test_doctor_probes_nccl_between_two_gpus():
    done = subprocess.run([sys.executable, "-m", "cpbench.cli", "doctor"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nccl on cuda" in done.stdout
