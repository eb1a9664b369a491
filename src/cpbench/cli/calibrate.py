"""``cpbench calibrate``: measure this machine's kernel curve, step overhead and links; write a
simulator hardware preset.

Measure the attention kernel's attained TFLOP/s against block size (forward, backward), the
per-step overhead, and p2p / all-to-all latency and bandwidth on local ranks (--nproc) or under
torchrun; write them as a preset `cpbench simulate --hardware FILE` reads.
"""

from __future__ import annotations

import sys

from cpbench.cli import args as cli_args
from cpbench.config import CPU_ATTENTION, DTYPES, GPU_ATTENTION
from cpbench.errors import UsageError
from cpbench.mask import parse_size

PROG = "cpbench calibrate"
CPU_SIDES = (256, 512, 1024, 2048, 4096, 8192)  # and the self-check's blocks: _cpu_sides
GPU_SIDES = (512, 1024, 2048, 4096, 8192, 16384, 32768)


def add_parser(sub) -> None:
    p = cli_args.command(sub, "calibrate", __doc__, main)
    integer = cli_args.converter(cli_args.read_number(int), "an integer")
    p.add_argument("--out", required=True, metavar="FILE.yaml", help="the preset to write")
    p.add_argument("--nproc", type=integer, default=2,
                   help="local CPU ranks measured at once (default 2; ignored under torchrun)")
    p.add_argument("--sides", metavar="L[,L...]",
                   type=cli_args.converter(
                       lambda t: tuple(parse_size(x) for x in t.split(",") if x.strip()),
                       "sizes"),
                   help=f"block sides of the kernel curve (default on CPU: "
                        f"{','.join(map(str, CPU_SIDES))} and the side of every block the "
                        f"strategies' schedules hold in the self-check's problem; on GPU up "
                        f"to 32k)")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="default fp32 on CPU, bf16 on GPU")
    p.add_argument("--heads", type=integer,
                   help="default 2 on CPU (the self-check's), 40 on GPU")
    p.add_argument("--head-dim", type=integer, help="default 64 on CPU, 128 on GPU")
    p.add_argument("--iters", type=integer, default=5,
                   help="timed passes over the kernel points, iterations a link size (default 5)")


def _spec(args, device: str, ranks_per_node: int):
    from cpbench.sim import selfcheck
    from cpbench.sim.calibrate import Spec

    base = GPU_ATTENTION if device == "cuda" else CPU_ATTENTION
    heads = args.heads or (base["heads"] if device == "cuda" else selfcheck.HEADS)
    spec = Spec(device=device, dtype=args.dtype or base["dtype"],
                heads=heads, head_dim=args.head_dim or base["head_dim"],
                sides=tuple(sorted(set(args.sides or (GPU_SIDES if device == "cuda"
                                                      else _cpu_sides(args.nproc))))),
                ranks_per_node=ranks_per_node, iters=args.iters)
    if min(spec.heads, spec.head_dim, spec.iters, *spec.sides) < 1:
        raise UsageError("--heads, --head-dim, --iters and --sides must be positive")
    if not args.out.endswith((".yaml", ".yml")):
        raise UsageError(f"--out {args.out}: a preset is a .yaml file")
    return spec


def _cpu_sides(nproc: int) -> tuple[int, ...]:
    """The grid and the blocks of the self-check's default problem on ``nproc`` ranks."""
    from cpbench.sim import selfcheck

    problem = {**CPU_ATTENTION, "heads": selfcheck.HEADS}
    return CPU_SIDES + selfcheck.block_sides(problem, selfcheck.SEQLENS, nproc)


def main(args) -> int:
    import torch

    from cpbench.bench import env as env_mod
    from cpbench.bench import memory

    torchrun = env_mod.under_torchrun()
    rank = env_mod.torchrun_world()[0] if torchrun else 0
    try:
        device = "cuda" if torchrun and torch.cuda.is_available() else "cpu"
        if not torchrun and args.nproc < 2:
            raise UsageError("--nproc must be >= 2: the links are measured between ranks")
        rpn = env_mod.torchrun_world()[2] if torchrun else args.nproc
        spec = _spec(args, device, rpn)
        with open(args.out, "a"):  # writable, before minutes of measuring
            pass
    except (OSError, UsageError) as e:
        return cli_args.fail(PROG, e) if rank == 0 else cli_args.USAGE_ERROR
    measured = _measure(spec, torchrun, args.nproc)
    if rank != 0:
        return 0
    assert measured is not None, "rank 0 holds the measurements"
    from cpbench.sim import hardware, preset_file

    cap = memory.capacity_bytes(device, rpn)
    text = preset_file.render(measured, spec, (cap or 0) / 2 ** 30 or 1.0)
    with open(args.out, "w") as f:
        f.write(text)
    hardware.load(args.out)  # what simulate will read: fail here, not there
    sys.stdout.write(text + f"preset written to {args.out}\n")
    return 0


def _measure(spec, torchrun: bool, nproc: int) -> dict | None:
    from cpbench.sim.calibrate import rank_calibrate

    if not torchrun:
        from cpbench.launch import run_ranks

        return run_ranks(rank_calibrate, nproc, spec, timeout=None)[0]
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if spec.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if spec.device == "cuda" else "gloo",
                            timeout=timedelta(seconds=600))
    try:
        return rank_calibrate(dist.get_rank(), dist.get_world_size(), spec)
    finally:
        dist.destroy_process_group()
