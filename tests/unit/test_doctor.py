"""``cpbench doctor`` without GPUs (what it says here) and on a mocked GPU node (the GPU
count against the ranks, capability, NCCL for the probe); the probe's launch is faked (the
real one is a multi-rank run)."""

from __future__ import annotations

import pytest
import torch

from cpbench import cli
from cpbench.cli import doctor

# doctor imports the adapters' libraries as they do (cpbench's CPU flash-attn interface as
# ``flash_attn``): gone again after each test
pytestmark = pytest.mark.usefixtures("own_modules")

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
    # every kernel line says whether a forward and backward ran, and where
    assert got["kernel sdpa-cpu"][0] == "ok"
    assert got["kernel sdpa-cpu"][1].startswith("ran a forward and backward on cpu")
    assert got["kernel flash-attn"][0] == "warn" and "not on cuda: " in got["kernel flash-attn"][1]
    assert got["kernel flash-attn"][1].startswith("no forward and backward run")
    kernel_lines = [v for k, v in got.items() if k.startswith("kernel ")]
    assert all("forward and backward" in detail for _, detail in kernel_lines)
    for lib in ("ring-flash-attn", "yunchang", "transformer-engine"):
        assert f"lib {lib}" in got
    assert got["nccl error handling"][0] == "ok"
    assert "unset: torchrun gives its workers 1" in got["nccl error handling"][1]
    assert "latency 55 us" in got["probe p2p"][1] and "gloo on cpu" in got["probe p2p"][1]
    assert "bus bandwidth 0.50 GB/s" in got["probe a2a"][1]
    assert probe_calls[0][1] == ("cpu",) and probe_calls[0][2]["backend"] == "gloo"


def _gpu_node(monkeypatch, count: int, capability: tuple[int, int], name: str) -> None:
    """A mocked CUDA node of ``count`` GPUs; it runs no kernel and imports no library (what
    they do is tested apart)."""
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: name)
    monkeypatch.setattr(doctor, "versions", lambda: iter([]))
    monkeypatch.setattr(doctor, "_smoke", lambda backend, device, dead: None)
    monkeypatch.setattr(doctor, "upstream_checks", lambda device: iter([]))


def test_a_gpu_node_with_more_ranks_than_gpus_is_an_error(probe_calls, capsys, monkeypatch):
    _gpu_node(monkeypatch, 4, (8, 0), "NVIDIA A100-SXM4-80GB")
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


@pytest.mark.parametrize("fa3_installed", [False, True])
def test_an_sm90_gpu_says_fa3_can_run_only_where_it_imports(probe_calls, capsys, monkeypatch,
                                                             fa3_installed):
    _gpu_node(monkeypatch, 1, (9, 0), "NVIDIA H100 80GB HBM3")
    if fa3_installed:  # here it is not: the real check below finds no module
        monkeypatch.setattr(doctor, "_fa3_import_error", lambda: None)
    cli.main(["doctor", "--no-probe"])
    gpu = _lines(capsys)["gpu 0"][1]
    if fa3_installed:
        assert gpu.endswith("sm90 (FlashAttention-3 can run)")
    else:  # here: no flash_attn_interface module
        assert "FlashAttention-3 can run" not in gpu
        assert "does not import here: No module named" in gpu and "flash_attn_interface" in gpu


def test_a_kernel_that_claims_a_device_and_fails_there_is_an_error(probe_calls, capsys,
                                                                   monkeypatch):
    """As a flash-attn wheel built without this GPU's architecture: it imports, says it
    supports the request, and its kernel raises on first use."""
    import dataclasses

    from cpbench import kernels

    def no_image(*args, **kw):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the "
                           "device")

    broken = dataclasses.replace(kernels.get("sdpa-cpu"), forward=no_image)
    monkeypatch.setitem(kernels._BACKENDS, "sdpa-cpu", broken)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["doctor", "--no-probe"]) == 1
    level, detail = _lines(capsys)["kernel sdpa-cpu"]
    assert level == "error" and detail.startswith("no forward and backward run")
    assert "fails on cpu: RuntimeError: CUDA error: no kernel image is available" in detail


