"""The CPU memory meter counts live tensor storage at its peak; the estimates are bounds."""

import pytest
import torch

from cpbench.bench import memory
from cpbench.kernels import sdpa_cpu

MIB = 2 ** 20


def test_peak_of_live_storage():
    def step():
        a = torch.empty(MIB, dtype=torch.uint8)
        b = torch.empty(2 * MIB, dtype=torch.uint8)
        del a, b  # peak so far: 3 MiB
        c = torch.empty(MIB, dtype=torch.uint8)
        return c

    assert memory.peak_bytes(step, device="cpu") == 3 * MIB


def test_freed_storage_is_uncounted():
    def step():
        for _ in range(5):  # the old x is freed once the new one is assigned: 2 MiB at most
            x = torch.zeros(MIB, dtype=torch.uint8)
        return x

    assert memory.peak_bytes(step, device="cpu") == 2 * MIB


def test_views_share_storage_and_used_storage_counts():
    x = torch.zeros(MIB // 4)  # 1 MiB of fp32, alive before the step

    def step():
        y = x.view(16, -1).t()  # a view: no new storage, but x's is in use
        return y.contiguous()  # a copy: 1 MiB

    assert memory.peak_bytes(step, device="cpu") == 2 * MIB
    # inputs are counted from the start, once however many views of them are given
    assert memory.peak_bytes(lambda: None, device="cpu", inputs=[x, x[:10], x.t()]) == MIB


def test_a_wrapper_subclass_counts_its_inner_tensor_once():
    # functional collectives hand out AsyncCollectiveTensor wrappers, whose own storage has the
    # full size but no data (torch-ring's gathered K/V were counted twice in `cpbench run`)
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    def step():
        inner = torch.zeros(MIB, dtype=torch.uint8)
        return AsyncCollectiveTensor(inner) + 1  # the op sees the wrapper; + 1 MiB result

    assert memory.peak_bytes(step, device="cpu") == 2 * MIB


def test_backward_through_an_autograd_function_is_seen():
    q = torch.randn(1, 256, 2, 16, requires_grad=True)

    class Attn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q):
            out, lse = sdpa_cpu.forward(q, q, q, causal=True, softmax_scale=0.25)
            ctx.save_for_backward(q, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, out, lse = ctx.saved_tensors
            dq, dk, dv = sdpa_cpu.backward(dout, q, q, q, out, lse, causal=True,
                                           softmax_scale=0.25)
            return dq + dk + dv

    def fwd():
        Attn.apply(q)

    def fwd_bwd():
        out = Attn.apply(q)
        out.backward(torch.ones_like(out))

    tensor = q.numel() * 4
    fwd_peak = memory.peak_bytes(fwd, device="cpu")
    both_peak = memory.peak_bytes(fwd_bwd, device="cpu")
    assert fwd_peak >= tensor  # at least the output
    assert both_peak >= fwd_peak + 2 * tensor  # dout, dq, dk, dv alongside out


def test_lower_bound_formula():
    # q, out, dout, dq at 40 heads and k, v, dk, dv at 8 heads; 16384 tokens, D 128, bf16
    n = memory.step_lower_bound(batch=1, local_seqlen=16384, heads=40, kv_heads=8,
                                head_dim=128, element_size=2)
    assert n == 16384 * 128 * 2 * (4 * 40 + 4 * 8)
    per_rank, ref = memory.check_bytes(batch=1, seqlen=1024, heads=8, kv_heads=8, head_dim=32,
                                       element_size=4)
    assert per_rank == 1024 * 32 * 4 * 32 and ref == 5 * 1024 * 1024 * 8


def test_meminfo_read_once_for_both_users():
    from cpbench.bench import env

    total, available = env.meminfo_bytes("MemTotal"), env.meminfo_bytes("MemAvailable")
    if total is None:
        pytest.skip("no /proc/meminfo")
    assert 0 < available <= total
    assert env.meminfo_bytes("NoSuchField") is None
