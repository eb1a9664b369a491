"""TransformerEngine strategies: their arguments against TE's real signatures, every 2.x release
(read from NVIDIA/TransformerEngine tags; TE cannot be installed here), the groups and the
layout. Nothing here imports TE or touches CUDA."""

from __future__ import annotations

import inspect

import pytest
import torch

from cpbench import kernels, strategies
from cpbench.config import AttentionConfig
from cpbench.errors import Skipped, UsageError
from cpbench.mask import mask_of
from cpbench.strategies import te
from cpbench.strategies.layout import zigzag_index
from cpbench.topology import Topology

# Parameter names in order (``self`` dropped), a trailing "=" marking a default; where:
# v2.0-v2.2.x transformer_engine/pytorch/attention.py, v2.3+
# transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py.
INIT_PARAMS = {
    # v2.0 (e5cc6c29, attention.py L6746) ... v2.7 (fedd9ddc, L206): identical
    "2.0": "num_attention_heads, kv_channels, num_gqa_groups=, attention_dropout=, qkv_format=, "
           "attn_mask_type=, window_size=, sequence_parallel=, tp_size=, get_rng_state_tracker=, "
           "tp_group=, layer_number=, attention_type=, cp_group=, cp_global_ranks=, cp_stream=, "
           "cp_comm_type=, softmax_scale=",
    # v2.8 (40c69e75, L293): + softmax_type
    "2.8": "num_attention_heads, kv_channels, num_gqa_groups=, attention_dropout=, qkv_format=, "
           "attn_mask_type=, window_size=, sequence_parallel=, tp_size=, get_rng_state_tracker=, "
           "tp_group=, layer_number=, attention_type=, cp_group=, cp_global_ranks=, cp_stream=, "
           "cp_comm_type=, softmax_scale=, softmax_type=",
    # v2.9 (70f53666, L299) ... v2.11: + return_max_logit
    "2.9": "num_attention_heads, kv_channels, num_gqa_groups=, attention_dropout=, qkv_format=, "
           "attn_mask_type=, window_size=, sequence_parallel=, tp_size=, get_rng_state_tracker=, "
           "tp_group=, layer_number=, attention_type=, cp_group=, cp_global_ranks=, cp_stream=, "
           "cp_comm_type=, softmax_scale=, softmax_type=, return_max_logit=",
    # v2.12 (5671fd36, L323) ... v2.15: bottom_right_diagonal INSERTED after window_size
    "2.12": "num_attention_heads, kv_channels, num_gqa_groups=, attention_dropout=, qkv_format=, "
            "attn_mask_type=, window_size=, bottom_right_diagonal=, sequence_parallel=, "
            "tp_size=, get_rng_state_tracker=, tp_group=, layer_number=, attention_type=, "
            "cp_group=, cp_global_ranks=, cp_stream=, cp_comm_type=, softmax_scale=, "
            "softmax_type=, return_max_logit=",
    # v2.16 (4220403e, L354) ... v2.18 (27486e03, L370-393): + name
    "2.16": "num_attention_heads, kv_channels, num_gqa_groups=, attention_dropout=, qkv_format=, "
            "attn_mask_type=, window_size=, bottom_right_diagonal=, sequence_parallel=, "
            "tp_size=, get_rng_state_tracker=, tp_group=, layer_number=, attention_type=, "
            "cp_group=, cp_global_ranks=, cp_stream=, cp_comm_type=, softmax_scale=, "
            "softmax_type=, return_max_logit=, name=",
}

# Unchanged across every 2.x tag (v2.18: L565-570). cp_group is a ProcessGroup for "p2p",
# "all_gather", "a2a"; a list [a2a_group, p2p_group] for "a2a+p2p".
SET_CP_PARAMS = {
    "2.0": "cp_group, cp_global_ranks, cp_stream, cp_comm_type=",
}

