"""gpu-check's steps, in the order a first GPU run needs their answers (are the kernels right,
are the strategies right, is the dry run's memory the GPU's, how fast, then the rest): what
each runs on a machine with a GPU, with only a CUDA build of torch (fake CUDA tensors), or
with neither, and what it found (read back from its records and output). Each step's cap is
its share of the whole run's budget on a GPU (STEPS; a test holds their sum to the budget).
Standard library only: cpbench and torch run in the subprocesses."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import gpu_check_read as read
import gpu_check_report as report

# (lengths, batch) per command: 16K tokens a call as the published benchmark up to 16K, B = 1
# above; 16K first (the published figure the headline quotes), 32K with it (a command's start,
# ~10 s of torch and CUDA, is worth saving on a 6-minute budget). Not 64K: alone it is ~2/3
# of the step's arithmetic (~10 s at H100 rates), with no published figure to stand beside
KERNEL_RUNS = (((16384, 32768), 1), ((4096,), 4), ((8192,), 2))
KERNEL_SEQLENS = tuple(sorted(s for lengths, _ in KERNEL_RUNS for s in lengths))
# the kernels asked for, each with the module whose absence leaves it out ("not installed")
KERNEL_MODULES = {"sdpa": None, "flash-attn": "flash_attn", "flash-attn3": "flash_attn_interface"}
KERNEL_HEADS = 16  # the published benchmark's hidden size 2048 at head dim 128
KERNEL_WARMUP, KERNEL_ITERS = 3, 10
# the 1-rank run and its dry run: the shape of the FA2 workspace the issue measured (~129 MiB)
MEMORY_GPU = ["--seqlen", "16k", "--heads", "16", "--head-dim", "128", "--dtype", "bf16",
              "--kernel", "sdpa"]
MEMORY_CPU = ["--seqlen", "1k", "--heads", "4", "--head-dim", "64", "--dtype", "fp32"]
THREADS_BASE = ["--strategy", "all", "--check", "--seqlen", "4k", "--heads", "8", "--kv-heads",
                "2", "--head-dim", "128", "--dtype", "bf16", "--warmup", "0", "--iters", "1"]
THREADS_VARIANTS = {"gqa": [], "documents": ["--documents", "2k,1k,512,512"],
                    "window": ["--window-size", "511,0"]}
# 4 ranks first (issue 38's acceptance case), then 8, then the masks at 4. Not 2 ranks, nor the
# masks at 8: 17 strategy cases at 8 ranks took 63 s, at 4 ranks 40-80 s, on the 2-core VM
# (loaded; their time is Python and threads, not arithmetic, so a GPU host's 16 idle cores
# should be faster, but no GPU has measured it): four such commands are what the step's cap
# can hold. A command may use the whole cap; what does not fit says "out of time", and
# `--only threads` reruns the step with the whole rerun budget.
THREADS_ORDER = [("gqa", 4), ("gqa", 8), ("documents", 4), ("window", 4)]
THREADS_CAP_S = 110
CALIBRATE_SIDES = "1k,2k,4k,8k,16k"


@dataclass
class Command:
    label: str
    argv: list[str]
    timeout_s: float
    env: dict = field(default_factory=dict)


@dataclass
class Step:
    key: str
    title: str
    # the step's cap on a GPU (its share of the budget; None: what the steps before it left);
    # each command has its own limit below it. Without a GPU, or under --only, the budget
    # and the commands' limits bound a step, not this
    timeout_s: float | None
    plan: Callable  # (ctx) -> list[Command], or a str: why the step is skipped
    read: Callable | None = None  # (ctx, results) -> findings (a dict, "headline" first)


def _gpu(ctx) -> str | None:
    return None if ctx.mode == "gpu" else ctx.why_not


# --- environment

ENV_SNIPPET = r"""
import importlib.metadata as md, importlib.util, json, platform, sys
info = {"python": sys.version.split()[0], "platform": platform.platform()}
for dist in ("triton", "numpy", "flash-attn", "transformer-engine", "ring-flash-attn",
             "yunchang", "pytest", "pytest-timeout", "pyyaml", "pandas", "scipy"):
    try:
        info[dist] = md.version(dist)
    except md.PackageNotFoundError:
        info[dist] = None
