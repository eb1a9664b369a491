"""``cpbench models``: list the model presets of ``--model``, each with its source.

Each preset sets the attention problem of one published model's layer: heads, kv heads, the
Q/K and V head dims, the window, attention sinks and the dtype, every value from the model's
published config or paper, named with its fields.
"""

from __future__ import annotations

import sys
import textwrap

from cpbench.cli.args import command


def add_parser(sub) -> None:
    command(sub, "models", __doc__, main)


def main(args) -> int:
    from cpbench import models

    width = max(len(n) for n in models.PRESETS)
    lines = ["Model presets (--model NAME in run, sweep, dryrun, simulate; flags beside it "
             "override it):"]
    for p in models.PRESETS.values():
        lines.append(f"  {p.name:<{width}}  {p.shape()}  ({p.model})")
        lines += textwrap.wrap(f"source: {p.source}", 116 - width,
                               initial_indent=" " * (width + 4),
                               subsequent_indent=" " * (width + 6))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
