"""What ``cpbench doctor`` runs besides reading the machine: each kernel backend's tiny forward
and backward on the device (a flash-attn built without this GPU's architecture fails here,
not at a job's first case), the upstream libraries imported the way their strategies import
them, and the probe between nodes (one task per node under srun).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from datetime import timedelta

import torch

from cpbench.kernels.base import KernelBackend

# the kernel smoke test's block: small, but the GPU default's head dim and a GQA-free shape
# every flash kernel takes
SMOKE = dict(batch=1, seqlen=128, heads=8, head_dim=128)
# what each upstream library's strategies import (transformer_engine: its PyTorch part)
UPSTREAM_MODULES = {"ring-flash-attn": "ring_flash_attn", "yunchang": "yunchang",
                    "transformer-engine": "transformer_engine.pytorch"}


def smoke_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def kernel_smoke(backend: KernelBackend, device: str) -> str:
    """Run a causal forward and backward of one SMOKE block on ``device`` and compare out,
    dq, dk and dv with the float64 reference at ``--check``'s tolerances; what ran (raises
    what the kernel raised, or RuntimeError on a wrong result). A broken kernel is off by
    orders of magnitude, rounding is not: the check's tolerances, not a tighter one (an fp32
    check at 1e-4 once failed in CI at 1.3e-4, never reproduced)."""
    from cpbench import reference

    b, s, h, d = (SMOKE[k] for k in ("batch", "seqlen", "heads", "head_dim"))
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, generator=gen).to(device, smoke_dtype(device))
                     for _ in range(4))
    scale = d ** -0.5
    out, lse = backend.forward(q, k, v, causal=True, softmax_scale=scale)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, causal=True, softmax_scale=scale)
    if device == "cuda":
        torch.cuda.synchronize()  # a kernel's launch error surfaces here, not later
    ref = reference.reference_attention(*(t.cpu() for t in (q, k, v, dout)), causal=True,
                                        softmax_scale=scale)
    what = "bf16" if q.dtype == torch.bfloat16 else "fp32"
    wrong = [c for c in (reference.compare(name, got.cpu(), ref[name], what)
                         for name, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)))
             if not c.passed]
    if wrong:
        atol, rtol = reference.TOLERANCES[what]
        raise RuntimeError("wrong result: " + ", ".join(
            f"{c.tensor} max |got - reference| = {c.max_abs:.2e}" for c in wrong)
            + f" (tolerance {atol:g} + {rtol:g}·|reference|, as --check)")
    return f"ran a forward and backward ({s} tokens, {h} heads, head dim {d}, {what}, causal)"


def upstream_import(package: str, classes: list, device: str) -> str:
    """Import ``package`` as its strategies do (``classes``) on ``device``; what it runs on
    (raises what the import raised)."""
    from cpbench import kernels
    from cpbench.strategies._upstream import flash_attn_beneath, import_algorithms

    module = UPSTREAM_MODULES[package]
    beneath = ""
    if package != "transformer-engine":  # ring-flash-attn and yunchang call flash-attn
        # on CUDA flash-attn where it imports, else its interface on torch's ops (sdpa)
        kernel = kernels.get("sdpa-cpu" if device == "cpu" else "flash-attn")
        if device != "cpu" and not kernel.is_importable():
            kernel = kernels.get("sdpa")
        beneath = f" over {flash_attn_beneath(kernel)}"
    modules = sorted({c.module for c in classes if getattr(c, "module", None) is not None})
    if package == "ring-flash-attn" and modules:
        for name in modules:  # the algorithm files, as the adapters import them
            import_algorithms(module, name)
    else:
        importlib.import_module(module)
    return f"imports {module}{beneath}"


def installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(UPSTREAM_MODULES[package].split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def node_probe(rank: int, world: int, master: str, port: int, device: str,
               timeout_s: float = 120.0) -> dict:
    """One task per node (srun): form a group across the nodes (NCCL on GPU 0 of each, else
    gloo) and run the probe (all-reduce, ring p2p, all-to-all) between them. Rank 0's
    figures (the slowest node's); raises what the group or a collective raised."""
    import torch.distributed as dist

    from cpbench.bench.probe import probe
    from cpbench.launch import NCCL_ERROR_HANDLING

    # a collective that times out ends this process (the doctor's child), not hangs it
    os.environ.update(NCCL_ERROR_HANDLING)
    backend = "nccl" if device == "cuda" else "gloo"
    device_id = None
    if device == "cuda":
        device_id = torch.device("cuda", 0)
        torch.cuda.set_device(device_id)
    store = dist.TCPStore(master, port, world, is_master=rank == 0,
                          timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s), device_id=device_id)
    try:
        return probe(rank, world, device)
    finally:
        dist.destroy_process_group()
