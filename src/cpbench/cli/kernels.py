"""``cpbench kernels``: time single-device attention kernels over a grid of shapes (seed 003).

Time every attention kernel cpbench has, and PyTorch's own SDPA backends / flex_attention, over
sequence length x heads x head dim x dtype x mask: FWD, BWD, FWD+BWD (median ms), peak memory,
TFLOPs/s, speedup.
"""

from __future__ import annotations

import sys

from cpbench.cli import args as cli_args
from cpbench.config import CPU_ATTENTION, DTYPE_NAMES, FORMATS
from cpbench.errors import UsageError
from cpbench.mask import parse_size

PROG = "cpbench kernels"


def _list(read, what: str):
    def parse(text: str) -> tuple:
        items = tuple(read(t.strip()) for t in text.split(",") if t.strip())
        if not items:
            raise UsageError(f"{what} needs at least one value")
        return items
    return cli_args.converter(parse, what)


def _dtype(text: str) -> str:
    if text not in DTYPE_NAMES:
        raise UsageError(f"unknown dtype {text!r}; choose from {', '.join(DTYPE_NAMES)}")
    return text


def _causal(text: str) -> tuple[bool, ...]:
    choices = {"yes": (True,), "no": (False,), "both": (True, False)}
    if text not in choices:
        raise UsageError(f"--causal takes yes, no or both, got {text!r}")
    return choices[text]


def add_parser(sub) -> None:
    p = cli_args.command(sub, "kernels", __doc__, main)
    integer = cli_args.read_number(int)
    p.add_argument("--kernel", type=_list(str, "--kernel"), default=("all",),
                   metavar="NAME[,NAME...]|all",
                   help="kernels (default all: those that cannot run here are rows saying why)")
    p.add_argument("--seqlen", type=_list(parse_size, "--seqlen"), default=(1024, 4096),
                   metavar="S[,S...]", help="sequence lengths, e.g. 1k,4k,16k (default 1k,4k)")
    p.add_argument("--heads", type=_list(integer, "--heads"), default=(CPU_ATTENTION["heads"],),
                   metavar="H[,H...]", help="heads (default 8)")
    p.add_argument("--head-dim", type=_list(integer, "--head-dim"),
                   default=(CPU_ATTENTION["head_dim"],), metavar="D[,D...]",
                   help="head dimensions (default 64)")
    p.add_argument("--dtype", type=_list(_dtype, "--dtype"), default=None,
                   metavar="DT[,DT...]", help="dtypes (default fp32 on CPU, bf16 on GPU)")
    p.add_argument("--causal", type=cli_args.converter(_causal, "yes|no|both"),
                   default=(True,), metavar="yes|no|both", help="mask (default yes)")
    p.add_argument("--batch", type=cli_args.converter(integer, "an integer"), default=1)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--warmup", type=cli_args.converter(integer, "an integer"), default=None,
                   help="untimed calls first (default 2 CPU, 5 GPU)")
    p.add_argument("--iters", type=cli_args.converter(integer, "an integer"), default=None,
                   help="timed calls (default 5 CPU, 20 GPU)")
    p.add_argument("--baseline", default="torch", metavar="KERNEL",
                   help="the speedup columns divide its time by each row's (default torch)")
    p.add_argument("--max-memory", type=cli_args.converter(cli_args.read_number(float),
                                                           "a number"),
                   metavar="GIB", help="skip cases whose estimated footprint exceeds this "
                                       "(default: the device's total memory)")
    p.add_argument("--format", choices=FORMATS, default="table")
    p.add_argument("--out", metavar="FILE.jsonl",
                   help="append one result record per measured case (`cpbench report` "
                        "renders them)")


def _grid(args, device: str):
    from cpbench.bench import kernelbench, kernelrun

    names = args.kernel
    if "all" in names:
        names = tuple(n for n in kernelbench.names() if n != "auto")
    dtypes = args.dtype or (("bf16",) if device == "cuda" else ("fp32",))
    grid = kernelrun.Grid(kernels=names, seqlens=args.seqlen, heads=args.heads,
                          head_dims=args.head_dim, dtypes=dtypes, causal=args.causal,
                          batch=args.batch)
    grid.check()
    return grid


def _settings(args, device: str) -> tuple[int, int, int | None]:
    from cpbench.bench import memory

    warmup = args.warmup if args.warmup is not None else (5 if device == "cuda" else 2)
    iters = args.iters if args.iters is not None else (20 if device == "cuda" else 5)
    if warmup < 0 or iters < 1 or args.batch < 1:
        raise UsageError("--warmup must be >= 0, --iters and --batch >= 1")
    if args.max_memory is not None and not args.max_memory > 0:
        raise UsageError(f"--max-memory must be a positive number of GiB, got {args.max_memory}")
    cap = int(args.max_memory * 2 ** 30) if args.max_memory else \
        memory.capacity_bytes(device, 1)
    return warmup, iters, cap


def main(args) -> int:
    import torch

    from cpbench.report import console

    with console.transient_progress():
        try:
            device = args.device if args.device != "auto" else (
                "cuda" if torch.cuda.is_available() else "cpu")
            if device == "cuda" and not torch.cuda.is_available():
                raise UsageError("--device cuda, but no GPU is visible; use --device cpu")
            grid = _grid(args, device)
            warmup, iters, cap = _settings(args, device)
            if args.out:
                from cpbench.bench.outputs import open_out

                open_out(args.out)
        except (OSError, UsageError) as e:
            return cli_args.fail(PROG, e)
        from cpbench.bench import kernelrun
        from cpbench.report import kernels as kernel_report

        records, skipped = kernelrun.run_grid(grid, device=device, warmup=warmup, iters=iters,
                                              capacity_bytes=cap, out=args.out)
    text = kernel_report.render_kernels(records, args.format, skipped=skipped,
                                        baseline=args.baseline)
    if args.out and args.format in ("table", "markdown"):
        text += f"records: {args.out}\n"
    sys.stdout.write(text)
    return 1 if any(r["status"] == "failed" for r in records) else 0
