"""torch-ring's CUDA path (torch's ring over aten._scaled_dot_product_flash_attention) on fake
CUDA tensors: forward then backward of its autograd Function, called directly (the autograd
engine does not run on fake CUDA), over torch's fake process group. Needs a CUDA build of
torch (no GPU): skipped elsewhere. The backward used to fail here: the forward's cum_seq_q,
cum_seq_k, max_q, max_k, philox_seed and philox_offset never reached it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch")


class _Ctx:
    """What the Function's forward and backward use of autograd's ctx."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):
        pass


@pytest.fixture
def fake_pg():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("causal,rotate", [(True, "allgather"), (True, "alltoall"),
                                           (False, "allgather")])
def test_forward_and_backward_run_on_cuda(fake_pg, causal, rotate):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cpbench.strategies.torch_ring import _TorchRing

    strat = SimpleNamespace(device="cuda", balanced=causal, groups={"cp": SimpleNamespace(
        pg=fake_pg)}, opts=SimpleNamespace(rotate_method=rotate),
        attn=SimpleNamespace(causal=causal, softmax_scale=0.125))
    with FakeTensorMode():
        q, k, v, dout = (torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))
        ctx = _Ctx()
        out, lse = _TorchRing.forward(ctx, strat, q, k, v)
        assert out.shape == q.shape and lse.shape == (1, 4, 256) and out.is_cuda
        ctx.strat = strat
        _, dq, dk, dv = _TorchRing.backward(ctx, dout, None)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
