"""``cpbench comm``: trace every torch.distributed call of one forward + backward, per strategy,
phase, op and dtype.

Run one forward + backward of each strategy on local ranks with every torch.distributed call
traced; print calls and bytes per phase, op and dtype, summed over ranks (cpbench's strategies
and the upstream ones alike).
"""

from __future__ import annotations

import json
import sys

from cpbench.cli import args as cli_args
from cpbench.config import RunConfig
from cpbench.errors import UsageError
from cpbench.settings import attention_settings, run_settings

PROG = "cpbench comm"
# the run settings that mean something here (no timing, no check, no records)
RUN_FLAGS = ("strategy", "kernel", "nproc", "ranks_per_node", "seed", "collective_timeout")


def add_parser(sub) -> None:
    p = cli_args.command(sub, "comm", __doc__, main)
    cli_args.add_settings(p.add_argument_group("attention problem"), attention_settings(),
                          cli_args.attention_default)
    cli_args.add_settings(p.add_argument_group("run"),
                          [s for s in run_settings() if s.name in RUN_FLAGS],
                          cli_args.run_default)
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--steps", action="store_true",
                   help="per rank, phase and kernel step, each call (one strategy only)")
    cli_args.add_strategy_options(p, {s.name for s in attention_settings()} |
                                  {s.name for s in run_settings()})


def _plan(args):
    from cpbench.bench import plan as planning

    run, attention, options = cli_args.request(args)
    run = RunConfig(**{**{k: getattr(run, k) for k in RUN_FLAGS}, "out": "none",
                       "warmup": 0, "iters": 1})
    p = planning.plan(run, attention, options, launcher="self", baseline_both_ends=False)
    if args.steps and len(p.cases) != 1:
        raise UsageError(f"--steps lists one case's calls; {len(p.cases)} cases were asked "
                         f"for: give one --strategy (and its options)")
    return p


def _table(rows: list[dict]) -> str:
    from cpbench.report import tables

    cells = [{"Strategy": r["strategy"], "Phase": r["phase"], "Op": r["op"],
              "Dtype": r["dtype"], "Calls": str(r["calls"]), "Bytes": f"{r['bytes']:,}"}
             for r in rows]
    return "\n".join(tables.render("Communication per step, summed over ranks", cells,
                                   "table")) + "\n" if cells else "nothing sent\n"


def main(args) -> int:
    from cpbench.bench import commrun
    from cpbench.launch import LaunchTimeout, RankError, run_ranks

    try:
        p = _plan(args)
    except UsageError as e:
        return cli_args.fail(PROG, e)
    try:
        found = run_ranks(commrun.rank_comm, p.world_size, p, timeout=None,
                          collective_timeout=p.init_timeout)[0]
    except (RankError, LaunchTimeout) as e:
        sys.stderr.write(f"{PROG}: {e}\n")
        return 1
    failed = [c for c in found if c["error"]]
    for c in failed:
        sys.stderr.write(f"{PROG}: {c['strategy']}: {c['error']}\n")
    if args.steps:
        sys.stdout.write("\n".join(commrun.steps(found[0])) + "\n")
    elif args.format == "json":
        sys.stdout.write(json.dumps(commrun.summarize(found), indent=1) + "\n")
    else:
        sys.stdout.write(_table(commrun.summarize(found)))
    return 1 if failed else 0
