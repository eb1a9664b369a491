"""``cpbench report``: re-render the tables from JSONL records."""

from __future__ import annotations

import logging
import sys

from cpbench.cli.args import command, fail
from cpbench.config import FORMATS
from cpbench.errors import UsageError

PROG = "cpbench report"


def add_parser(sub) -> None:
    r = command(sub, "report", __doc__, main)
    r.add_argument("files", nargs="+", metavar="FILE.jsonl")
    r.add_argument("--format", choices=FORMATS, default="table")
    r.add_argument("--wide", action="store_true",
                   help="every column of every table, seed 001's full layout (default: tables "
                        "fit the terminal, 120 columns when it is not one: the columns every "
                        "row shares go to a line above, the least essential are hidden)")
    r.add_argument("--details", action="store_true",
                   help="with the run view: each case's block (configuration, performance, "
                        "checks, load balance, profile) before the summary, as `cpbench run "
                        "--details` printed it")
    r.add_argument("--view", choices=("auto", "run", "sweep"), default="auto",
                   help="run: the summary, as `cpbench run` printed it (--details: each "
                        "case's block before it); sweep: seed 001's tables grouped by strategy, "
                        "then a pivot by Seq Len; auto: run when every record is from one run, "
                        "else sweep")
    r.add_argument("--compare", choices=("placement", "upstream"),
                   help="placement: one table, a row per strategy variant (windows, "
                        "degrees), a column per topology, each strategy's winner and its "
                        "margin over the next placement; upstream: each of "
                        "cpbench's strategies beside its upstream twin (zigzag / rfa-zigzag, "
                        "usp / yunchang-usp, …) on the same problem, with the time ratio")
    r.add_argument("--best", action="store_true",
                   help="for each problem (mask, sequence, topology, kernel) the fastest "
                        "strategy, its margin over the runner-up, and wins / tie / unclear "
                        "against the band 1 ± --min-effect; with --plot, a winner map")
    r.add_argument("--accuracy", action="store_true",
                   help="the errors of every --check against the float64 reference: per "
                        "tensor (out, lse, dq, dk, dv) the max and the RMS relative error, a "
                        "row per strategy, rank count, dtype and mask")
    r.add_argument("--min-effect", type=float, default=0.02,
                   help="with --best: the equivalence band; a tie only when the interval of "
                        "runner-up / winner lies inside 1 ± this, a win only above it "
                        "(default 0.02, as cpbench compare)")
    r.add_argument("--plot", metavar="OUT.png",
                   help="also draw TFLOPs/s per GPU (per rank on CPUs) against Seq Len, a "
                        "panel per topology and at most 8 lines a panel (needs matplotlib); "
                        "with --best the winner map (problem × topology); with --compare "
                        "placement one panel: each placement's time over its strategy's "
                        "fastest")


def _records(args) -> list[dict]:
    """Every record of the files; the request checked before any output."""
    from cpbench import results, rounds

    # --rounds K: every view shows a case's rounds as one row, all their iterations pooled
    records = rounds.pool([r for path in args.files for r in results.read(path)])
    if args.accuracy and (args.best or args.compare or args.plot):
        raise UsageError("--accuracy prints its own table: drop --best, --compare and --plot")
    if args.best and (args.compare or args.format not in ("table", "markdown")):
        raise UsageError("--best prints a table of winners; use --format table or markdown "
                         "and no --compare")
    if args.compare and args.format not in ("table", "markdown"):
        raise UsageError(f"--compare prints tables; use --format table or markdown, not "
                         f"{args.format}")
    if not 0 <= args.min_effect < 1:
        raise UsageError(f"--min-effect {args.min_effect:g} must be at least 0 and below 1")
    if args.plot:
        from cpbench.report import plot

        plot.check_target(args.plot)  # before any output: the fix, not half a report
    return records


def _text(args, records: list[dict]) -> str:
    from cpbench import report
    from cpbench.report import kernels

    if kernels.is_kernel_bench(records):  # a `cpbench kernels` file: its own table
        return kernels.render_kernels(records, args.format)

    sweep_view = args.view == "sweep" or (args.view == "auto" and records
                                          and not report.sweep.one_launch(records))
    if args.accuracy:
        from cpbench.report.accuracy import accuracy_table

        return accuracy_table(records, args.format)
    if args.best:
        from cpbench.report.best import best_table

        return best_table(records, args.format, args.min_effect)
    if args.compare:
        from cpbench.report.upstream import compare_upstream

        note = report.tables.simulated_note(records)
        from cpbench.report.placements import placement_view

        view = placement_view if args.compare == "placement" else compare_upstream
        return (f"Compared{note}\n\n" if note else "") + view(records, args.format)
    if sweep_view and args.format in ("table", "markdown"):
        return report.sweep.sweep_report(records, args.format)
    # csv / json: every row, whatever the view
    return report.report(records, args.format, details=args.details)


def main(args) -> int:
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(message)s",
                        stream=sys.stderr)
    from cpbench.report.render import fitting, wide_width

    try:
        records = _records(args)
    except (OSError, UsageError) as e:
        return fail(PROG, e)
    with fitting(wide_width(args.wide)):
        text = _text(args, records)
        if args.format in ("table", "markdown"):  # no simulated figure without its evidence
            from cpbench.report import tables
            from cpbench.report.render import prose

            text += "".join(f"{x}\n" for x in prose(tables.evidence_lines(records)))
        sys.stdout.write(text)
    if args.plot:
        from cpbench.report import plot, tables

        try:
            if args.best:
                from cpbench.report.best import plot_winners

                plot_winners(records, args.plot, args.min_effect)
                sys.stderr.write(f"{PROG}: winner map written to {args.plot}\n")
                return 0
            note = tables.simulated_note(records).strip(" ()") or None
            if args.compare == "placement":  # one panel: the placements' differences
                from cpbench.report import placements

                placements.plot(records, args.plot, note)
                sys.stderr.write(f"{PROG}: plot written to {args.plot}\n")
                return 0
            plot.plot(records, args.plot, title_note=note)
            if plot.plot_breakdown(records, plot.breakdown_path(args.plot)):
                sys.stderr.write(f"{PROG}: breakdown written to "
                                 f"{plot.breakdown_path(args.plot)}\n")
        except (OSError, UsageError) as e:
            return fail(PROG, e)
        sys.stderr.write(f"{PROG}: plot written to {args.plot}\n")
    return 0
