"""``cpbench``: run benchmarks, list strategies, re-render results.

    cpbench run --strategy zigzag --seqlen 8k --nproc 4 --check     # local CPU ranks
    torchrun --nproc-per-node 8 -m cpbench.run --strategy all       # GPUs (same flags)
    cpbench strategies                                              # names, options
    cpbench models                                                  # --model presets
    cpbench report runs/…/results.jsonl --format markdown
    cpbench simulate --hardware a800-sxm --nodes 4 --seqlen 128K,512K  # predicted, no GPU
    cpbench dryrun --nodes 4 --seqlen 512K --device cpu             # every rank, fake tensors
    cpbench doctor                                                  # preflight a node

One module per command (``cli.run``, ``cli.sweep``, …), each with ``add_parser`` and ``main``;
its docstring is its help (``args.command``). The ``run`` flags are generated from the settings
schema (``cpbench.settings``: the config dataclasses and every registered strategy's
``Options``); values are validated by those dataclasses, the registry and the strategies
themselves. Bad input (a ``UsageError``) is one line on stderr saying the fix, exit status 2,
before any process starts or any collective runs.
"""

from __future__ import annotations

import sys

from cpbench.cli import (
    calibrate,
    comm,
    compare,
    doctor,
    dryrun,
    kernels,
    models,
    profile,
    report,
    run,
    simulate,
    strategies,
    sweep,
)
from cpbench.cli.args import Parser

COMMANDS = (run, sweep, simulate, dryrun, calibrate, kernels, comm, strategies, models, report,
            profile, compare, doctor)


def build_parser() -> Parser:
    parser = Parser(prog="cpbench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
