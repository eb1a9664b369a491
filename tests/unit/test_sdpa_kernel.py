"""The ``sdpa`` backend (torch's CUDA flash kernel) and the argument mapping torch-ring's
backward uses, against the real aten schemas (present in the CPU build too; no GPU here)."""

from __future__ import annotations

import pytest
import torch

from cpbench import kernels
from cpbench.kernels import sdpa
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
