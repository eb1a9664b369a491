"""``cpbench dryrun``: run every rank's real code on fake tensors: memory, bytes, host syncs,
errors (no GPU needed).

Execute a cpbench run case's real code path rank by rank on fake tensors with a fake process
group: peak memory of FWD and FWD+BWD, bytes per collective, host syncs and errors with their
file and line. No timing.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from cpbench.cli import args as cli_args
from cpbench.config import FORMATS, AttentionConfig, default_attention
from cpbench.errors import UsageError
from cpbench.settings import attention_settings

if TYPE_CHECKING:
    from cpbench.sim.dryrun import Request

PROG = "cpbench dryrun"


def add_parser(sub) -> None:
    p = cli_args.command(sub, "dryrun", __doc__, main)
    attention = p.add_argument_group("attention problem (defaults: run's, per device)")
    cli_args.add_model(attention)
    cli_args.add_settings(attention, attention_settings(), cli_args.attention_default)
    g = p.add_argument_group("where")
    integer = cli_args.converter(cli_args.read_number(int), "an integer")
    g.add_argument("--device", choices=("cuda", "cpu"),
                   help="fake tensors on this device (default cuda when this torch is a CUDA "
                        "build, else cpu)")
    g.add_argument("--hardware", metavar="PRESET|FILE.yaml",
                   help="the device's memory and the simulator's estimate (a `cpbench "
                        "simulate` preset; default a800-sxm on cuda; on cpu this machine's "
                        "memory per rank)")
    g.add_argument("--nodes", type=integer, help="nodes (default: the preset's, or 1)")
    g.add_argument("--gpus-per-node", type=integer,
                   help="ranks per node (default: the preset's, or 8)")
    g.add_argument("--ranks", type=cli_args.converter(_read_ranks, "ranks"), metavar="R[,R...]",
                   help="run these ranks (default: every rank whose role differs)")
    s = p.add_argument_group("what")
    s.add_argument("--strategy", type=cli_args.converter(cli_args.strategy_names, "names"),
                   default=("all",), metavar="NAME[,NAME...]|all",
                   help="strategies (default all)")
    s.add_argument("--kernel", default="auto", help="attention kernel (as run's)")
    s.add_argument("--fwd-only", action="store_true", help="the forward alone")
    s.add_argument("--seed", type=integer, default=0, help="seed of --documents sampling")
    s.add_argument("--format", choices=FORMATS, default="table")
    s.add_argument("--out", metavar="FILE.jsonl", help="append one record per case")
    cli_args.add_strategy_options(p, {x.name for x in attention_settings()})


def _read_ranks(text: str) -> tuple[int, ...]:
    read = cli_args.read_number(int)
    return tuple(read(t) for t in text.split(",") if t.strip())


def main(args) -> int:
    from cpbench.report import console

    with console.transient_progress():
        try:
            return _dryrun(args)
        except (OSError, UsageError) as e:
            return cli_args.fail(PROG, e)


def _device(args) -> str:
    import torch

    built = torch.backends.cuda.is_built()
    device = args.device or ("cuda" if built else "cpu")
    if device == "cuda" and not built:
        raise UsageError(f"--device cuda needs a CUDA build of torch ({torch.__version__} is "
                         "not); use --device cpu")
    from cpbench import torchcompat

    if why := torchcompat.dry_run_unavailable(device):
        raise UsageError(f"{why}; or use cpbench simulate")
    return device


def _capacity(args, device: str, gpn: int, hw) -> int | None:
    from cpbench.bench.memory import capacity_bytes

    if args.hardware is None and device == "cpu":
        return capacity_bytes("cpu", gpn)
    return int(hw.memory_gib * 2**30)


def request(args) -> Request:
    """The validated request; UsageError (one line, the fix) before anything runs."""
    from cpbench import kernels
    from cpbench.bench.cases import request
    from cpbench.config import resolved_documents
    from cpbench.sim import hardware
    from cpbench.sim.dryrun import Request, cases_for
    from cpbench.topology import Topology

    device = _device(args)
    hw = hardware.load(args.hardware or "a800-sxm") if args.hardware or device == "cuda" \
        else None
    nodes = args.nodes or (hw.nodes if hw else 1)
    gpn = args.gpus_per_node or (hw.gpus_per_node if hw else 8)
    if nodes < 1 or gpn < 1:
        raise UsageError(f"--nodes and --gpus-per-node must be >= 1, got {nodes} x {gpn}")
    topo = Topology(world_size=nodes * gpn, ranks_per_node=gpn)
    bad = [r for r in args.ranks or () if not 0 <= r < topo.world_size]
    if bad:
        raise UsageError(f"--ranks {bad[0]} is not a rank of {topo.world_size}; give ranks "
                         f"from 0 to {topo.world_size - 1}")
    given, options = cli_args.problem(args)
    given = {k: v for k, v in given.items() if k in AttentionConfig.__dataclass_fields__}
    attn = AttentionConfig(**resolved_documents({**default_attention(device), **given},
                                                args.seed))
    notes: list[str] = []
    backend = kernels.resolve(args.kernel, **request(attn, device), notes=notes)
    cases, skipped = cases_for(args.strategy, options, attn, topo, backend, device,
                               auto=args.kernel == kernels.AUTO)
    if args.out:
        from cpbench.bench.outputs import open_out

        open_out(args.out)
    return Request(attn=attn, topo=topo, cases=tuple(cases), kernel=backend.name,
                   device=device, capacity_bytes=_capacity(args, device, gpn, hw),
                   hardware=hw, ranks=args.ranks, fwd_only=args.fwd_only,
                   skipped=(*notes, *skipped))


def _dryrun(args) -> int:
    from cpbench import results
    from cpbench.report import console
    from cpbench.sim import dryrun

    req = request(args)
    env = dryrun.env_of(req)
    summaries, every = [], []
    for i, case in enumerate(req.cases, 1):
        with console.Ticker(f"dryrun [{i}/{len(req.cases)}] {case.label}") as ticker:
            rows = dryrun.run_case(req, case, say=ticker.set)
        every += rows
        summaries.append(dryrun.summarize(req, case, rows))
        if args.out:
            results.append(args.out, dryrun.record(req, case, rows, env))
    console.end_status()
    sys.stdout.write(_render(req, summaries, every, args.format))
    failed = any(r["status"] == results.FAILED for r in every)
    return 1 if failed else 0


def _render(req, summaries, every, fmt: str) -> str:
    from cpbench.sim import dryrun

    if fmt in ("json", "csv"):
        from cpbench.report.rows import data_text

        return data_text(dryrun.flat_rows(every), fmt, empty_header=("case",))
    a, t = req.attn, req.topo
    cap = "-" if req.capacity_bytes is None else f"{req.capacity_bytes / 2**30:.0f} GiB"
    banner = (f"dry run on fake {req.device} tensors ({req.kernel}): {t.num_nodes} node(s) × "
              f"{t.ranks_per_node}, S={a.seqlen} H={a.heads} D={a.head_dim}"
              f"{'' if a.v_head_dim is None else f'/{a.v_head_dim}'} {a.dtype}, "
              f"{cap} per rank; memory and bytes of the real code, no times")
    text = dryrun.render(summaries, fmt, banner)
    if req.skipped:
        text += "skipped:\n" + "".join(f"  {why}\n" for why in req.skipped)
    return text