def test_a_kernel_with_a_wrong_result_is_an_error(monkeypatch):
    import dataclasses

    from cpbench import kernels
    from cpbench.bench.preflight import kernel_smoke

    good = kernels.get("sdpa-cpu")

    def off(q, k, v, **kw):
        out, lse = good.forward(q, k, v, **kw)
        return out + 0.1, lse

    with pytest.raises(RuntimeError, match="wrong result: out max"):
        kernel_smoke(dataclasses.replace(good, forward=off), "cpu")

    def off_grads(*args, **kw):  # the backward is held to the float64 reference too
        dq, dk, dv = good.backward(*args, **kw)
        return dq, dk * 1.01, dv

    with pytest.raises(RuntimeError, match=r"wrong result: dk max .* as --check\)"):
        kernel_smoke(dataclasses.replace(good, backward=off_grads), "cpu")
    assert kernel_smoke(good, "cpu").startswith("ran a forward and backward (128 tokens")


@pytest.mark.parametrize("value, level, says", [
    ("1", "ok", "aborts the communicators and ends the process"),
    ("3", "ok", "without aborting the communicators"),
    ("2", "warn", "process lives on"),
    ("0", "warn", "until the job's time limit"),
    ("7", "warn", "not a value torch knows"),
])
def test_error_handling_advice(value, level, says):
    got = doctor.error_handling({"TORCH_NCCL_ASYNC_ERROR_HANDLING": value})
    assert got[0] == level and says in got[2]


def test_nodes_that_cannot_reach_each_other_get_the_network_advice(probe_calls, capsys,
                                                                   monkeypatch):
    from cpbench.cli import doctor_nodes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(doctor_nodes, "probe",
                        lambda where, device: ("error", "DistNetworkError: timed out"))
    for k, v in {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_JOB_ID": "5",
                 "SLURM_JOB_NODELIST": "n[1-2]"}.items():
        monkeypatch.setenv(k, v)
    assert doctor_nodes.srun_world()[:3] == (0, 2, "n1")
    assert cli.main(["doctor", "--no-probe"]) == 1
    level, detail = _lines(capsys)["nodes"]
    assert level == "error" and "DistNetworkError: timed out" in detail
    assert "NCCL_SOCKET_IFNAME" in detail and "NCCL_IB_HCA" in detail


def test_after_a_sticky_error_later_kernels_on_the_device_are_not_blamed(probe_calls, capsys,
                                                                        monkeypatch):
    import dataclasses

    from cpbench import kernels

    def dead(*args, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setitem(kernels._BACKENDS, "torch",
                        dataclasses.replace(kernels.get("torch"), forward=dead))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["doctor", "--no-probe"]) == 1
    got = _lines(capsys)
    assert got["kernel torch"][0] == "error" and "illegal memory access" in got["kernel torch"][1]
    assert "not run on cpu: an earlier kernel left its CUDA context unusable" in \
        got["kernel sdpa-cpu"][1]


def test_an_upstream_library_refused_here_is_a_warning_and_a_broken_one_an_error(monkeypatch):
    """A refusal (a flash-attn installed on a machine with no GPU: the libraries cannot run
    here) is what the machine lacks, a warning; any other exception is a broken install."""
    from cpbench.bench import preflight
    from cpbench.errors import UsageError

    monkeypatch.setattr(preflight, "installed", lambda package: True)

    def refused(package, classes, device):
        raise UsageError("a flash-attn is installed here, and it does not run on CPU")

    monkeypatch.setattr(preflight, "upstream_import", refused)
    levels = {what: (level, detail) for level, what, detail in doctor.upstream_checks("cpu")}
    level, detail = levels["lib ring-flash-attn"]
    assert level == "warn" and "cannot run on cpu here: a flash-attn is installed" in detail

    def broken(package, classes, device):
        raise ImportError("undefined symbol: _ZN3c10")

    monkeypatch.setattr(preflight, "upstream_import", broken)
    levels = {what: (level, detail) for level, what, detail in doctor.upstream_checks("cpu")}
    assert levels["lib ring-flash-attn"][0] == "error"
