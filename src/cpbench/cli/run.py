"""``cpbench run``: run strategies and print the seed-format tables.

Run context-parallel attention strategies: check, time, measure memory; print seed-format
tables; append JSONL.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from cpbench import traces
from cpbench.cli import args as cli_args
from cpbench.config import AttentionConfig, RunConfig
from cpbench.errors import UsageError
from cpbench.settings import attention_settings, run_settings


def add_parser(sub) -> None:
    p = cli_args.command(sub, "run", __doc__, main,
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog="length traces for --documents trace:NAME (sources and "
                                "licences: src/cpbench/traces/README.md):\n"
                                + "\n".join(f"  {name:<14} {line}"
                                            for name, line in traces.lines()))
    attention = p.add_argument_group("attention problem")
    cli_args.add_model(attention)
    cli_args.add_settings(attention, attention_settings(), cli_args.attention_default)
    cli_args.add_settings(p.add_argument_group("run"), run_settings(), cli_args.run_default)
    reserved = {f.name for f in dataclasses.fields(AttentionConfig)} | \
        {f.name for f in dataclasses.fields(RunConfig)}
    cli_args.add_strategy_options(p, reserved)


def main(args) -> int:
    from cpbench.bench import entry
    from cpbench.bench import plan as planning
    from cpbench.bench.env import bind_local_gpu, under_torchrun
    from cpbench.launch import LaunchTimeout, RankError
    from cpbench.sim import comm_estimate

    launcher = "torchrun" if under_torchrun() else "self"
    bind_local_gpu()  # before the plan touches torch.cuda
    try:
        run, attention, options = cli_args.request(args)
        # on a GPU a simulator preset matches, the estimate counts what a step adds to its kernel
        plan = planning.plan(run, attention, options, launcher=launcher,
                             comm=comm_estimate.for_local_gpu())
    except UsageError as e:  # under torchrun rank 0 speaks; every rank tells its agent
        return cli_args.fail("cpbench run", e)
    if launcher == "torchrun":
        return entry.torchrun_main(plan)
    try:
        return entry.launch(plan)
    except (RankError, LaunchTimeout) as e:
        why = f"{e} (--deadline)" if isinstance(e, LaunchTimeout) else str(e)
        kept = f"; records written so far are in {plan.out}" if plan.out else ""
        sys.stderr.write(f"cpbench run: {why}{kept}\n")
        return 1