FORWARD_PARAMS = {
    # v2.0 (e5cc6c29, attention.py L6977), v2.1
    "2.0": "query_layer, key_layer, value_layer, attention_mask=, qkv_format=, cu_seqlens_q=, "
           "cu_seqlens_kv=, cu_seqlens_q_padded=, cu_seqlens_kv_padded=, max_seqlen_q=, "
           "max_seqlen_kv=, attn_mask_type=, window_size=, checkpoint_core_attention=, "
           "core_attention_bias_type=, core_attention_bias=, alibi_slopes=, fast_zero_fill=, "
           "inference_params=",
    # v2.2 (c55e425a, L5652) ... v2.7: + pad_between_seqs
    "2.2": "query_layer, key_layer, value_layer, attention_mask=, qkv_format=, cu_seqlens_q=, "
           "cu_seqlens_kv=, cu_seqlens_q_padded=, cu_seqlens_kv_padded=, max_seqlen_q=, "
           "max_seqlen_kv=, attn_mask_type=, window_size=, checkpoint_core_attention=, "
           "core_attention_bias_type=, core_attention_bias=, alibi_slopes=, fast_zero_fill=, "
           "inference_params=, pad_between_seqs=",
    # v2.8 (40c69e75, L766), v2.9: + fp8_output
    "2.8": "query_layer, key_layer, value_layer, attention_mask=, qkv_format=, cu_seqlens_q=, "
           "cu_seqlens_kv=, cu_seqlens_q_padded=, cu_seqlens_kv_padded=, max_seqlen_q=, "
           "max_seqlen_kv=, attn_mask_type=, window_size=, checkpoint_core_attention=, "
           "core_attention_bias_type=, core_attention_bias=, alibi_slopes=, fast_zero_fill=, "
           "inference_params=, pad_between_seqs=, fp8_output=",
    # v2.10 (769ed778, L799), v2.11: + num_splits
    "2.10": "query_layer, key_layer, value_layer, attention_mask=, qkv_format=, cu_seqlens_q=, "
            "cu_seqlens_kv=, cu_seqlens_q_padded=, cu_seqlens_kv_padded=, max_seqlen_q=, "
            "max_seqlen_kv=, attn_mask_type=, window_size=, checkpoint_core_attention=, "
            "core_attention_bias_type=, core_attention_bias=, alibi_slopes=, fast_zero_fill=, "
            "inference_params=, pad_between_seqs=, fp8_output=, num_splits=",
    # v2.12 (5671fd36, L806) ... v2.16.x: bottom_right_diagonal INSERTED after window_size
    "2.12": "query_layer, key_layer, value_layer, attention_mask=, qkv_format=, cu_seqlens_q=, "
            "cu_seqlens_kv=, cu_seqlens_q_padded=, cu_seqlens_kv_padded=, max_seqlen_q=, "
            "max_seqlen_kv=, attn_mask_type=, window_size=, bottom_right_diagonal=, "
            "checkpoint_core_attention=, core_attention_bias_type=, core_attention_bias=, "
            "alibi_slopes=, fast_zero_fill=, inference_params=, pad_between_seqs=, "
            "fp8_output=, num_splits=",
    # v2.17 (2e559f06, L1009) ... v2.18 (27486e03, L989-1018): + score_mod* (cuDNN Flex API)
    "2.17": "query_layer, key_layer, value_layer, attention_mask=, qkv_format=, cu_seqlens_q=, "
            "cu_seqlens_kv=, cu_seqlens_q_padded=, cu_seqlens_kv_padded=, max_seqlen_q=, "
            "max_seqlen_kv=, attn_mask_type=, window_size=, bottom_right_diagonal=, "
            "checkpoint_core_attention=, core_attention_bias_type=, core_attention_bias=, "
            "alibi_slopes=, fast_zero_fill=, inference_params=, pad_between_seqs=, "
            "fp8_output=, num_splits=, score_mod=, score_mod_bprop=, score_mod_tensors=, "
            "score_mod_bprop_tensors=",
}



def _spec(spec: str) -> tuple[list[str], set[str]]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    return [n.rstrip("=") for n in names], {n for n in names if not n.endswith("=")}


def _bind(spec: str, kwargs: dict, extra: dict | None = None) -> None:
    """Bind what ``te.pick`` keeps of ``kwargs`` to a signature built from ``spec``."""
    params, required = _spec(spec)
    chosen = {**te.pick(kwargs, params, required - set(extra or {})), **(extra or {})}
    sig = inspect.Signature([inspect.Parameter(
        p, inspect.Parameter.POSITIONAL_OR_KEYWORD,
        default=inspect.Parameter.empty if p in required else None) for p in params])
    sig.bind(**chosen)  # raises on a name the version lacks or a required one missing


ATTN = AttentionConfig(batch=1, seqlen=4096, heads=8, kv_heads=2, head_dim=128, dtype="bf16")


