"""torch-ring: PyTorch's native context parallel, the templated ring attention that
``torch.distributed.tensor.experimental.context_parallel`` dispatches SDPA to, run as it is
(``_templated_ring_attention`` and its backward, torch 2.13's
``tensor/experimental/_context_parallel/_attention.py``).

What runs here: the high-level ``context_parallel()`` cannot run on CPU (its SDPA handler has
no sharding strategy for ``aten._scaled_dot_product_flash_attention_for_cpu``), so cpbench
calls the ring it dispatches to directly, with the SDPA flash op of the device: on CPU
``_scaled_dot_product_flash_attention_for_cpu`` (the ``sdpa-cpu`` kernel) forward and
backward; on CUDA ``_scaled_dot_product_flash_attention`` (the ``sdpa`` kernel; its backward
gets the forward's extra outputs, as torch's own SDPA handler passes them; run on fake CUDA
by tests/fake_gpu/test_torch_ring_cuda.py, never on a GPU here). Timed: that ring (K/V
rotation, the per-step ops, the lse merge, the dK/dV ring), not DTensor's dispatch.

Torch's own settings (``_cp_options``, a module global it reads in forward and backward, set
around each call): ``rotate_method`` (``allgather``, torch's default: K/V gathered once per
pass; ``alltoall``: passed on step by step) and the load balancer. Causal runs balanced:
torch's head-tail layout (``_HeadTailLoadBalancer``; chunks r and 2N-1-r, as zigzag);
full attention runs without it (torch refuses load balancing when not causal): contiguous.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

from cpbench import torchcompat
from cpbench.kernels.sdpa import backward_extras
from cpbench.strategies import register
from cpbench.strategies._upstream import check_kernel, device_of, no_schedule
from cpbench.strategies.base import Strategy, Upstream, option, save_for_backward
from cpbench.strategies.layout import check_divisible, contiguous_index

ROTATE = ("allgather", "alltoall")
_MODULE = f"{torchcompat.CP_PACKAGE}._attention"


def _ops(device: str):
    aten = torch.ops.aten
    if device == "cpu":
        return (aten._scaled_dot_product_flash_attention_for_cpu.default,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    return (aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_backward.default)


# ranks run as threads (--launcher threads) share torch's module global: it is set by the
# first rank in and restored by the last one out (every rank runs the same case, so the same
# values), never under another rank's feet
_CP_LOCK = threading.Lock()
_CP_USERS: list = [0, None]  # ranks inside, the values before the first came


@contextlib.contextmanager
def _cp_options(balanced: bool, rotate: str):
    """Torch's global CP options for one call, restored after."""
    import importlib

    cpa = importlib.import_module(_MODULE)
    o = cpa._cp_options
    with _CP_LOCK:
        if _CP_USERS[0] == 0:
            _CP_USERS[1] = (o.enable_load_balance, o.rotate_method)
        _CP_USERS[0] += 1
        o.enable_load_balance = balanced
        o.rotate_method = (cpa._RotateMethod.ALL_GATHER if rotate == "allgather"
                           else cpa._RotateMethod.ALL_TO_ALL)
    try:
        yield cpa
    finally:
        with _CP_LOCK:
            _CP_USERS[0] -= 1
            if _CP_USERS[0] == 0:
                o.enable_load_balance, o.rotate_method = _CP_USERS[1]


class _TorchRing(torch.autograd.Function):
    """(b, s, h, d) in and out; torch's ring works on (b, h, s, d) with the sequence dim 2."""

    @staticmethod
    def forward(ctx, strat, q, k, v):
        fwd, bwd = _ops(strat.device)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        with _cp_options(strat.balanced, strat.opts.rotate_method) as cpa:
            out, lse, *rest = cpa._templated_ring_attention(
                strat.groups["cp"].pg, 2, fwd, qh, kh, vh, is_causal=strat.attn.causal,
                dropout_p=0.0, scale=strat.attn.softmax_scale)
        save_for_backward(ctx, strat, qh, kh, vh, out, lse, lse=lse)
        ctx.extras = backward_extras(fwd, bwd, rest)
        return out.transpose(1, 2), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        strat = ctx.strat
        qh, kh, vh, out, lse = ctx.saved_tensors
        _, bwd = _ops(strat.device)
        with _cp_options(strat.balanced, strat.opts.rotate_method) as cpa:
            dq, dk, dv = cpa._templated_ring_attention_backward(
                strat.groups["cp"].pg, 2, bwd, grad_out=dout.transpose(1, 2),
                grad_out_name="grad_out", query=qh, key=kh, value=vh, out=out, logsumexp=lse,
                is_causal=strat.attn.causal, dropout_p=0.0, scale=strat.attn.softmax_scale,
                **ctx.extras)[:3]
        return None, dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


@register
class TorchRing(Strategy):
    name = "torch-ring"
    description = ("PyTorch native context parallel: its templated ring attention "
                   "(head-tail load balance when causal)")
    upstream = Upstream("torch", torchcompat.CP_PACKAGE, twin="zigzag",
                        torch_since=torchcompat.CP_SINCE)
    # the op it calls is these kernels; not flash-attn, which it never calls: a row recorded
    # as flash-attn would name a kernel that did not run (auto hands it sdpa on CUDA)
    accepted_kernels = {"cpu": ("sdpa-cpu",), "cuda": ("sdpa",)}
    # aten: "Q/K/V should have the same head size"
    no_v_head_dim = "its aten flash op takes one head dim"

    @dataclass(frozen=True, kw_only=True)
    class Options:
        rotate_method: str = option("allgather", "how torch moves K/V round the ring "
                                    "(its set_rotate_method)", ROTATE)

    def validate(self) -> None:
        check_kernel(self, "torch's SDPA flash op (on CUDA the sdpa kernel, on CPU sdpa-cpu)")
        self.device = device_of(self.kernel)
        self.balanced = self.attn.causal
        n = self.cp_size
        check_divisible(self.attn.seqlen, 2 * n if self.balanced else n,
                        f"{self.name} over {n} ranks" + (" (head-tail: 2 chunks per rank)"
                                                          if self.balanced else ""))

    def group_lists(self):
        return {"cp": self.cp_lists}

    def seq_index(self, rank: int) -> torch.Tensor:
        s, n, r = self.attn.seqlen, self.cp_size, self.cp_index(rank)
        if not self.balanced:
            return contiguous_index(s, n, r)
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
            _HeadTailLoadBalancer,
        )

        # torch's own balancer: the permutation it shards the sequence with, then Shard(seq)
        order = _HeadTailLoadBalancer(s, n, "cpu")._generate_indices(restore=False)
        return order[0].view(n, -1)[r].long()

    def attention(self, q, k, v, sinks=None):
        assert sinks is None, "a problem with sinks is refused on construction (takes_sinks)"
        return _TorchRing.apply(self, q, k, v)

    def resolved_options(self) -> dict:
        return {"rotate_method": self.opts.rotate_method,
                "load_balance": "head-tail" if self.balanced else "none"}

    def provenance(self) -> dict:
        return {**(super().provenance() or {}), "timed": "_templated_ring_attention (+ backward), "
                f"{'CPU' if self.device == 'cpu' else 'CUDA'} SDPA flash op"}

    def schedule(self):
        no_schedule(self)
