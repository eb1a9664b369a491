"""How a rank's own failure leaves it (one process, a 1-rank gloo group): it says so on stderr
before any wait; a sticky CUDA error breaks the phase with no collective attempted; and which
broken groups the driver forms again in-process (gloo only) or stops on."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from cpbench import results
from cpbench.bench import agreement, recovery
from cpbench.bench import plan as planning
from cpbench.config import RunConfig
from cpbench.launch import free_port


@pytest.fixture
def one_rank():
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True,
                          timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        yield store
    finally:
        dist.destroy_process_group()


def _raise(e):
    def fn():
        raise e
    return fn


def test_an_oom_is_said_on_stderr_before_the_agreement(one_rank, capsys, monkeypatch):
    said = []
    real = dist.all_reduce

    def all_reduce(*args, **kw):  # what stderr held when the rank came to agree
        said.append(capsys.readouterr().err)
        return real(*args, **kw)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    phase = agreement.Agreement("cpu", one_rank, "1", None, ("zigzag", "KEY"))
    phase(_raise(torch.OutOfMemoryError("CUDA out of memory (test)")))
    assert said == ["cpbench: rank 0 failed (OOM) in zigzag: OutOfMemoryError: CUDA out of "
                    "memory (test)\n"]
    assert phase.status == results.OOM and not phase.broken


def test_a_sticky_cuda_error_breaks_the_phase_without_a_collective(one_rank, monkeypatch):
    def no_collective(*args, **kw):
        raise AssertionError("a collective on a dead context")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    monkeypatch.setattr(dist, "all_gather_object", no_collective)
    phase = agreement.Agreement("cpu", one_rank, "1", None, ("ring", "KEY"))
    phase(_raise(RuntimeError("CUDA error: an illegal memory access was encountered")))
    assert phase.broken and phase.sticky and phase.status == results.FAILED
    assert phase.error == ("rank 0: RuntimeError: CUDA error: an illegal memory access was "
                           "encountered")
    assert phase(lambda: 1) is None  # nothing more runs in the case


def test_only_a_gloo_group_is_formed_again_in_process():
    p = planning.plan(RunConfig(strategy=("ring",), nproc=2, out="none"),
                      {"seqlen": 256, "heads": 2, "head_dim": 16}, {}, launcher="self")
    cuda = dataclasses.replace(p, run=dataclasses.replace(p.run, device="cuda"))
    assert recovery.reformable(p, "group")
    assert not recovery.reformable(p, "device")
    assert not recovery.reformable(cuda, "group")
    assert "NCCL" in recovery.stop_reason(cuda, "group")
    assert "sticky CUDA error" in recovery.stop_reason(p, "device")
