"""Masked blocks (documents, a window) on CUDA without a GPU: fake CUDA tensors (FakeTensorMode)
through a strategy's masked forward and backward and flash-attn 2's real varlen functions
(their registered fake implementations). Checks that every call accepts its inputs (devices,
dtypes, shapes: a CPU index into a CUDA tensor's ``index_add_`` fails here as on a GPU, the
defect of issue #23) and what comes back; not the numbers (tests/unit/test_masked_varlen.py).
Needs a CUDA build of torch and flash-attn's Python files; self-contained otherwise."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from optional_libs import require

if not torch.version.cuda:
    pytest.skip("needs a CUDA build of torch (fake CUDA tensors)", allow_module_level=True)

require("flash-attn")
# flash-attn's Python files import its CUDA extension; its fake implementations need none
sys.modules.setdefault("flash_attn_2_cuda", types.ModuleType("flash_attn_2_cuda"))
pytest.importorskip("flash_attn.flash_attn_interface")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from cpbench import strategies  # noqa: E402
from cpbench.config import AttentionConfig  # noqa: E402
from cpbench.kernels.flash_attn import FLASH_ATTN  # noqa: E402
from cpbench.topology import Topology  # noqa: E402

MASKS = [dict(documents=(1024, 512, 512, 2048)), dict(window_size=(300, 0)),
         dict(documents=(1536, 2560), window_size=(700, 0)),
         dict(causal=False, documents=(3000, 1096), window_size=(200, -1))]


def _strategy(name: str, **mask):
    attn = AttentionConfig(seqlen=4096, heads=8, kv_heads=2, head_dim=64, dtype="bf16",
                           **mask)
    cls = strategies.get(name)
    return cls(attn, Topology(world_size=4, ranks_per_node=4), 1, kernel=FLASH_ATTN,
               create_groups=False)


@pytest.mark.parametrize("mask", MASKS, ids=["documents", "window", "both", "full-window"])
@pytest.mark.parametrize("name", ["llama3", "zigzag"])
def test_masked_forward_and_backward_on_cuda(name, mask):
    strat = _strategy(name, **mask)
    s = strat.local_seqlen
    # the plan is made before the fake mode (real positions), as a GPU run makes it on the
    # host; the queries against the whole sequence (llama3's gathered keys)
    every = torch.arange(4096)
    tiles = strat.tiles("fake", strat.seq_index(strat.rank), every)
    assert tiles
    getattr(tiles, "varlen", None)  # plan the GPU path now (a list of CPU tiles before #23)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, dout = (torch.randn(2, s, 8, 64, dtype=torch.bfloat16, device="cuda")
                   for _ in range(2))
        k, v = (torch.randn(2, 4096, 2, 64, dtype=torch.bfloat16, device="cuda")
                for _ in range(2))
        out, lse = strat.masked_forward(q, k, v, tiles)
        dq, dk, dv = strat.masked_backward(dout, q, k, v, out.to(q.dtype), lse, tiles)
    assert out.shape == q.shape and lse.shape == (2, 8, s)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    for t in (out, lse, dq, dk, dv):
        assert t.device.type == "cuda" and t.dtype == torch.float32


def test_flash_attn_varlen_contract_on_fake_cuda():
    """The kernel contract's varlen calls through flash-attn 2.8.3's real functions."""
    with FakeTensorMode():
        q = torch.randn(300, 8, 64, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.randn(200, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in "kv")
        cu_q = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 120, 200], dtype=torch.int32, device="cuda")
        out, lse = FLASH_ATTN.varlen_forward(q, k, v, cu_q, cu_k, 200, 200, causal=True,
                                             softmax_scale=0.125, window=(64, 0))
        dq, dk, dv = FLASH_ATTN.varlen_backward(out, q, k, v, out, lse, cu_q, cu_k, 200, 200,
                                                causal=True, softmax_scale=0.125,
                                                window=(64, 0))
    assert out.shape == q.shape and lse.shape == (8, 300) and lse.dtype == torch.float32
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
