"""``cpbench compare``: is run B really slower than run A? case by case, with statistics.

Match the cases of two runs (strategy, resolved options, problem, topology, kernel) and, per
case and phase, compare the per-iteration step times: ratio of medians B/A with a bootstrap
interval, Mann-Whitney U test, Holm-corrected p-values, a verdict (slower / faster / same /
insufficient); what else changed between the runs; and, where both runs were profiled, which
parts of the step changed.

    cpbench compare A.jsonl B.jsonl                        # one results file per run
    cpbench compare --a a1.jsonl a2.jsonl --b b.jsonl      # a run in several files
"""

from __future__ import annotations

import hashlib
import logging
import sys
from pathlib import Path

from cpbench.cli.args import command, converter, fail, read_number
from cpbench.errors import UsageError

PROG = "cpbench compare"
FORMATS = ("table", "markdown", "json")


def add_parser(sub) -> None:
    p = command(sub, "compare", __doc__, main)
    p.add_argument("files", nargs="*", metavar="FILE.jsonl",
                   help="run A's results file, then run B's (or use --a / --b)")
    p.add_argument("--a", nargs="+", dest="a_files", metavar="FILE",
                   help="run A's results files (a run or sweep written to several)")
    p.add_argument("--b", nargs="+", dest="b_files", metavar="FILE",
                   help="run B's results files")
    p.add_argument("--alpha", type=converter(read_number(float), "alpha"), default=0.05,
                   help="significance level after Holm's correction (default 0.05)")
    p.add_argument("--min-effect", type=converter(read_number(float), "min-effect"),
                   default=0.02,
                   help="practical-equivalence band: slower / faster need the ratio's "
                        "interval outside 1 ± this (default 0.02, i.e. ±2 %%)")
    p.add_argument("--format", choices=FORMATS, default="table")
    p.add_argument("--wide", action="store_true",
                   help="every column of the tables (default: they fit the terminal, 120 "
                        "columns when it is not one)")
    p.add_argument("--plot", metavar="OUT.png",
                   help="also draw both runs' step-time distributions per case (needs "
                        "matplotlib)")
    p.add_argument("--seed", type=converter(read_number(int), "seed"), default=0,
                   help="bootstrap seed: the same seed gives the same intervals (default 0)")
    p.add_argument("--resamples", type=converter(read_number(int), "resamples"),
                   default=10_000, help="bootstrap resamples per test (default 10000)")


def _runs(args) -> tuple[list[str], list[str]]:
    """Run A's files and run B's, from the positional pair or --a / --b (not both)."""
    if args.a_files or args.b_files:
        if args.files or not (args.a_files and args.b_files):
            raise UsageError("give the runs either as two files (A B) or as --a FILE… "
                             "--b FILE…, not a mix")
        return args.a_files, args.b_files
    if len(args.files) != 2:
        raise UsageError(f"give two results files, A then B (got {len(args.files)}); for a "
                         f"run in several files use --a FILE… --b FILE…")
    return [args.files[0]], [args.files[1]]


def _check(args) -> None:
    if not 0 < args.alpha < 1:
        raise UsageError(f"--alpha {args.alpha:g} must lie between 0 and 1")
    if not 0 <= args.min_effect < 1:
        raise UsageError(f"--min-effect {args.min_effect:g} must be at least 0 and below 1")
    if args.resamples < 100:
        raise UsageError(f"--resamples {args.resamples} is too few for a 95 % interval; "
                         f"give 100 or more")
    if args.plot:
        from cpbench.report.plot import check_target

        check_target(args.plot)  # before any work: the fix, not half a report


def same_inputs(files_a: list[str], files_b: list[str]) -> str | None:
    """Why A and B are one run (the same files, or files with the same bytes), else None: a
    run compared with itself says "same" everywhere, which is no finding."""
    def digest(paths: list[str]) -> set[str]:
        return {hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}

    if {Path(p).resolve() for p in files_a} == {Path(p).resolve() for p in files_b}:
        return "A and B are the same file(s)"
    if digest(files_a) == digest(files_b):
        return "A and B hold the same bytes"
    return None


def _read(paths: list[str]) -> list[dict]:
    from cpbench import results

    records = []
    for path in paths:
        found = results.read(path)
        if not found:
            raise UsageError(f"{path}: no records; give a results file written by cpbench "
                             f"run, sweep or simulate")
        records += found
    return records


def main(args) -> int:
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(message)s",
                        stream=sys.stderr)
    from cpbench.compare import analysis, markdown, render

    try:
        files_a, files_b = _runs(args)
        _check(args)
        a_records, b_records = _read(files_a), _read(files_b)
        if why := same_inputs(files_a, files_b):
            sys.stderr.write(f"{PROG}: warning: {why}: the run is compared with itself\n")
        cmp = analysis.compare(a_records, b_records, alpha=args.alpha,
                               min_effect=args.min_effect, seed=args.seed,
                               resamples=args.resamples)
    except (OSError, UsageError) as e:
        return fail(PROG, e)
    if args.format == "json":
        sys.stdout.write(render.json_text(cmp))
    elif args.format == "markdown":
        sys.stdout.write(markdown.markdown(cmp, files_a, files_b))
    else:
        from cpbench.report.render import fitting, wide_width

        with fitting(wide_width(args.wide)):
            sys.stdout.write(render.table(cmp, files_a, files_b))
    if args.plot:
        from cpbench.compare import plot

        try:
            plot.plot(cmp, args.plot)
        except (OSError, UsageError) as e:
            return fail(PROG, e)
        sys.stderr.write(f"{PROG}: plot written to {args.plot}\n")
    return 0
