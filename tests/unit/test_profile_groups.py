"""Kernel grouping rules as data: the shipped rules' groups and order, a user's rules read
first (``--groups``), bad rule files as one line naming the file and line."""

import json

import pytest

from cpbench import cli
from cpbench.errors import UsageError
from cpbench.profile import groups

SHIPPED = groups.load()


@pytest.mark.parametrize("name, group", [
    # flash-attn 2: helpers before the main backward kernel, whose traits they share
    ("void flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4>>",
     "attention/helper"),
    ("void flash_bwd_convert_dq_kernel<Flash_bwd_kernel_traits<128, 64>>", "attention/helper"),
    ("void flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>",
     "attention/bwd"),
    ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false>>", "attention/fwd"),
    ("void flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<>>", "attention/helper"),
    # flash-attn 3: cutlass::device_kernel<…> is attention, not GEMM
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<x>>>",
     "attention/fwd"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnBwdSm90<x>>>",
     "attention/bwd"),
    ("void flash::prepare_varlen_num_blocks_kernel<(int)1, (bool)1>(int)", "attention/helper"),
    # cuDNN / SDPA, and the CPU op (its backward contains the forward's name)
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128",
     "attention/fwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x128",
     "attention/bwd"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention/fwd"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention/fwd"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention/bwd"),
    # NCCL and gloo, by operation
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "communication/send_recv"),
    ("ncclKernel_AllToAll_RING_LL_Sum_int8_t", "communication/all_to_all"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
     "communication/all_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(x)", "communication/reduce_scatter"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", "communication/all_reduce"),
    ("gloo:send", "communication/send_recv"), ("gloo:recv", "communication/send_recv"),
    ("gloo:all_to_all", "communication/all_to_all"), ("c10d::alltoall_base_",
                                                      "communication/all_to_all"),
    ("gloo:all_gather", "communication/all_gather"), ("gloo:barrier", "communication/barrier"),
    ("aten::broadcast_to", "other"),  # a view, not a collective
    # GEMM: cuBLAS(Lt) incl. its split-K reduce, nvjet, CUTLASS
    ("nvjet_tst_320x128_64x3_1x2_h_bz_coopB_TNT", "gemm"),
    ("void cublasLt::splitKreduce_kernel<(int)32, (int)16, int, float>", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "gemm"),
    ("aten::bmm", "gemm"),
    # memory before the elementwise kernels that carry fills and copies
    ("Memcpy DtoD (Device -> Device)", "memory/copy"), ("Memset (Device)", "memory/set"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
     "memory/set"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(x)>",
     "memory/copy"),
    ("aten::copy_", "memory/copy"), ("aten::fill_", "memory/set"),
    # elementwise / reduction
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
     "elementwise/pointwise"),
    ("fused_to_sub_sigmoid_sub_mul_sub", "elementwise/pointwise"),
    ("triton_poi_fused_clamp_sub_0", "elementwise/pointwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>",
     "elementwise/reduction"),
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>", "elementwise/reduction"),
    ("aten::add_", "elementwise/pointwise"), ("aten::sub", "elementwise/pointwise"),
    # unmatched
    ("compute_position_kernel", "other"), ("KVRingAttentionBackward", "other"),
])
def test_shipped_rules(name, group):
    assert SHIPPED.group(name) == group


def test_first_match_wins_in_file_order():
    rules = groups.parse("rules:\n  - {group: gemm, match: 'k'}\n"
                         "  - {group: attention/fwd, match: 'kernel'}\n", "mine.yaml")
    assert groups.Rules(rules).group("my_kernel") == "gemm"
    assert groups.Rules(rules[::-1]).group("my_kernel") == "attention/fwd"


def test_user_rules_come_first(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("rules:\n"
                    "  - {group: attention/fwd, match: '^compute_position_kernel$'}\n"
                    "  - {group: communication/send_recv, match: 'nvjet_tst_320x128'}\n")
    rules = groups.load(str(mine))
    assert rules.group("compute_position_kernel") == "attention/fwd"
    assert rules.group("nvjet_tst_320x128_64x3_1x2_h_bz_coopB_TNT") == "communication/send_recv"
    assert rules.group("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN") == "gemm"  # shipped rule
    assert rules.rule("compute_position_kernel").where == f"{mine}:2"
    assert len(rules) == len(SHIPPED) + 2


def test_groups_flag_changes_the_summary(capsys, tmp_path):
    from test_profile_summarize import SEED_002

    mine = tmp_path / "mine.yaml"
    mine.write_text("- {group: attention/fwd, match: 'nvjet_tst_320x128'}\n")  # a bare list
    assert cli.main(["profile", "summarize", str(SEED_002), "--groups", str(mine),
                     "--format", "json"]) == 0
    top = {r["group"]: r["percent"] for r in json.loads(capsys.readouterr().out)
           if r["level"] == 1}
    assert max(top, key=top.get) == "attention" and top["attention"] > 57


@pytest.mark.parametrize("text, message", [
    ("rules:\n  - {group: attention/fwd, match: 'a'}\n  - {group: moe, match: 'b'}\n",
     ":3: group 'moe' is not under one of attention, communication"),
    ("rules:\n  - {group: gemm, match: '(unclosed'}\n", ":2: bad regex '(unclosed'"),
    ("rules:\n  - {group: gemm}\n", ":2: a rule is a mapping with two keys"),
    ("rules:\n  - [gemm, x]\n", ":2: a rule is a mapping with two keys"),
    ("patterns:\n  - {group: gemm, match: x}\n", ":1: expected one key, `rules:`"),
    ("rules: {group: gemm\n", "not valid YAML"),
    ("", "no rules"),
])
def test_bad_rule_files(tmp_path, capsys, text, message):
    from test_profile_summarize import SEED_000

    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(UsageError, match="bad.yaml"):
        groups.load(str(bad))
    code = cli.main(["profile", "summarize", str(SEED_000), "--groups", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
