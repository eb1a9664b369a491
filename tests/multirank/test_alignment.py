"""Every tensor a strategy hands a kernel starts 16-byte aligned, on odd shapes (5 heads,
S = 100 on 2 ranks: zigzag half-blocks of 25 rows; bf16): flash-attn's 128-bit loads and
FA3's TMA fail with "misaligned address" otherwise (CPU kernels do not care, so only this
test sees it)."""

from __future__ import annotations

from alignment_bodies import misaligned_kernel_args
from rankpool import run_ranks

from cpbench.config import AttentionConfig


def test_every_kernel_argument_is_16_byte_aligned_on_odd_shapes():
    attn = AttentionConfig(batch=1, seqlen=100, heads=5, head_dim=8, dtype="bf16", causal=True)
    (seen, ran), (seen1, _) = run_ranks(misaligned_kernel_args, 2, attn, 1, timeout=120)
    # (ulysses and usp need heads divisible by the ranks: not at 5 heads)
    assert {"burst", "double-ring", "megatron-cp", "ring", "zigzag"} <= \
        {label.split()[0] for label in ran}, ran
    assert seen + seen1 == []