@pytest.mark.parametrize("version", INIT_PARAMS)
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a", "a2a+p2p"])
def test_init_and_forward_bind_every_release(version, comm_type):
    init, forward = te.te_kwargs(ATTN, comm_type)
    _bind(INIT_PARAMS[version], init)
    assert init["num_gqa_groups"] == 2 and init["qkv_format"] == "bshd"
    assert init["attn_mask_type"] == "causal" and init["cp_comm_type"] == comm_type
    for spec in FORWARD_PARAMS.values():
        _bind(spec, forward, dict(query_layer=1, key_layer=2, value_layer=3))
    # bshd: TE takes the local lengths from the shapes (a global max_seqlen would be
    # multiplied by the CP size again)
    assert "max_seqlen_q" not in forward and "cu_seqlens_q" not in forward


def test_a_required_parameter_cpbench_cannot_fill_fails_loudly():
    with pytest.raises(TypeError, match="unsupported version"):
        te.pick({"a": 1}, ["a", "b"], required={"a", "b"}, what="DotProductAttention")


def test_set_context_parallel_group_signature_is_what_the_call_uses():
    params, required = _spec(SET_CP_PARAMS["2.0"])
    assert params == ["cp_group", "cp_global_ranks", "cp_stream", "cp_comm_type"]
    assert required == {"cp_group", "cp_global_ranks", "cp_stream"}


def _built(name, world=8, rpn=4, rank=0, attn=ATTN, **options):
    cls = strategies.get(name)
    return cls(attn, Topology(world_size=world, ranks_per_node=rpn), rank,
               kernel=kernels.get("sdpa-cpu"), options=cls.Options(**options),
               create_groups=False)


def test_a2a_p2p_groups_are_consecutive_blocks_and_strided_rings():
    st = _built("te-a2a+p2p")  # 2 nodes x 4: level 1 fills a node (heads 8, kv heads 2 -> 2)
    assert st.resolved_options() == {"a2a_degree": 2, "p2p_degree": 4}
    assert te.hierarchical_lists(list(range(8)), 2) == (
        [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]])
    assert st.groups["a2a"].ranks == (0, 1) and st.groups["p2p"].ranks == (0, 2, 4, 6)


@pytest.mark.parametrize("name", ["te-p2p", "te-a2a", "te-a2a+p2p", "te-all-gather"])
def test_layout_is_dual_chunk_swap_of_the_cp_rank(name):
    for rank in range(8):
        st = _built(name, rank=rank, attn=AttentionConfig(seqlen=4096, heads=8, dtype="bf16"))
        assert st.seq_index(rank).tolist() == zigzag_index(4096, 8, rank).tolist()


def test_what_te_refuses_is_refused_before_anything_runs():
    with pytest.raises(UsageError, match="bf16 / fp16"):
        strategies.get("te-p2p")(AttentionConfig(seqlen=64, dtype="fp32"),
                                 Topology(world_size=2, ranks_per_node=1), 0,
                                 kernel=kernels.get("sdpa-cpu"), create_groups=False)
    with pytest.raises(UsageError, match="kv heads 2 must divide by the all-to-all size 8"):
        _built("te-a2a")  # 8 ranks, 2 kv heads: TE does not replicate K/V heads
    assert strategies.get("te-p2p").unavailable("cpu").endswith("(this run is on cpu)")


# -- packed documents (qkv_format thd) and windows --------------------------------------------

DOCS = AttentionConfig(seqlen=64, heads=8, dtype="bf16", documents=(8, 24, 32))


