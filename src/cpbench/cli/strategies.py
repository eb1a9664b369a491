"""``cpbench strategies``: every registered strategy, its description and options."""

from __future__ import annotations

import sys

from cpbench import strategies
from cpbench.cli.args import option_usage
from cpbench.settings import settings_of


def add_parser(sub) -> None:
    s = sub.add_parser("strategies", help="list every strategy, its description and options")
    s.set_defaults(func=main)


def main(args) -> int:
    lines = []
    for name in strategies.names():
        cls = strategies.get(name)
        lines.append(f"{name:<22} {cls.description}")
        for s in settings_of(cls.Options):
            lines.append(f"{'':<24}{option_usage(s)}  default {s.default}: {s.help}")
        if cls.causal_only:
            lines.append(f"{'':<24}(causal attention only)")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
