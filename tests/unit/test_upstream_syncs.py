"""The adapters' timed call reads nothing back to the host: what the library's varlen function
takes beside q, k, v (cu_seqlens, max lengths, llama3's prepared slices) is built once per case,
on the run's device, not per call (a ``.item()`` per call is a host sync in the timed step,
and under fake tensors, as the dry run uses, it raises)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tests.unit.schedule_helpers import plan
from torch.utils._python_dispatch import TorchDispatchMode

A = torch.ops.aten


class _NoHostSync(TorchDispatchMode):
    """Fails on a tensor value read back to Python (item, int(), bool()) and on a tensor built
    from Python data (torch.tensor), the per-call work that was moved to construction."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (A._local_scalar_dense.default, A.lift_fresh.default):
            raise AssertionError(f"{func} in the timed call")
        return func(*args, **(kwargs or {}))


def _called(strat):
    calls = []
    strat.fn = lambda *a, **kw: (calls.append((a, kw)) or
                                 (a[0], torch.zeros(a[0].shape[1], a[0].shape[0]), None))
    strat.groups = {"rfa": SimpleNamespace(pg=None)}
    return calls


DOCS = dict(seqlen=96, documents=(32, 16, 48), batch=1)


@pytest.fixture
def cpu_flash_attn():
    """ring-flash-attn importable on CPU (cpbench's interface as flash_attn, as an adapter
    installs it in its ranks), this process's modules restored after."""
    import importlib.util
    import sys

    from cpbench.kernels import flash_attn_cpu

    if importlib.util.find_spec("ring_flash_attn") is None:
        pytest.skip("ring-flash-attn is not installed")
    before = set(sys.modules)
    if not flash_attn_cpu.install():
        pytest.skip("a real flash-attn is installed here")
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("flash_attn", "flash_attn_interface", "ring_flash_attn"):
            del sys.modules[name]


@pytest.mark.parametrize("name", ["rfa-zigzag", "rfa-ring", "rfa-llama3"])
def test_the_varlen_call_does_no_host_sync(name, cpu_flash_attn):
    from tests.unit.schedule_helpers import attn

    strat = plan(name, 2, 2, rank=1, problem=attn(**DOCS), kernel="sdpa-cpu")
    assert strat.varlen_args is None  # planned only: nothing built
    strat.prepare()
    strat.on_device(torch.device("cpu"))  # the warm-up call's move, outside the guard
    calls = _called(strat)
    q = torch.randn(1, 48, 4, 16, dtype=torch.bfloat16)
    with _NoHostSync():
        out, lse = strat.attention(q, q[:, :, :2], q[:, :, :2])
    assert out.shape == q.shape and lse.shape == (1, 4, 48)
    args = calls[0][0]
    if name == "rfa-llama3":  # rank 1 holds tokens 48..95: the third document
        assert args[3].tolist() == [0, 48] and args[5] == 48 and args[8] == slice(48, 96)
    else:  # every document's half is here
        assert args[3].tolist() == [0, 16, 24, 48] and args[4] == 24


def test_the_old_per_call_computation_is_caught():
    """The guard itself: what rfa's varlen call did per call raises under it."""
    cu = torch.tensor([0, 16, 24, 48], dtype=torch.int32)
    with _NoHostSync(), pytest.raises(AssertionError, match="_local_scalar_dense"):
        int((cu[1:] - cu[:-1]).max())
