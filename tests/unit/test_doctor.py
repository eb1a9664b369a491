"""``cpbench doctor`` without GPUs (what it says here) and on a mocked GPU node (the GPU
count against the ranks, capability, NCCL for the probe); the probe's launch is faked (the
real one is a multi-rank run)."""

from __future__ import annotations

import pytest
import torch

from cpbench import cli
from cpbench.cli import doctor

FIGURES = {"ranks": 2, "small_bytes": 4096, "large_bytes": 4 * 2 ** 20,
           "p2p_latency_us": 55.0, "p2p_gb_s": 1.25, "a2a_gb_s": 0.5}


@pytest.fixture
def probe_calls(monkeypatch):
    import cpbench.launch

    calls = []

    def run_ranks(fn, n, *args, **kw):
        calls.append((n, args, kw))
        return [FIGURES] * n

    monkeypatch.setattr(cpbench.launch, "run_ranks", run_ranks)
    for var in ("LOCAL_WORLD_SIZE", "CPBENCH_GPUS_PER_NODE", "SLURM_GPUS_ON_NODE",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.delenv(var, raising=False)
    return calls


def _lines(capsys) -> dict[str, tuple[str, str]]:
    out = capsys.readouterr().out
    # fixed columns: level (5), two spaces, what (22), a space, detail
    return {line[7:29].strip(): (line[:5].strip(), line[30:]) for line in out.splitlines()}


def test_here_without_gpus_exits_0_and_says_why(probe_calls, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as here, anywhere
    assert cli.main(["doctor"]) == 0
    got = _lines(capsys)
    assert got["torch"][1].startswith(f"torch {torch.__version__}")
    assert got["cores"][0] == "ok" and "usable" in got["cores"][1]
    assert got["gpus"][0] == "warn" and got["gpus"][1].startswith("none")
    assert got["kernel sdpa-cpu"] == ("ok", "runs on cpu")
    assert got["kernel flash-attn"][0] == "warn" and "not on cuda: " in got["kernel flash-attn"][1]
    assert "latency 55 us" in got["probe p2p"][1] and "gloo on cpu" in got["probe p2p"][1]
    assert "bus bandwidth 0.50 GB/s" in got["probe a2a"][1]
    assert probe_calls[0][1] == ("cpu",) and probe_calls[0][2]["backend"] == "gloo"


def test_a_gpu_node_with_more_ranks_than_gpus_is_an_error(probe_calls, capsys, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(doctor, "versions", lambda: iter([]))
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "error  gpus                   4 visible for 8 rank(s) per node" in out
    assert "sm80 (FlashAttention-3 needs sm90" in out
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in out
    # no flash-attn installed here, but a CUDA torch has its own flash kernel: auto runs sdpa
    assert "error  kernel auto" not in out and "kernel sdpa" in out
    n, args, kw = probe_calls[0]
    assert (n, args, kw["backend"]) == (4, ("cuda",), "nccl")
