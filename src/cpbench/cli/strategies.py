"""``cpbench strategies``: list every strategy, its description and options."""

from __future__ import annotations

import sys

from cpbench import strategies
from cpbench.cli.args import command, option_usage
from cpbench.settings import settings_of


def add_parser(sub) -> None:
    command(sub, "strategies", __doc__, main)


def _upstream_line(cls, device: str) -> str:
    """What library an adapter runs, its version here, and whether it can run here."""
    up = cls.upstream
    version = up.version()
    why = cls.unavailable(device)
    twin = f"; cpbench's own: {up.twin}" if up.twin else ""
    return (f"runs {up.package} {version or '(not installed)'}{twin}; "
            + (f"cannot run here: {why}" if why else f"runs here ({device})"))


def main(args) -> int:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lines = []
    for name in strategies.names():
        cls = strategies.get(name)
        lines.append(f"{name:<22} {cls.description}")
        if cls.upstream is not None:
            lines.append(f"{'':<24}{_upstream_line(cls, device)}")
        for s in settings_of(cls.Options):
            lines.append(f"{'':<24}{option_usage(s)}  default {s.default}: {s.help}")
        if cls.causal_only:
            lines.append(f"{'':<24}(causal attention only)")
        # beyond causal / full: --documents, --window-size; and --sinks
        takes = ["--" + m.replace("window", "window-size") for m in sorted(cls.masks)]
        takes += ["--sinks"] if cls.takes_sinks else []
        if takes:
            lines.append(f"{'':<24}takes {', '.join(takes)}")
        if cls.no_threads:
            lines.append(f"{'':<24}not with --launcher threads: {cls.no_threads}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
