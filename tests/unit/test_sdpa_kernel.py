"""The ``sdpa`` backend (torch's CUDA flash kernel) and the argument mapping torch-ring's
backward uses, against the real aten schemas (present in the CPU build too; no GPU here)."""

from __future__ import annotations

import pytest
import torch

from cpbench import kernels
from cpbench.kernels import base, sdpa
from cpbench.strategies.torch_ring import _ops

A = torch.ops.aten
RING_GIVES = {"grad_out", "query", "key", "value", "out", "logsumexp", "is_causal",
              "dropout_p", "scale"}  # what torch-ring's backward passes itself


def _required(op) -> set[str]:
    return {a.name for a in op._schema.arguments if not a.has_default_value()}


def test_cuda_backward_gets_every_required_argument_from_the_forward():
    """The old torch-ring passed none of these: the op has no defaults for them."""
    fwd, bwd = _ops("cuda")
    rest = [object() for _ in fwd._schema.returns[2:]]  # stand-ins, by position
    extras = sdpa.backward_extras(fwd, bwd, rest)
    assert set(extras) == {"cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed",
                           "philox_offset"}
    assert _required(bwd) <= RING_GIVES | set(extras)
    names = [r.name for r in fwd._schema.returns]
    assert extras["philox_seed"] is rest[names.index("rng_state") - 2]
    assert extras["philox_offset"] is rest[names.index("unused") - 2]
    assert extras["max_q"] is rest[names.index("max_q") - 2]


def test_cpu_backward_takes_nothing_from_the_forward():
    fwd, bwd = _ops("cpu")
    assert sdpa.backward_extras(fwd, bwd, []) == {}
    assert _required(bwd) <= RING_GIVES


def test_a_backward_needing_more_than_the_forward_returns_is_an_error():
    with pytest.raises(TypeError, match="cum_seq_q"):
        sdpa.backward_extras(A._scaled_dot_product_flash_attention_for_cpu.default,
                             A._scaled_dot_product_flash_attention_backward.default, [])


def _positional_and_keywords(op):
    args = op._schema.arguments
    return [a.name for a in args if not a.kwarg_only], {a.name for a in args if a.kwarg_only}


def test_the_backend_calls_match_the_op_schemas():
    """sdpa.py calls the ops positionally up to the keyword-only part: the positions it fills
    must be the schema's, and its keywords must exist (torch 2.13 and 2.14 agree)."""
    pos, kw = _positional_and_keywords(A._scaled_dot_product_flash_attention_backward.default)
    assert pos == ["grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q",
                   "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "philox_seed",
                   "philox_offset"] and "scale" in kw
    pos, kw = _positional_and_keywords(A._flash_attention_forward.default)
    assert pos == ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
                   "dropout_p", "is_causal", "return_debug_mask"]
    assert {"scale", "window_size_left", "window_size_right"} <= kw
    pos, kw = _positional_and_keywords(A._flash_attention_backward.default)
    assert pos == ["grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q",
                   "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "rng_state",
                   "unused"]
    assert {"scale", "window_size_left", "window_size_right"} <= kw
    pos, _ = _positional_and_keywords(A._scaled_dot_product_flash_attention.default)
    assert pos[:5] == ["query", "key", "value", "dropout_p", "is_causal"]
    returns = [r.name for r in A._scaled_dot_product_flash_attention.default._schema.returns]
    assert returns[:2] == ["output", "logsumexp"]


def test_sdpa_backend_declarations():
    b = kernels.get("sdpa")
    assert b.devices == {"cuda"} and torch.float32 not in b.dtypes
    assert not b.causal_unequal and b.gqa  # FlashAttention-2 inside: bottom-right
    assert b.varlen_forward is not None and b.varlen_backward is not None
    assert b.provenance()["distribution"] == "torch"
    assert sdpa.limits_for((7, 5)) and "sm80" in sdpa.limits_for((7, 5))
    assert sdpa.limits_for((9, 0)) is None and sdpa.limits_for(None) is None


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build has the kernel")
def test_sdpa_on_a_cpu_build_says_why_not():
    why = kernels.get("sdpa").unsupported_reason(device="cuda", dtype=torch.bfloat16,
                                                 head_dim=64, heads=8, kv_heads=8)
    assert "without CUDA" in why


def _recording_ops(monkeypatch) -> list:
    """sdpa's aten ops replaced by recorders returning empty results of the right shapes:
    what each call was handed, as (op, tensors) (real CPU tensors: real addresses)."""
    calls: list = []

    def op(name):
        def call(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
            calls.append((name, tensors))
            if "backward" in name:
                return tuple(torch.empty_like(t) for t in tensors[1:4])
            q = tensors[0]
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32)  # any shape: not read
            return torch.empty_like(q), lse
        return call

    monkeypatch.setattr(sdpa, "_op", op)
    return calls


def _awkward(shape):
    """(a view 8 bytes past an aligned base, one with a last stride of 2, one fine)."""
    n = 1
    for x in shape:
        n *= x
    off = torch.randn(4 + n).to(torch.bfloat16)[4:].view(shape)
    strided = torch.randn(*shape, 2).to(torch.bfloat16)[..., 0]
    fine = torch.randn(shape).to(torch.bfloat16)
    assert off.data_ptr() % base.ALIGN_BYTES == 8 and strided.stride(-1) == 2
    return off, strided, fine


def test_every_tensor_reaches_the_op_aligned_with_a_unit_last_stride(monkeypatch):
    """As flash-attn's wrapper does (torch's op refuses a non-unit last stride; an unaligned
    base is a "misaligned address" no later CUDA call survives): copied only then."""
    calls = _recording_ops(monkeypatch)
    b = kernels.get("sdpa")
    q, k, v = _awkward((2, 16, 4, 8))
    lse = torch.zeros(2, 4, 32)[:, :, 16:]  # a half of the lse: strided
    b.forward(q, k, v, causal=True, softmax_scale=0.3)
    b.backward(q, q, k, v, k, lse, causal=True, softmax_scale=0.3)
    flat = (t.flatten(0, 1) for t in (q, k, v))
    qp, kp, vp = flat
    cu = torch.tensor([0, 16, 32], dtype=torch.int32)
    b.varlen_forward(qp, kp, vp, cu, cu, 16, 16, causal=True, softmax_scale=0.3)
    b.varlen_backward(qp, qp, kp, vp, kp, torch.zeros(4, 33)[:, 1:], cu, cu, 16, 16,
                      causal=True, softmax_scale=0.3)
    assert len(calls) == 4
    for name, tensors in calls:
        for t in tensors:
            assert t.stride(-1) == 1 and t.data_ptr() % base.ALIGN_BYTES == 0, name
    fwd_q, fwd_k, fwd_v = calls[0][1][:3]
    assert torch.equal(fwd_q.transpose(1, 2), q) and torch.equal(fwd_k.transpose(1, 2), k)
    assert fwd_v.data_ptr() == v.data_ptr()  # ready already: handed over as is