def te_partitioned_indices(cu_seqlens: list[int], n: int, rank: int) -> list[int]:
    """TE's ``tex.thd_get_partitioned_indices``, transcribed from v2.18
    common/fused_attn/context_parallel.cu L83-113 (thd_partition_src_index + kernel)."""
    cu_s = [c // n for c in cu_seqlens]
    out = []
    for token in range(cu_seqlens[-1] // n):
        seq = max(i for i in range(len(cu_s) - 1) if cu_s[i] <= token)
        seq_len, index = cu_s[seq + 1] - cu_s[seq], token - cu_s[seq]
        offset = rank if index < seq_len // 2 else (n - 1) * 2 - rank
        out.append(index + cu_s[seq] * n + seq_len // 2 * offset)
    return out


@pytest.mark.parametrize("comm_type", ["p2p", "a2a", "all_gather"])
@pytest.mark.parametrize("causal, mask", [(True, "padding_causal"), (False, "padding")])
def test_documents_map_to_thd_with_global_cu_seqlens(comm_type, causal, mask):
    attn = AttentionConfig(batch=2, seqlen=64, heads=8, dtype="bf16", causal=causal,
                           documents=(8, 24, 32))
    init, forward = te.te_kwargs(attn, comm_type)
    assert init["qkv_format"] == forward["qkv_format"] == "thd"
    assert init["attn_mask_type"] == forward["attn_mask_type"] == mask
    cu = forward["cu_seqlens_q"]
    # global (whole documents, both rows), int32, padded = unpadded as one tensor
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 8, 32, 64, 72, 96, 128]
    assert all(forward[k] is cu for k in ("cu_seqlens_kv", "cu_seqlens_q_padded",
                                          "cu_seqlens_kv_padded"))
    assert forward["max_seqlen_q"] == forward["max_seqlen_kv"] == 32
    assert forward["pad_between_seqs"] is False
    for spec in FORWARD_PARAMS.values():
        _bind(spec, forward, dict(query_layer=1, key_layer=2, value_layer=3))


@pytest.mark.parametrize("docs, n", [((8, 24, 32), 2), ((16, 48), 4), ((64,), 8)])
@pytest.mark.parametrize("name", ["te-p2p", "te-a2a", "te-all-gather"])
def test_seq_index_is_tes_thd_partition_for_every_rank(docs, n, name):
    attn = AttentionConfig(batch=2, seqlen=64, heads=8, dtype="bf16", documents=docs)
    _, forward = te.te_kwargs(attn, "p2p")
    cu = forward["cu_seqlens_q"].tolist()  # both rows: t = 2 * 64
    for rank in range(n):
        st = _built(name, world=n, rpn=n, rank=rank, attn=attn)
        rows = [b * 64 + st.seq_index(rank) for b in range(2)]  # (b, s_local) flattened
        assert torch.cat(rows).tolist() == te_partitioned_indices(cu, n, rank)


def test_what_te_refuses_under_documents_and_windows_is_skipped_with_its_source_line():
    a2a_p2p = strategies.get("te-a2a+p2p")
    assert "L5021-5023" in a2a_p2p.unsupported_mask(mask_of(DOCS))
    with pytest.raises(Skipped, match="L5021-5023"):
        te.te_kwargs(DOCS, "a2a+p2p")
    with pytest.raises(Skipped, match="multiple of 4"):  # TE asserts it (.cu L102)
        _built("te-p2p", world=2, rpn=2,
               attn=AttentionConfig(seqlen=64, heads=8, dtype="bf16", documents=(10, 54)))
    window = AttentionConfig(seqlen=64, heads=8, dtype="bf16", window_size=(15, 0))
    for name in ("te-p2p", "te-a2a+p2p"):
        assert "L5054-5060" in strategies.get(name).unsupported_mask(mask_of(window))
    for name in ("te-a2a", "te-all-gather"):
        assert strategies.get(name).unsupported_mask(mask_of(DOCS)) is None
        assert strategies.get(name).unsupported_mask(mask_of(window)) is None
    with pytest.raises(Skipped, match="L5054-5060"):
        te.te_kwargs(window, "p2p")
    one_sided = AttentionConfig(seqlen=64, heads=8, dtype="bf16", causal=False,
                                window_size=(-1, 7))
    with pytest.raises(Skipped, match="L2489-2492"):
        te.te_kwargs(one_sided, "a2a")


@pytest.mark.parametrize("causal, given, passed", [
    (True, (15, 0), (15, 0)), (True, (15, 3), (15, 0)),  # causal bounds the right side
    (False, (15, 3), (15, 3)), (True, (-1, 3), (-1, 0))])
def test_window_is_passed_to_init_and_forward(causal, given, passed):
    attn = AttentionConfig(seqlen=64, heads=8, dtype="bf16", causal=causal,
                           window_size=given, documents=(32, 32))
    for comm_type in ("a2a", "all_gather"):
        init, forward = te.te_kwargs(attn, comm_type)
        assert init["window_size"] == forward["window_size"] == passed
    assert te.te_kwargs(ATTN, "a2a")[1]["window_size"] is None
