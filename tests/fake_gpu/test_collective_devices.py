"""Tensors handed to collectives on a group that may be NCCL's live on the group's device:
NCCL takes no CPU tensor ("No backend type associated with device type cpu"). The group here
is torch's fake one registered for CUDA only (``cuda:fake``), which refuses a CPU tensor the
same way."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def nccl_like(fake_pg, monkeypatch):
    # torch's broadcast asks the device's capability (fp8 on sm90): no driver is here to say
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    fake_pg(0, 2, backend="cuda:fake")


def test_the_group_refuses_a_cpu_tensor(nccl_like):
    """The control: the failure the calibration's verdict had."""
    import torch.distributed as dist

    with pytest.raises(RuntimeError, match="device type cpu"):
        dist.broadcast(torch.tensor([1.0]), 0)


def test_calibrate_verdict_is_broadcast_on_the_gpu(nccl_like, fake_cuda):
    from cpbench.sim.calibrate import verdict

    assert verdict(True, "cuda").device.type == "cuda"
