"""``cpbench sweep``: run a YAML sweep, one launch per case, resumable."""

from __future__ import annotations

import shlex
import sys

from cpbench.cli.args import USAGE_ERROR, converter, fail, read_number
from cpbench.errors import UsageError

PROG = "cpbench sweep"


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="run a YAML sweep, one launch per case, resumable",
                       description="Run every case of a sweep config (configs/*.yaml) in its "
                                   "own launch, appending to one JSONL file; cases already "
                                   "recorded ok are skipped.")
    p.add_argument("config", metavar="CONFIG.yaml")
    p.add_argument("--out", required=True, metavar="FILE.jsonl",
                   help="results file (appended to; read first to skip finished cases)")
    p.add_argument("--rerun-failed", action="store_true",
                   help="also retry cases recorded failed / OOM / timeout")
    p.add_argument("--timeout", type=converter(read_number(float), "a number"), metavar="SECONDS",
                   help="per-case time limit, overriding the config's")
    p.add_argument("--launcher", metavar="CMD",
                   help="command prefix that starts `-m cpbench.run` for each case, e.g. "
                        "'srun ... torchrun --nnodes 4 --nproc-per-node 8 ...'")
    p.add_argument("--dry-run", action="store_true",
                   help="validate and print each case's command line; run nothing")
    p.set_defaults(func=main)


def main(args) -> int:
    from cpbench import sweep

    try:
        if args.timeout is not None and args.timeout <= 0:
            raise UsageError(f"--timeout must be a positive number of seconds, "
                             f"got {args.timeout:g}")
        config = sweep.load(args.config)
        commands = [sweep.command(config, case, args.out, args.launcher)
                    for case in config.cases]
    except sweep.SweepError as e:
        sys.stderr.write(f"{PROG}: {e}\n")  # every error, one per line
        return USAGE_ERROR
    except UsageError as e:
        return fail(PROG, e)
    if args.dry_run:
        for case, cmd in zip(config.cases, commands):
            sys.stdout.write(f"[{case.index}] {case.label}: {shlex.join(cmd)}\n")
        return 0
    try:
        return sweep.run(config, args.out, rerun_failed=args.rerun_failed,
                         timeout=args.timeout, launcher=args.launcher)
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted; the running case was stopped (rows it had "
                         f"finished are kept, the rest not recorded); re-run the same command "
                         f"to finish the missing cases\n")
        return 130
    except (OSError, UsageError) as e:  # e.g. an --out that is damaged or not writable
        return fail(PROG, e)
