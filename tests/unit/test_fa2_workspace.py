"""FlashAttention-2's backward buffers (``kernels.fa2_workspace``), from flash-attn 2.8.3's
csrc/flash_attn/flash_api.cpp: the sizes, the roundings, the varlen and GQA forms."""

from __future__ import annotations

import pytest

from cpbench.kernels import fa2_workspace as ws

MIB = 2 ** 20


def test_the_issue_figure_16k_16_heads_128():
    """dq_accum fp32 (1, 16384, 16, 128) = 128 MiB and softmax_d fp32 (1, 16, 16384) = 1 MiB."""
    got = ws.backward_bytes(batch=1, seqlen_q=16384, seqlen_k=16384, heads=16, kv_heads=16,
                            head_dim=128, element_size=2)
    assert got == 129 * MIB
    assert ws.backward_bytes(batch=1, seqlen_q=16384, seqlen_k=16384, heads=16, kv_heads=16,
                             head_dim=128, element_size=2, softmax_d=False) == 128 * MIB


@pytest.mark.parametrize("d, rounded", [(64, 64), (72, 96), (128, 128), (136, 192),
                                        (160, 192), (256, 256)])
def test_head_dim_rounds_to_32_up_to_128_then_to_64(d, rounded):
    assert ws.head_dim_rounded(d) == rounded


def test_query_rows_round_up_to_128_per_batch_element():
    one = dict(seqlen_k=100, heads=2, kv_heads=2, head_dim=64, element_size=2)
    assert ws.backward_bytes(batch=3, seqlen_q=100, **one) == 3 * 128 * 2 * (64 + 1) * 4
    assert ws.backward_bytes(batch=1, seqlen_q=129, **one) == 256 * 2 * (64 + 1) * 4


def test_gqa_adds_dk_dv_expanded_to_every_query_head_in_the_activation_dtype():
    mha = ws.backward_bytes(batch=2, seqlen_q=256, seqlen_k=512, heads=8, kv_heads=8,
                            head_dim=64, element_size=2)
    gqa = ws.backward_bytes(batch=2, seqlen_q=256, seqlen_k=512, heads=8, kv_heads=2,
                            head_dim=64, element_size=2)
    assert gqa - mha == 2 * (2 * 512 * 8 * 64 * 2)


def test_varlen_rows_are_the_tokens_plus_128_per_sequence():
    got = ws.varlen_backward_bytes(total_q=1000, total_k=1000, sequences=3, heads=4,
                                   kv_heads=4, head_dim=128, element_size=2)
    assert got == (1000 + 3 * 128) * 4 * (128 + 1) * 4
