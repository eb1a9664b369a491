"""``cpbench calibrate``: measure this machine's kernel curve, step overhead and links; write a
simulator hardware preset.

Measure the attention kernel's attained TFLOP/s against block size (forward, backward), the
per-step overhead, and p2p / all-to-all latency and bandwidth on local ranks (--nproc) or under
torchrun; write them as a preset `cpbench simulate --hardware FILE` reads.
"""

from __future__ import annotations

import os
import sys

from cpbench.cli import args as cli_args
from cpbench.config import CPU_ATTENTION, DTYPE_NAMES, GPU_ATTENTION
from cpbench.errors import UsageError
from cpbench.mask import parse_size

PROG = "cpbench calibrate"
# powers of two times 1.5 (and 256): on 2 ranks none of the self-check's blocks has one of
# these sides (its default problem: 512 ... 8192, powers of two and their multiples by
# sqrt(2) and sqrt(3)), so every block it prices lies between points, out of sample; on
# more ranks ``_cpu_sides`` drops a point within 5 % of one of its blocks. Above 6144 the
# curve holds flat (the self-check's 8192 blocks: local and Ulysses)
CPU_SIDES = (256, 384, 768, 1536, 3072, 6144)
APART = 0.05
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
                        f"{','.join(map(str, CPU_SIDES))}, less any side near a block of the "
                        f"self-check's schedules, so its score is out of sample; on GPU up to "
                        f"32k)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, help="default fp32 on CPU, bf16 on GPU")
    p.add_argument("--heads", type=integer,
                   help="default 2 on CPU (the self-check's), 40 on GPU")
    p.add_argument("--head-dim", type=integer, help="default 64 on CPU, 128 on GPU")
    p.add_argument("--iters", type=integer, default=5,
                   help="timed passes over the kernel points, iterations a link size (default 5)")
    p.add_argument("--load-limit", type=cli_args.converter(cli_args.read_number(float),
                                                           "a number"),
                   default=0.1, metavar="FRACTION",
                   help="mark the preset busy when other processes used more than this share "
                        "of the cores while it measured (the self-check then refuses to score "
                        "against it; default 0.1)")


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
    if not args.load_limit > 0:
        raise UsageError(f"--load-limit must be positive, got {args.load_limit:g}")
    if not args.out.endswith((".yaml", ".yml")):
        raise UsageError(f"--out {args.out}: a preset is a .yaml file")
    return spec


def _cpu_sides(nproc: int) -> tuple[int, ...]:
    """The grid less any side within ``APART`` of a block the self-check's default problem
    holds on ``nproc`` ranks: its score stays out of sample."""
    from cpbench.sim import selfcheck

    problem = {**CPU_ATTENTION, "heads": selfcheck.HEADS}
    blocks = selfcheck.block_sides(problem, selfcheck.SEQLENS, nproc)
    return tuple(s for s in CPU_SIDES if all(abs(b / s - 1) >= APART for b in blocks))


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
    from cpbench.bench.load import Meter

    with Meter(root=os.getppid() if torchrun else None) as meter:  # torchrun: its agent's tree
        measured = _measure(spec, torchrun, args.nproc)
    if rank != 0:
        return 0
    assert measured is not None, "rank 0 holds the measurements"
    from cpbench.sim import hardware, preset_file

    measured["load"] = None if meter.load is None else {
        "share": meter.load.share, "wall_s": meter.load.wall_s, "limit": args.load_limit,
        "busy": meter.load.share > args.load_limit}
    for line in preset_file.clamp_lines(measured) + _load_warning(measured["load"]):
        sys.stderr.write(f"{PROG}: {line}\n")

    cap = memory.capacity_bytes(device, rpn)
    text = preset_file.render(measured, spec, (cap or 0) / 2 ** 30 or 1.0)
    with open(args.out, "w") as f:
        f.write(text)
    hardware.load(args.out)  # what simulate will read: fail here, not there
    sys.stdout.write(text + f"preset written to {args.out}\n")
    return 0


def _load_warning(load: dict | None) -> list[str]:
    if load is None:
        return ["the load meter needs Linux's /proc: the preset carries no load reading, "
                "and simulate --self-check will not score against it"]
    if load["busy"]:
        return [f"other processes used {load['share'] * 100:.0f} % of the cores while it "
                f"measured (limit {load['limit'] * 100:.0f} %, --load-limit): the preset is "
                "marked busy; simulate --self-check refuses a preset whose share is above its "
                "own --load-limit; calibrate again on an idle machine"]
    return []


def _measure(spec, torchrun: bool, nproc: int) -> dict | None:
    from cpbench.sim.calibrate import rank_calibrate

    if not torchrun:
        from cpbench.launch import run_ranks

        return run_ranks(rank_calibrate, nproc, spec, timeout=None)[0]
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
