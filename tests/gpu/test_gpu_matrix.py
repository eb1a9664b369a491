"""cpbench run on 2 GPUs across what a first GPU session must trust (`make test-gpu`; skipped
without 2 GPUs): each kernel named explicitly, GQA, head dim 128, batch > 1, non-causal, fp16,
documents and windows, TE's THD path; every row ok and checked against the float64
reference. And the numbers: a strategy's time and memory against a single-GPU `cpbench
kernels` run of the same blocks. Never run yet (no GPU where it was written)."""

from __future__ import annotations

import pytest
import torch
from jobs import TEST_TIMEOUT_S, cpbench, torchrun

from cpbench import kernels, results

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(TEST_TIMEOUT_S),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs"),
]
SMALL = ["--seqlen", "4k", "--heads", "8", "--head-dim", "64", "--warmup", "1", "--iters", "2"]
CP = "ring,zigzag,ulysses,usp,megatron-cp,llama3"


def _run(tmp_path, *flags) -> list[dict]:
    out = tmp_path / "r.jsonl"
    done = torchrun("-m", "cpbench.run", "--check", *flags, "--out", out)
    records = results.read(out) if out.exists() else []
    assert records, done.stdout
    bad = [(r["config"]["strategy"], r["status"], r["error"]) for r in records
           if r["status"] != "ok" or r["derived"]["check_passed"] is not True]
    assert not bad, f"{bad}\n{done.stdout[-6000:]}"
    return records


@pytest.mark.parametrize("kernel", ["flash-attn", "flash-attn3", "sdpa", "torch"])
def test_each_kernel_named_explicitly(tmp_path, kernel):
    backend = kernels.get(kernel)
    why = backend.unsupported_reason(device="cuda", dtype=torch.bfloat16, head_dim=64, heads=8,
                                     kv_heads=8)
    if why is not None:  # the capability table's verdict, not a caught error
        pytest.skip(why)
    records = _run(tmp_path, "--strategy", CP, "--kernel", kernel, *SMALL)
    assert {r["kernel"] for r in records} == {kernel}


@pytest.mark.parametrize("flags", [
    ["--kv-heads", "2"],                    # GQA
    ["--head-dim", "128"],
    ["--batch", "2"],
    ["--no-causal"],
    ["--dtype", "fp16"],
    ["--documents", "2k,1k,512,512"],      # packed documents (varlen)
    ["--window-size", "511,0"],             # a causal sliding window
    ["--documents", "2k,2k", "--window-size", "767,0"],
], ids=" ".join)
def test_every_strategy_on_this_shape(tmp_path, flags):
    """--strategy all: what cannot run the shape is skipped with a note; the rest ok."""
    _run(tmp_path, "--strategy", "all", *_with(flags))


def _with(flags: list[str]) -> list[str]:
    """SMALL with ``flags`` over it (a flag given twice would be an error)."""
    argv, i = list(SMALL), 0
    while i < len(flags):
        if flags[i].startswith("--no-"):
            argv.append(flags[i])
            i += 1
            continue
        if flags[i] in argv:
            argv[argv.index(flags[i]) + 1] = flags[i + 1]
        else:
            argv += flags[i:i + 2]
        i += 2
    return argv


def test_te_thd_path_under_documents(tmp_path):
    pytest.importorskip("transformer_engine.pytorch")
    records = _run(tmp_path, "--strategy", "te-p2p,te-a2a,te-a2a+p2p", "--documents",
                   "2k,1k,1k", "--dtype", "bf16", *SMALL)
    assert {r["config"]["strategy"] for r in records} == {"te-p2p", "te-a2a", "te-a2a+p2p"}


def test_timings_and_memory_are_plausible_against_one_gpu(tmp_path):
    """`local` on each of 2 GPUs runs the whole problem on one GPU, as `cpbench kernels`
    does: the same block, so times within 2x and memory within 3x of each other. The ring over
    2 GPUs does about half the causal work per GPU plus communication: at least 0.3x and at
    most 3x the single-GPU time."""
    shape = ["--seqlen", "16k", "--heads", "16", "--head-dim", "128", "--dtype", "bf16"]
    kout = tmp_path / "k.jsonl"
    done = cpbench("kernels", "--kernel", "flash-attn", *shape, "--out", kout)
    one = results.read(kout) if kout.exists() else []
    if not one or one[0]["status"] != "ok":
        pytest.skip(f"flash-attn does not run here: {done.stdout[-2000:]}")
    single = one[0]["derived"]
    rows = {r["config"]["strategy"]: r for r in _run(
        tmp_path, "--strategy", "local,ring", "--kernel", "flash-attn", *shape)}
    local, ring = rows["local"]["derived"], rows["ring"]["derived"]
    assert 0.5 < local["fwd_bwd_ms"] / single["fwd_bwd_ms"] < 2.0, (local, single)
    assert 0.3 < ring["fwd_bwd_ms"] / single["fwd_bwd_ms"] < 3.0, (ring, single)
    assert 1 / 3 < local["memory_mb"] / single["memory_mb"] < 3.0, (local, single)
