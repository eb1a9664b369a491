"""Every strategy's CUDA code on ONE GPU (`make test-gpu` on a one-GPU machine; skipped
without CUDA): `cpbench run --launcher threads --device cuda --check`, the ranks as threads
on GPU 0 over the threaded process group (cpbench.threadpg), at 2, 4 and 8 ranks and on the
shapes a first GPU session must trust (GQA, documents, windows, fp16, batch > 1, full
attention). Every row ok and checked against the float64 reference; every registered
strategy either ran or was skipped with its reason (never silently left out); nothing timed.
Its CPU twin is tests/multirank/test_threads_run.py. Never run yet (no GPU where it was
written)."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from jobs import TEST_TIMEOUT_S, cpbench

from cpbench import guards, results, strategies

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(TEST_TIMEOUT_S),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SMALL = ["--seqlen", "4k", "--heads", "8", "--head-dim", "64"]
# flash-attn where installed (auto picks it); else torch's own flash kernel
KERNEL = [] if importlib.util.find_spec("flash_attn") else ["--kernel", "sdpa"]


def _run(tmp_path, *flags) -> list[dict]:
    out = tmp_path / "r.jsonl"
    done = cpbench("run", "--launcher", "threads", "--device", "cuda", "--check",
                   "--strategy", "all", *KERNEL, *flags, "--out", out)
    records = results.read(out) if out.exists() else []
    assert records, done.stdout
    bad = [(r["config"]["strategy"], r["status"], r["error"], r["derived"]["flags"])
           for r in records if r["status"] != "ok" or r["derived"]["check_passed"] is not True
           or r["derived"]["flags"] != [] or r["derived"]["not_measured"] != guards.THREADS]
    assert not bad, f"{bad}\n{done.stdout[-6000:]}"
    assert {r["config"]["run"]["device"] for r in records} == {"cuda"}
    assert all(r["samples_ms"] is None and r["env"]["launcher"] == "threads" for r in records)
    ran = {r["config"]["strategy"] for r in records}
    unaccounted = [n for n in strategies.names() if n not in ran and not re.search(
        rf"^skipped (.*, )?{re.escape(n)}[ ,:(]", done.stdout, re.M)]
    assert not unaccounted, f"neither ran nor skipped with a reason: {unaccounted}"
    assert done.returncode == 0, done.stdout[-6000:]
    return records


@pytest.mark.parametrize("nproc", [2, 4, 8])
def test_every_strategy_as_threads_on_one_gpu(tmp_path, nproc):
    records = _run(tmp_path, "--nproc", str(nproc), *SMALL)
    assert any(r["ranks_per_problem"] == nproc for r in records)  # CP rows ran


@pytest.mark.parametrize("flags", [
    ["--kv-heads", "2"],                    # GQA
    ["--documents", "2k,1k,512,512"],      # packed documents (varlen)
    ["--window-size", "511,0"],             # a causal sliding window
    ["--dtype", "fp16"],
    ["--batch", "2"],
    ["--no-causal"],
], ids=" ".join)
def test_every_strategy_as_threads_on_this_shape(tmp_path, flags):
    _run(tmp_path, "--nproc", "4", *SMALL, *flags)
