"""The argparse side of the settings schema: flags generated from ``cpbench.settings`` (the
config dataclasses and every strategy's ``Options``), and the one way every command reports
bad input (one line on stderr with the fix, exit 2)."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Callable

from cpbench import strategies
from cpbench.config import CPU_ATTENTION, GPU_ATTENTION, RunConfig, parse_names
from cpbench.errors import UsageError, near_miss
from cpbench.settings import Setting, split

USAGE_ERROR = 2
MAX_COLUMNS = 120  # a bad-input line fits a terminal this wide (the help pointer only if it fits)
OPT_PREFIX = "opt_"  # strategy options live under opt_<name> in the namespace


# on the namespace while parsing: the innermost parser that read the arguments (a command's),
# so that arguments it did not know are reported by it, with its flags to suggest
_READ_BY = "_cpbench_read_by"


class Parser(argparse.ArgumentParser):
    """argparse with cpbench's bad-input line (``usage_error``), no abbreviations (``--seq``
    is not ``--seqlen``), a "did you mean" for a flag it does not know, and flags added only
    when this parser reads arguments (``defer``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        # "-8k" is a (negative) value, not a flag: let the size parser reject it with the fix
        # rather than argparse saying "expected one argument"
        self._negative_number_matcher = re.compile(r"^-\d+[kKmMgG]?$|^-\d*\.\d+$")
        self._deferred: list[Callable[[], None]] = []

    def defer(self, add: Callable[[], None]) -> None:
        """Call ``add`` (which adds flags) when this parser is the one reading arguments:
        the strategy options import every strategy (and torch, seconds), which neither
        ``cpbench --help`` nor another command needs."""
        self._deferred.append(add)

    def _add_deferred(self, args) -> None:
        if not self._deferred:
            return
        if not {"-h", "--help"} & set(args):
            # the flags already here read first, so that a mistake among them (an unknown
            # strategy, a bad size) is answered before the deferred ones import torch
            super().parse_known_args(list(args), argparse.Namespace())
        for add in self._deferred:
            add()
        self._deferred.clear()

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        self._add_deferred(args)
        # a command's parser runs first (inside its parent's), so its mark is kept
        namespace, extras = super().parse_known_args(args, namespace)
        if not hasattr(namespace, _READ_BY):
            setattr(namespace, _READ_BY, self)
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        reader = vars(namespace).pop(_READ_BY, self)
        if extras:
            reader.error(f"unrecognized arguments: {' '.join(extras)}"
                         + reader.suggestion(extras))
        return namespace

    def suggestion(self, extras: list[str]) -> str:
        """`` (did you mean --seqlen?)`` for the unknown flags among ``extras`` that are near
        misses of this parser's own."""
        known = [o for o in self._option_string_actions if o.startswith("--") and o != "--help"]
        near = {}
        for word in extras:
            flag = word.split("=", 1)[0]
            if flag.startswith("--") and (hit := near_miss(flag, known)):
                near[flag] = hit
        if len(near) == 1:
            return f" (did you mean {next(iter(near.values()))}?)"
        return (" (did you mean " + ", ".join(near.values()) + "?)") if near else ""

    def error(self, message):  # one line with the fix, not argparse's usage block
        if len(f"{self.prog}: error: {message}") > MAX_COLUMNS and message.startswith("argument "):
            message = message.split(": ", 1)[1]  # "argument --x: ": the message names --x
        see = f" (see {self.prog} --help)"
        fits = len(f"{self.prog}: error: {message}{see}") <= MAX_COLUMNS and "see " not in message
        self.exit(usage_error(self.prog, message + see if fits else message))


class KeepLines(argparse.HelpFormatter):
    """Help text wrapped to the terminal, except text with line breaks of its own (a list in
    an epilog), which is kept as written."""

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return "\n".join(indent + line for line in text.splitlines())
        return super()._fill_text(text, width, indent)


def command(sub, name: str, doc: str, main, **kwargs) -> argparse.ArgumentParser:
    """Command ``name``'s parser, running ``main(args)``. Its help and description are its
    module's docstring ``doc``: the first paragraph, after "``cpbench NAME``: " and without
    the full stop, is the one line ``cpbench --help`` lists; the second (if any) is what
    ``cpbench NAME --help`` says first. ``kwargs``: more for ``add_parser``."""
    paras = [" ".join(p.split()) for p in doc.split("\n\n")]
    first, second = paras[0], (paras[1] if len(paras) > 1 else None)
    help = first.removeprefix(f"``cpbench {name}``: ").removesuffix(".")
    p = sub.add_parser(name, help=help, description=second, **kwargs)
    p.set_defaults(func=main)
    return p


def read_number(kind: type):
    """A reader of ``kind`` (int or float) from text, UsageError on bad text."""
    def read(text: str):
        try:
            return kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise UsageError(f"cannot read {text!r} as {what}") from None

    return read


def converter(read, what: str):
    """An argparse ``type`` reading a value with ``read`` (UsageError on bad text)."""
    def convert(text):
        try:
            return read(text)
        except UsageError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = what
    return convert


def strategy_names(text: str) -> tuple[str, ...]:
    """``--strategy``'s names (``zigzag``, ``ring,zigzag``, ``all``), each one checked against
    the registry's names (no strategy imported: ``strategies.check_names``)."""
    names = parse_names(text)
    strategies.check_names(names)
    return names


def add_setting(group, s: Setting, *, help: str | None = None, dest: str | None = None,
                choices: tuple | None = None) -> None:
    """``s`` as a flag: ``--x/--no-x`` for a bool, else one value read by ``s.from_text``."""
    dest, help = dest or s.name, s.help if help is None else help
    if s.type is bool:
        group.add_argument(s.flag, dest=dest, action=argparse.BooleanOptionalAction,
                           default=None, help=help)
        return
    choices = choices or s.choices
    read = strategy_names if s.name == "strategy" else s.from_text
    group.add_argument(s.flag, dest=dest, type=converter(read, s.what),
                       choices=choices, default=None,
                       metavar=s.metavar or (None if choices else s.name.upper()), help=help)


def attention_default(s: Setting) -> str | None:
    cpu, gpu = CPU_ATTENTION.get(s.name), GPU_ATTENTION.get(s.name)
    if s.name not in CPU_ATTENTION:
        return None
    return f"default {cpu} on CPU, {gpu} on GPU" if cpu != gpu else f"default {cpu}"


def run_default(s: Setting) -> str | None:
    if s.default is None or isinstance(s.default, bool):
        return None
    value = ",".join(s.default) if isinstance(s.default, tuple) else s.default
    return f"default {value}"


def add_settings(group, settings: list[Setting], defaults_note=None) -> None:
    for s in settings:
        note = defaults_note(s) if defaults_note else None
        add_setting(group, s, help=f"{s.help} ({note})" if note else s.help)


def option_usage(s: Setting) -> str:
    """How an option is written: ``--window WINDOW``, ``--placement {a,b}``, ``--x/--no-x``."""
    if s.type is bool:
        return f"{s.flag}/--no-{s.flag[2:]}"
    return f"{s.flag} " + (f"{{{','.join(map(str, s.choices))}}}" if s.choices
                           else s.name.upper())


def add_strategy_options(p, reserved: set[str]) -> None:
    """One flag per strategy option over every registered strategy (choices merged), added
    when ``p`` reads its arguments (they import every strategy: ``Parser.defer``)."""
    p.defer(lambda: _add_strategy_options(p, reserved))


def _add_strategy_options(p, reserved: set[str]) -> None:
    group = p.add_argument_group("strategy options (passed to the strategies that take them)")
    for opt, owners in strategies.option_settings().items():
        assert opt not in reserved, f"strategy option {opt!r} clashes with a run flag"
        first = owners[0][1]
        choices = tuple(dict.fromkeys(c for _, s in owners for c in s.choices or ()))
        where = "; ".join(f"{name}: default {s.default}" for name, s in owners)
        add_setting(group, first, help=f"{first.help} [{where}]", dest=OPT_PREFIX + opt,
                    choices=choices or None)


def given(args) -> dict:
    """The settings given on the command line, strategy options under their own names."""
    return {(k[len(OPT_PREFIX):] if k.startswith(OPT_PREFIX) else k): v
            for k, v in vars(args).items() if v is not None}


def add_model(p) -> None:
    """``--model NAME``: a preset's attention shape (``cpbench.models``) under the flags."""
    p.add_argument("--model", metavar="NAME",
                   help="set heads, kv heads, head dims, window, sinks and dtype from a model "
                        "preset (`cpbench models` lists them, with sources); attention flags "
                        "given beside it override it")


def problem(args) -> tuple[dict, dict]:
    """The AttentionConfig fields (a ``--model`` preset's under the flags given) and the
    strategy options given on the command line. With ``--model``, rank 0 says the preset
    and the flags that override it, in one line on stderr."""
    from cpbench import models

    _, attention, _ = split(given(args))
    name = getattr(args, "model", None)
    attention, overrides = models.resolve(name, attention)
    if name is not None:
        say(models.note(name, overrides))
    options = {k[len(OPT_PREFIX):]: v for k, v in vars(args).items()
               if k.startswith(OPT_PREFIX) and v is not None}
    return attention, options


def say(line: str) -> None:
    """One line on stderr from rank 0 (every rank parses the same flags under torchrun)."""
    from cpbench.bench import env

    if env.under_torchrun() and env.torchrun_world()[0] != 0:
        return
    sys.stderr.write(f"cpbench: {line}\n")


def request(args) -> tuple[RunConfig, dict, dict]:
    from cpbench import torchcompat

    if torchcompat.VERSION < torchcompat.FLOOR:  # before anything is built or launched
        raise UsageError(torchcompat.out_of_range() or "")
    run, _, _ = split(given(args))
    return (RunConfig(**run), *problem(args))


def usage_error(prog: str, message: str, more: tuple[str, ...] = ()) -> int:
    """Bad input: one line on stderr (after clearing a status line), exit status 2. Under
    torchrun every rank finds the same error: rank 0 says it, and each rank leaves it as its
    error file, so torchrun's failure summary names it as the root cause (torchrun itself
    then exits 1: the agent's status is its own, see ``bench.env.tell_torchrun``).
    ``more``: continuation lines (``UsageError.more``), indented."""
    from cpbench.bench import env

    line = "\n  ".join([f"{prog}: error: {' '.join(message.split())}",
                        *(" ".join(m.split()) for m in more)])
    if env.under_torchrun():
        if env.torchrun_world()[0] != 0:
            env.outlive_rank0()  # rank 0 speaks and exits first: torchrun stops the rest
            env.tell_torchrun(line)  # after rank 0's: the root cause torchrun names is rank 0
            return USAGE_ERROR
        env.tell_torchrun(line)
    # a status line on the terminal must not run into the error; only the console module
    # draws one, so none is there unless it was imported (not imported here: it imports torch)
    console = sys.modules.get("cpbench.report.console")
    if console is not None:
        console.end_status()
    sys.stderr.write(line + "\n")
    return USAGE_ERROR


def fail(prog: str, e: Exception) -> int:
    """Bad input ``e``: ``usage_error``'s one line (and ``e``'s continuation lines), exit
    status 2."""
    return usage_error(prog, str(e), getattr(e, "more", ()))
