"""``cpbench profile``: group a profile's kernels; break a trace's steps down.

Where the time goes in a profile: kernels grouped by ordered regex rules (attention,
communication, gemm, elementwise, memory, other), and for a Chrome trace the step breakdown
with the exposed communication.
"""

from __future__ import annotations

import json
import sys

from cpbench.cli.args import command, fail
from cpbench.errors import UsageError

PROG = "cpbench profile"


def add_parser(sub) -> None:
    p = command(sub, "profile", __doc__, main)
    own = p.add_subparsers(dest="profile_command", required=True, parser_class=type(p))
    s = own.add_parser("summarize", help="the grouped table of one or more profiles",
                       description="Read a torch.profiler key_averages().table() text "
                                   "(host prefixes such as 'g43:' allowed), an nsys "
                                   "cuda_gpu_kern_sum export (tab-separated, CSV or columns) "
                                   "or a Chrome trace (.json / .json.gz); print each "
                                   "group's time, % of device time, calls, average and top "
                                   "kernels, and for a trace the step breakdown.")
    s.add_argument("files", nargs="+", metavar="FILE")
    s.add_argument("--every-rank", action="store_true",
                   help="summarize every rank trace given (default: of one case's rank "
                        "traces, rank*.trace.json.gz of one directory, the slowest rank's)")
    s.add_argument("--groups", metavar="FILE",
                   help="YAML rules (`rules:` list of {group, match}) read before the "
                        "shipped ones, so they win")
    s.add_argument("--format", choices=("table", "json"), default="table",
                   help="json: a list of objects (file, group, level, time_ms, percent, "
                        "calls, avg_ms, kernels); for a trace one more object per file, "
                        "{file, breakdown}")
    s.set_defaults(func=main)


def main(args) -> int:
    from cpbench.profile import groups, parsers, summary

    try:
        rules = groups.load(args.groups)
        read = {path: parsers.read(path) for path in args.files}
        chosen = {p: (prof, None) for p, prof in read.items()} if args.every_rank else \
            summary.slowest_ranks(read, rules)
        done = [summary.summarize(path, prof, rules, note)
                for path, (prof, note) in chosen.items()]
    except UsageError as e:  # every input read before any output: no half a report
        return fail(PROG, e)
    if args.format == "json":
        sys.stdout.write(json.dumps([o for _, objects in done for o in objects], indent=1)
                         + "\n")
    else:
        sys.stdout.write("\n".join(text for text, _ in done))
    return 0
