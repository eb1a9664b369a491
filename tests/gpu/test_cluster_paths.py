"""The GPU paths no CPU test reaches, on a machine with 2 or more GPUs (`make test-gpu`;
skipped elsewhere): a real OOM mid-ring under NCCL recorded by a sweep (each strategy its own
torchrun), flash-attn on odd shapes (the alignment the kernels need), and `cpbench doctor`'s
NCCL probe and kernel runs. Each job runs in its own session, killed as a group on timeout
(tests/gpu/jobs.py)."""

from __future__ import annotations

import sys

import pytest
import torch
from jobs import FAULTS, TEST_TIMEOUT_S, cpbench, run, torchrun

from cpbench import results

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(TEST_TIMEOUT_S),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs"),
]


def test_a_real_oom_mid_ring_is_recorded_by_a_sweep_and_the_next_strategy_runs(tmp_path):
    """Rank 1 raises OOM at its third call while rank 0 waits in the ring: the NCCL watchdog
    (=1) ends the launch after the case's collective timeout; the sweep records the case OOM
    with rank 1's message and runs zigzag in its own launch."""
    out = tmp_path / "r.jsonl"
    done = run([sys.executable, str(FAULTS), "sweep", "--nodes", "1", "--gpus-per-node", "2",
                "--entry", str(FAULTS), "--run", "--strategy", "test-oom-in-ring,zigzag",
                "--seqlen", "16k", "--collective-timeout", "60", "--out", str(out)])
    records = results.read(out)
    assert [(r["config"]["strategy"], r["status"]) for r in records] == [
        ("test-oom-in-ring", "OOM"), ("zigzag", "ok")], done.stdout
    assert records[0]["error"].startswith("rank 1: OutOfMemoryError: CUDA out of memory "
                                          "(injected on rank 1, call 3)")
    assert "cpbench: rank 1 failed (OOM)" in open(records[0]["sweep"]["log"]).read()


def test_flash_attn_on_odd_shapes_every_strategy(tmp_path):
    """5 heads, S = 200 on 2 GPUs (zigzag halves of 50 rows), bf16: no "misaligned address",
    every check passes; the kernel's package is in the record."""
    out = tmp_path / "r.jsonl"
    done = torchrun("-m", "cpbench.run", "--strategy", "all", "--heads", "5", "--seqlen",
                    "200", "--head-dim", "64", "--check", "--warmup", "1", "--iters", "2",
                    "--out", out)
    assert "misaligned" not in done.stdout
    records = results.read(out)
    assert records and all(r["status"] == "ok" for r in records), done.stdout
    assert all(r["derived"]["check_passed"] for r in records)
    assert records[0]["env"]["kernel_package"]["version"]


def test_doctor_runs_the_kernels_and_probes_nccl_between_two_gpus():
    done = cpbench("doctor", timeout=300)
    assert done.returncode == 0, done.stdout
    assert "nccl on cuda" in done.stdout
    kernel_lines = [line for line in done.stdout.splitlines() if "  kernel " in line]
    assert any("ran a forward and backward on cuda" in line for line in kernel_lines), \
        done.stdout