# what imports as the optional kernels and libraries (FA3's wheel names vary; its module not)
info["modules"] = {m: importlib.util.find_spec(m) is not None for m in (
    "flash_attn", "flash_attn_interface", "ring_flash_attn", "yunchang", "transformer_engine")}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda,
                cuda_available=torch.cuda.is_available())
    info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        info["nccl"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpus=torch.cuda.device_count(), sms=p.multi_processor_count,
                    capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1))
except Exception as e:
    info["torch_error"] = f"{type(e).__name__}: {e}"
print("GPU_CHECK_ENV " + json.dumps(info))
"""


def plan_env(ctx) -> list[Command]:
    cmds = [Command("versions", [ctx.python, "-c", ENV_SNIPPET], 30)]
    if ctx.has("nvidia-smi"):
        cmds += [Command("nvidia-smi", ["nvidia-smi"], 10),
                 Command("driver", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                    "--format=csv,noheader"], 10)]
    return cmds


# --- sdpa against float64 (tests/unit/test_sdpa_cuda.py)

SDPA_TESTS = "tests/unit/test_sdpa_cuda.py"


def plan_sdpa(ctx):
    return _gpu(ctx) or [Command("pytest sdpa", ctx.pytest("-v", "-m", "gpu", SDPA_TESTS), 35)]


# --- cpbench kernels beside FA2's published figures


def _kernels_out(ctx) -> Path:
    return ctx.logs / f"{ctx.number('kernels'):02d}-kernels.jsonl"


def kernels_here(ctx) -> tuple[list[str], list[str]]:
    """The kernels to time, and those left out: "<kernel>: not installed" (the one-GPU machine
    has no flash-attn; cpbench would only print a row saying it cannot import)."""
    mods = (ctx.env or {}).get("modules") or {}
    ran = [k for k, m in KERNEL_MODULES.items() if m is None or mods.get(m)]
    return ran, [f"{k}: not installed" for k in KERNEL_MODULES if k not in ran]


def plan_kernels(ctx):
    if why := _gpu(ctx):
        return why
    kernels, _ = kernels_here(ctx)
    return [Command(f"kernels S={','.join(report._size(s) for s in lengths)}", ctx.cpbench(
        "kernels", "--device", "cuda", "--kernel", ",".join(kernels),
        "--seqlen", ",".join(map(str, lengths)), "--batch", str(batch),
        "--heads", str(KERNEL_HEADS), "--head-dim", "128", "--dtype", "bf16", "--causal", "both",
        "--warmup", str(KERNEL_WARMUP), "--iters", str(KERNEL_ITERS),
        "--out", str(_kernels_out(ctx))), 40) for lengths, batch in KERNEL_RUNS]


def read_kernels(ctx, results) -> dict:
    rows = read.kernel_rows(read.records(_kernels_out(ctx)))
    device = (ctx.env or {}).get("gpu", "cuda")
    found = {"kernel": ", ".join(sorted({r["kernel"] for r in rows})) or "sdpa",
             "device": device, "heads": KERNEL_HEADS, "warmup": KERNEL_WARMUP,
             "iters": KERNEL_ITERS, "rows": rows, "left_out": kernels_here(ctx)[1]}
    if "H100" not in device:
        found["device_note"] = (f"The published figures are an H100 SXM5's; this is {device}.")
    best = [r for r in rows if r["causal"] and r["seqlen"] == 16384 and r.get("fwd_tflops")]
    if best:
        r = best[0]
        found["headline"] = (f"{r['kernel']} causal 16K fwd {r['fwd_tflops']:.0f} TFLOP/s "
                             f"(FA2 published on H100: {r['fwd_published']})")
    else:
        found["headline"] = f"{len(rows)} rows measured"
    if found["left_out"]:
        found["headline"] += "; skipped " + ", ".join(found["left_out"])
    return found


# --- a 1-rank run of local and its dry run, memory side by side


def _memory_out(ctx, what: str) -> Path:
    return ctx.logs / f"{ctx.number('memory'):02d}-memory-{what}.jsonl"


def plan_memory(ctx):
    run_out, dry_out = _memory_out(ctx, "run"), _memory_out(ctx, "dryrun")
    one = ["--strategy", "local"]
    if ctx.mode == "none":  # the comparison's code path on CPU: gloo, the CPU meter
        return [Command("run local (cpu)", ctx.cpbench(
                    "run", *one, "--nproc", "1", "--device", "cpu", "--check", *MEMORY_CPU,
                    "--warmup", "1", "--iters", "2", "--out", str(run_out)), 90),
                Command("dryrun local (cpu)", ctx.cpbench(
                    "dryrun", *one, "--device", "cpu", "--nodes", "1", "--gpus-per-node", "1",
                    *MEMORY_CPU, "--out", str(dry_out)), 60)]
    dry = Command("dryrun local (fake cuda)", ctx.cpbench(
        "dryrun", *one, "--device", "cuda", "--nodes", "1", "--gpus-per-node", "1",
        "--hardware", ctx.preset(), *MEMORY_GPU, "--out", str(dry_out)), 60)
    if ctx.mode == "fake":
        return [dry]
    run = Command("run local (1 GPU, torchrun)", ctx.torchrun(
        "-m", "cpbench.run", *one, "--device", "cuda", "--check", *MEMORY_GPU,
        "--warmup", "2", "--iters", "5", "--out", str(run_out)), 30)
    return [run, dry]


def fa2_workspace_bytes(batch: int, seqlen: int, heads: int, head_dim: int) -> int:
    """FA2's backward buffers outside any tensor it returns: dq_accum in fp32,
    b·⌈s⌉₁₂₈·h·⌈d⌉ (d to 32 up to 128, else to 64), and softmax_d, b·h·⌈s⌉₁₂₈ fp32
    (flash_api.cpp mha_bwd). cpbench.kernels.fa2_workspace.backward_bytes without GQA, here
    without torch; a test holds the two equal."""
    s128 = -(-seqlen // 128) * 128
    step = 32 if head_dim <= 128 else 64
    d = -(-head_dim // step) * step
    return 4 * batch * s128 * heads * d + 4 * batch * heads * s128


def read_memory(ctx, results) -> dict:
    run = read.records(_memory_out(ctx, "run"))
    dry = read.records(_memory_out(ctx, "dryrun"))
    flags = MEMORY_CPU if ctx.mode == "none" else MEMORY_GPU
    found: dict = {"case": " ".join(["local", *flags])}
    if run:
        r = run[-1]
        found["run_bytes"] = max(r["memory_bytes"]) if r.get("memory_bytes") else None
        passed = (r.get("derived") or {}).get("check_passed")
        check = {True: "PASS", False: "FAIL", None: "not run"}[passed]
        found["run_note"] = (f"{r['status']}, check {check}, "
                             f"{r['env'].get('device_name', r['env'].get('device'))}")
    else:
        found["run_note"] = ctx.why_not if ctx.mode == "fake" else "no record (see the log)"
    if dry:
        d = dry[-1]
        found["dryrun_bytes"] = max(d["memory_bytes"]) if d.get("memory_bytes") else None
        found["dryrun_note"] = f"{d['status']}, fake {d['env'].get('device', '?')} tensors"
    if found.get("run_bytes") and found.get("dryrun_bytes"):
        found["ratio"] = found["dryrun_bytes"] / found["run_bytes"]
        found["difference_mib"] = (found["dryrun_bytes"] - found["run_bytes"]) / 2 ** 20
    if ctx.mode != "none":
        found["fa2_workspace_bytes"] = fa2_workspace_bytes(1, 16384, 16, 128)
    run_mib, dry_mib = report._mib(found.get("run_bytes")), report._mib(found.get("dryrun_bytes"))
    if "ratio" in found:
        found["headline"] = f"dry run / run = {found['ratio']:.3f} ({dry_mib} / {run_mib} MiB)"
    elif dry and not run and ctx.mode == "fake":
        found["headline"] = f"dry run on fake CUDA {dry_mib} MiB; no GPU to run it on"
    else:
        found["headline"] = f"run {run_mib} MiB, dry run {dry_mib} MiB: no ratio (see the log)"
    return found


# --- every strategy under --launcher threads on the GPU


def _threads_out(ctx, variant: str, n: int) -> Path:
    return ctx.logs / f"{ctx.number('threads'):02d}-threads-{variant}-n{n}.jsonl"


def plan_threads(ctx):
    if why := _gpu(ctx):
        return why
    return [Command(f"threads {variant} n={n}", ctx.cpbench(
        "run", "--launcher", "threads", "--nproc", str(n), "--device", "cuda", *THREADS_BASE,
        *THREADS_VARIANTS[variant], "--out", str(_threads_out(ctx, variant, n))),
                    THREADS_CAP_S) for variant, n in THREADS_ORDER]


def read_threads(ctx, results) -> dict:
    cells: dict[str, dict[str, str]] = {}
    columns = []
    for variant, n in sorted(THREADS_ORDER, key=lambda x: (list(THREADS_VARIANTS).index(x[0]),
                                                          x[1])):
        recs = read.records(_threads_out(ctx, variant, n))
        if not recs:
            continue
        col = f"{variant} n={n}"
        columns.append(col)
        for r in recs:
            cells.setdefault(r["config"]["strategy"], {})[col] = read.verdict(r)
    verdicts = [v for row in cells.values() for v in row.values()]
    passed = sum(v == "PASS" for v in verdicts)
    head = (f"{passed} of {len(verdicts)} strategy cases PASS over {len(columns)} runs"
            if verdicts else "no records")
    return {"headline": head, "device": (ctx.env or {}).get("gpu", "cuda"), "columns": columns,
            "cells": dict(sorted(cells.items()))}


# --- doctor, the GPU tests


def plan_doctor(ctx):
    return [Command("doctor", ctx.cpbench("doctor"), 60)]


# the threads step runs what this file runs (--strategy all under threads on the GPU), at the
# shapes its cap holds; the file's other shapes (fp16, batch 2, full attention) are 9 launches,
# minutes: `make test-gpu` runs them
THREADS_TESTS = "tests/gpu/test_threads_one_gpu.py"


def plan_gpu_tests(ctx):
    return _gpu(ctx) or [Command("pytest -m gpu", ctx.pytest(
        "-v", "-rs", "-m", "gpu", "tests/gpu", "tests/unit", "--ignore", SDPA_TESTS,
        "--ignore", THREADS_TESTS, "--continue-on-collection-errors"), 60)]


# --- calibrate against the published preset


def plan_calibrate(ctx):
    if why := _gpu(ctx):
        return why
    measured = ctx.out / "calibrated.yaml"
    return [Command("calibrate (1 GPU, torchrun)", ctx.torchrun(
                "-m", "cpbench.cli", "calibrate", "--out", str(measured),
                "--sides", CALIBRATE_SIDES, "--iters", "3"), 40),
            Command("compare presets", [ctx.python, str(ctx.root / "scripts" / "gpu_check.py"),
                                        "--compare-presets", str(measured), ctx.preset()], 20)]


# --- the fake-GPU tests with this torch


def plan_fake_gpu(ctx):
    if ctx.mode == "none":
        return (f"{ctx.why_not}: fake CUDA tensors need a CUDA build of torch (run this script "
                f"with the fake-GPU venv's python; `make test-fake-gpu` builds it)")
    env = {}
    if ctx.mode == "fake" and (ctx.env or {}).get("flash-attn"):
        env["CPBENCH_FAKE_GPU_VENV"] = "1"  # as make test-fake-gpu: flash-attn must import
    return [Command("pytest tests/fake_gpu", ctx.pytest("-v", "-rs", "tests/fake_gpu"), 600,
                    env)]


STEPS = [
    Step("env", "environment: GPU, driver, torch, CUDA, cuDNN, NCCL, triton", 30, plan_env,
         read.read_env),
    Step("sdpa", "sdpa (torch's FA2) against float64 on CUDA", 35, plan_sdpa, read.read_pytest),
    Step("threads", "every strategy under --launcher threads, 4 and 8 ranks, --check",
         THREADS_CAP_S, plan_threads, read_threads),
    Step("memory", "1-rank run of local and its dry run: memory", 40, plan_memory, read_memory),
    Step("kernels", "cpbench kernels beside FA2's published H100 figures", 40, plan_kernels,
         read_kernels),
    Step("doctor", "cpbench doctor", 25, plan_doctor, read.read_doctor),
    Step("calibrate", "cpbench calibrate beside the published preset", 40, plan_calibrate,
         read.read_calibrate),
    Step("gpu-tests", "the other GPU tests one GPU can run (pytest -m gpu)", 20, plan_gpu_tests,
         read.read_pytest),
    Step("fake-gpu", "tests/fake_gpu with this torch", None, plan_fake_gpu, read.read_fake_gpu),
]
