"""``cpbench sweep``: run a YAML sweep, one launch per case, resumable.

Run every case of a sweep config (configs/*.yaml) in its own launch, appending to one JSONL
file; cases already recorded ok are skipped. With --run, `cpbench run` flags instead, one
launch per strategy.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from typing import TYPE_CHECKING

from cpbench.cli.args import (
    USAGE_ERROR,
    Parser,
    command,
    converter,
    fail,
    given,
    read_number,
    say,
)
from cpbench.errors import UsageError

if TYPE_CHECKING:
    from cpbench.sweep import Sweep

PROG = "cpbench sweep"


def add_parser(sub) -> None:
    p = command(sub, "sweep", __doc__, main)
    p.add_argument("config", metavar="CONFIG.yaml", nargs="?")
    p.add_argument("--out", metavar="FILE.jsonl",
                   help="results file (appended to; read first to skip finished cases); "
                        "with --run it may come among the run flags")
    p.add_argument("--rerun-failed", action="store_true",
                   help="also retry cases recorded failed / OOM / timeout")
    p.add_argument("--timeout", type=converter(read_number(float), "a number"), metavar="SECONDS",
                   help="per-case time limit, overriding the config's")
    p.add_argument("--launcher", metavar="CMD",
                   help="command prefix that starts `-m cpbench.run` for each case, e.g. "
                        "'srun ... torchrun --nnodes 4 --nproc-per-node 8 ...'")
    p.add_argument("--entry", metavar="SCRIPT",
                   help="a torchrun script each launch runs instead of `-m cpbench.run`")
    p.add_argument("--nodes", type=int, metavar="N",
                   help="with --run: the torchrun job's nodes (default: --nproc local ranks)")
    p.add_argument("--gpus-per-node", type=int, metavar="G",
                   help="with --run and --nodes: ranks per node (default: the GPUs visible)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate and print each case's command line; run nothing")
    p.add_argument("--run", nargs=argparse.REMAINDER, metavar="RUN_FLAGS",
                   help="last: `cpbench run` flags, run as one case per strategy (what "
                        "scripts/slurm/cpbench.sbatch does)")


def _run_request(flags: list[str]) -> tuple[dict, str | None]:
    """(the settings given, --out) of ``cpbench run`` flags, read by `cpbench run`'s parser."""
    from cpbench import models
    from cpbench.cli import run as cli_run

    made = []

    class _Sub:  # cli.run.add_parser's `sub`: `cpbench run`'s parser, under this name
        def add_parser(self, name, help=None, **kw):
            made.append(Parser(prog=f"{PROG} --run", **kw))
            return made[-1]

    cli_run.add_parser(_Sub())
    settings = {k: v for k, v in given(made[0].parse_args(flags)).items() if k != "func"}
    name = settings.pop("model", None)
    settings, overrides = models.resolve(name, settings)
    if name is not None:
        say(models.note(name, overrides))
    return settings, settings.pop("out", None)


def _gpus_here() -> int:
    import torch

    count = torch.cuda.device_count()
    if not count:
        raise UsageError("no GPU visible to count ranks per node: give --gpus-per-node")
    return count


def _load(args):
    """(the sweep, --out) from CONFIG or from --run's flags."""
    from cpbench import sweep

    if (args.config is None) == (args.run is None):
        raise UsageError("give a sweep config or --run with `cpbench run` flags (one of them)")
    if args.run is None:
        if args.nodes is not None or args.gpus_per_node is not None:
            raise UsageError("--nodes / --gpus-per-node go with --run; a config has topology:")
        return sweep.load(args.config), args.out
    if args.launcher and not args.nodes:
        raise UsageError("--run with --launcher starts torchrun jobs: give --nodes (and "
                         "--gpus-per-node) so the rows are planned as the job plans them")
    settings, out = _run_request(args.run)
    gpus = args.gpus_per_node or (_gpus_here() if args.nodes else None)
    return sweep.per_strategy(settings, args.nodes, gpus), args.out or out


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A sweep as `cpbench sweep` will run it: every case validated, each launch's line."""

    config: Sweep
    out: str
    commands: list[list[str]]
    entry: tuple[str, ...]
    preview: bool  # the launcher is the Slurm job's, with placeholders (PREVIEW_NOTE)


def prepare(args) -> Prepared:
    """Validate the whole sweep and build each launch's command line; UsageError (SweepError:
    every problem, one a line) on bad input. A dry run of a multi-node config without
    --launcher shows the launches the sbatch script would start (``slurm.sweep_launcher``)."""
    from cpbench import slurm, sweep

    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    config, out = _load(args)
    if out is None or out.lower() == "none":
        raise UsageError("give --out FILE.jsonl: the sweep reads it to skip finished cases")
    entry = (args.entry,) if args.entry else sweep.ENTRY
    launcher, preview = args.launcher, False
    if args.dry_run and not launcher and (config.nodes or 0) > 1:
        launcher = slurm.sweep_launcher(slurm.preview_world(config.nodes, config.gpus_per_node))
        preview = True
    commands = [sweep.command(config, case, out, launcher, entry=entry) for case in config.cases]
    return Prepared(config=config, out=out, commands=commands, entry=entry, preview=preview)


def dry_run_lines(prepared: Prepared) -> list[str]:
    """What ``--dry-run`` prints: each case's launch, as it would run."""
    from cpbench import slurm

    lines = [f"[{case.index}] {case.label}: {shlex.join(cmd)}"
             for case, cmd in zip(prepared.config.cases, prepared.commands)]
    if prepared.preview:
        lines[:0] = [f"# each case's launch on {prepared.config.nodes} nodes, as "
                     f"scripts/slurm/cpbench.sbatch starts it", f"# {slurm.PREVIEW_NOTE}"]
    return lines


def main(args) -> int:
    from cpbench import sweep

    try:
        prepared = prepare(args)
    except sweep.SweepError as e:
        # every error, one line each (the cases with one error grouped on its line)
        sys.stderr.write("".join(f"{PROG}: error: {line}\n" for line in e.errors))
        return USAGE_ERROR
    except UsageError as e:
        return fail(PROG, e)
    if args.dry_run:
        sys.stdout.write("".join(line + "\n" for line in dry_run_lines(prepared)))
        return 0
    config, out, entry = prepared.config, prepared.out, prepared.entry
    try:
        return sweep.run(config, out, rerun_failed=args.rerun_failed,
                         timeout=args.timeout, launcher=args.launcher, entry=entry)
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted; the running case was stopped (rows it had "
                         f"finished are kept, the rest not recorded); re-run the same command "
                         f"to finish the missing cases\n")
        return 130
    except (OSError, UsageError) as e:  # e.g. an --out that is damaged or not writable
        return fail(PROG, e)
