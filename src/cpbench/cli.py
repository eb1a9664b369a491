"""``cpbench``: run benchmarks, list strategies, re-render results.

    cpbench run --strategy zigzag --seqlen 8k --nproc 4 --check     # local CPU ranks
    torchrun --nproc-per-node 8 benchmarks/run.py --strategy all     # GPUs (same flags)
    cpbench strategies                                              # names, options
    cpbench report runs/…/results.jsonl --format markdown
    cpbench simulate --hardware a800-sxm --nodes 4 --seqlen 128K,512K  # predicted, no GPU

The ``run`` flags are generated from the config dataclasses (``AttentionConfig``,
``RunConfig``) and from every registered strategy's ``Options``; values are validated by
those dataclasses, the registry and the strategies themselves. Bad input is one line on
stderr saying the fix, exit status 2, before any process starts or any collective runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import sys
import types
import typing

from cpbench import strategies
from cpbench.config import (ATTENTION_HELP, ATTENTION_PARSE, CPU_ATTENTION, DTYPES, FORMATS,
                            GPU_ATTENTION, AttentionConfig, RunConfig, flag, parse_names,
                            parse_size)

USAGE_ERROR = 2
_OPT_PREFIX = "opt_"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # "-8k" is a (negative) value, not a flag: let the size parser reject it with the fix
        # rather than argparse saying "expected one argument"
        self._negative_number_matcher = re.compile(r"^-\d+[kKmMgG]?$|^-\d*\.\d+$")

    def error(self, message):  # one line with the fix, not argparse's usage block
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _base_type(annotation):
    """int for ``int | None``; the annotation itself otherwise."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


def _converter(parse, what: str):
    def convert(text):
        try:
            return parse(text)
        except (TypeError, ValueError) as e:
            if parse in (int, float):
                raise argparse.ArgumentTypeError(f"cannot read {text!r} as {what}") from None
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = what
    return convert


def _add_field(group, name: str, typ, help: str, *, choices=None, parse=None, metavar=None,
               dest: str | None = None):
    dest = dest or name
    if typ is bool:
        group.add_argument(flag(name), dest=dest, action=argparse.BooleanOptionalAction,
                           default=None, help=help)
        return
    parse = parse or typ
    what = {int: "an integer", float: "a number"}.get(parse, typ.__name__)
    group.add_argument(flag(name), dest=dest, type=_converter(parse, what), choices=choices,
                       default=None, metavar=metavar or (None if choices else name.upper()),
                       help=help)


def _add_dataclass(group, cls, *, help_map=None, parse_map=None, choices_map=None,
                   defaults_note=None):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        help = meta.get("help") or (help_map or {}).get(f.name, "")
        note = defaults_note(f) if defaults_note else None
        if note:
            help = f"{help} ({note})"
        choices = meta.get("choices") or (choices_map or {}).get(f.name)
        _add_field(group, f.name, _base_type(hints[f.name]), help, choices=choices,
                   parse=meta.get("parse") or (parse_map or {}).get(f.name),
                   metavar=meta.get("metavar"))


def _options_of(cls) -> list[tuple[dataclasses.Field, type]]:
    """A strategy's option fields, each with its type (``int`` for ``int | None``)."""
    hints = typing.get_type_hints(cls.Options)
    return [(f, _base_type(hints[f.name])) for f in dataclasses.fields(cls.Options)]


def _strategy_options() -> dict[str, list[tuple[str, dataclasses.Field, type]]]:
    """Option name → [(strategy, field, type)] over every registered strategy."""
    found: dict[str, list] = {}
    for name in sorted(strategies.names()):
        for f, typ in _options_of(strategies.get(name)):
            found.setdefault(f.name, []).append((name, f, typ))
    return found


def _option_usage(name: str, typ, choices) -> str:
    """How an option is written: ``--window WINDOW``, ``--placement {a,b}``, ``--x/--no-x``."""
    if typ is bool:
        return f"{flag(name)}/--no-{flag(name)[2:]}"
    return f"{flag(name)} " + (f"{{{','.join(map(str, choices))}}}" if choices
                               else name.upper())


def _attention_default(f) -> str | None:
    cpu, gpu = CPU_ATTENTION.get(f.name), GPU_ATTENTION.get(f.name)
    if f.name not in CPU_ATTENTION:
        return None
    return f"default {cpu} on CPU, {gpu} on GPU" if cpu != gpu else f"default {cpu}"


def _run_default(f) -> str | None:
    if f.default is None or isinstance(f.default, bool):
        return None
    value = ",".join(f.default) if isinstance(f.default, tuple) else f.default
    return f"default {value}"


def _run_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("run", help="run strategies and print the seed-format tables",
                       description="Run context-parallel attention strategies: check, time, "
                                   "measure memory; print seed-format tables; append JSONL.")
    _add_dataclass(p.add_argument_group("attention problem"), AttentionConfig,
                   help_map=ATTENTION_HELP, parse_map=ATTENTION_PARSE,
                   choices_map={"dtype": tuple(DTYPES)}, defaults_note=_attention_default)
    _add_dataclass(p.add_argument_group("run"), RunConfig, defaults_note=_run_default)
    reserved = {f.name for f in dataclasses.fields(AttentionConfig)} | \
        {f.name for f in dataclasses.fields(RunConfig)}
    _add_strategy_options(p, reserved)
    p.set_defaults(func=cmd_run)
    return p


def _add_strategy_options(p, reserved: set[str]) -> None:
    group = p.add_argument_group("strategy options (passed to the strategies that take them)")
    for opt, owners in _strategy_options().items():
        assert opt not in reserved, f"strategy option {opt!r} clashes with a run flag"
        typ = owners[0][2]
        choices = tuple(dict.fromkeys(c for _, f, _ in owners
                                      for c in f.metadata.get("choices") or ()))
        where = "; ".join(f"{s}: default {f.default}" for s, f, _ in owners)
        help = f"{owners[0][1].metadata.get('help', '')} [{where}]"
        _add_field(group, opt, typ, help, choices=choices or None, dest=_OPT_PREFIX + opt)


def _parse_sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(t) for t in text.split(",") if t.strip()) or (parse_size(text),)


def _simulate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("simulate", help="predict the run tables for a GPU cluster (no GPU needed)",
                       description="Predict FWD / FWD+BWD time, memory and TFLOPs per GPU of "
                                   "each strategy on a cluster from the strategies' own "
                                   "schedules and a hardware preset (configs/hardware/).")
    attention = p.add_argument_group("attention problem (default: seed 001's)")
    for f in dataclasses.fields(AttentionConfig):
        if f.name == "seqlen":
            attention.add_argument("--seqlen", type=_converter(_parse_sizes, "sizes"),
                                   metavar="S[,S...]", help="global sequence length(s), e.g. "
                                   f"128K,256K,512K (default {GPU_ATTENTION['seqlen']})")
        else:
            _add_field(attention, f.name, _base_type(typing.get_type_hints(AttentionConfig)
                                                     [f.name]), ATTENTION_HELP[f.name],
                       choices=tuple(DTYPES) if f.name == "dtype" else None)
    g = p.add_argument_group("cluster")
    g.add_argument("--hardware", default="a800-sxm", metavar="PRESET|FILE.yaml",
                   help="hardware preset (configs/hardware/<name>.yaml) or a YAML file "
                        "(default a800-sxm)")
    g.add_argument("--nodes", type=_converter(int, "an integer"),
                   help="nodes (default: the preset's)")
    g.add_argument("--gpus-per-node", type=_converter(int, "an integer"),
                   help="GPUs per node (default: the preset's)")
    s = p.add_argument_group("what to simulate")
    s.add_argument("--strategy", type=_converter(parse_names, "names"), default=("all",),
                   metavar="NAME[,NAME...]|all", help="strategies (default all)")
    s.add_argument("--compare-placements", action="store_true",
                   help="every valid placement / split / window of the strategies side by "
                        "side, fastest first")
    s.add_argument("--validate", metavar="FILE.csv",
                   help="predict published rows (configs/validation/*.csv) and print the "
                        "relative errors; ignores the other flags but --hardware")
    s.add_argument("--plot", metavar="OUT.png",
                   help="also draw TFLOPs/s per GPU against Seq Len (needs matplotlib)")
    s.add_argument("--format", choices=FORMATS, default="table")
    s.add_argument("--out", metavar="FILE.jsonl",
                   help="also append the predictions as result records (marked simulated; "
                        "`cpbench report` re-renders them, beside measured ones)")
    _add_strategy_options(p, {f.name for f in dataclasses.fields(AttentionConfig)})
    p.set_defaults(func=cmd_simulate)
    return p


def _sweep_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("sweep", help="run a YAML sweep, one launch per case, resumable",
                       description="Run every case of a sweep config (configs/*.yaml) in its "
                                   "own launch, appending to one JSONL file; cases already "
                                   "recorded ok are skipped.")
    p.add_argument("config", metavar="CONFIG.yaml")
    p.add_argument("--out", required=True, metavar="FILE.jsonl",
                   help="results file (appended to; read first to skip finished cases)")
    p.add_argument("--rerun-failed", action="store_true",
                   help="also retry cases recorded failed / OOM / timeout")
    p.add_argument("--timeout", type=_converter(float, "a number"), metavar="SECONDS",
                   help="per-case time limit, overriding the config's")
    p.add_argument("--launcher", metavar="CMD",
                   help="command prefix that starts benchmarks/run.py for each case, e.g. "
                        "'srun ... torchrun --nnodes 4 --nproc-per-node 8 ...'")
    p.add_argument("--dry-run", action="store_true",
                   help="validate and print each case's command line; run nothing")
    p.set_defaults(func=cmd_sweep)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cpbench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _run_parser(sub)
    _sweep_parser(sub)
    _simulate_parser(sub)
    s = sub.add_parser("strategies", help="list every strategy, its description and options")
    s.set_defaults(func=cmd_strategies)
    r = sub.add_parser("report", help="re-render the tables from JSONL records")
    r.add_argument("files", nargs="+", metavar="FILE.jsonl")
    r.add_argument("--format", choices=FORMATS, default="table")
    r.add_argument("--view", choices=("auto", "run", "sweep"), default="auto",
                   help="run: each detail block and the summary, as `cpbench run` printed "
                        "them; sweep: seed 001's tables grouped by strategy, then a pivot by "
                        "Seq Len; auto: run when every record is from one run, else sweep")
    r.add_argument("--compare", choices=("placement",),
                   help="each strategy's placements (windows, degrees) side by side per "
                        "topology, with their TFLOPs ratio")
    r.add_argument("--plot", metavar="OUT.png",
                   help="also draw TFLOPs/s per GPU against Seq Len (needs matplotlib)")
    r.set_defaults(func=cmd_report)
    return parser


def _problem(args) -> tuple[dict, dict]:
    """The AttentionConfig fields and the strategy options given on the command line."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    attention = {f.name: given[f.name] for f in dataclasses.fields(AttentionConfig)
                 if f.name in given}
    options = {k[len(_OPT_PREFIX):]: v for k, v in given.items() if k.startswith(_OPT_PREFIX)}
    return attention, options


def _request(args) -> tuple[RunConfig, dict, dict]:
    given = {k: v for k, v in vars(args).items() if v is not None}
    run = RunConfig(**{f.name: given[f.name] for f in dataclasses.fields(RunConfig)
                       if f.name in given})
    return (run, *_problem(args))


def _fail(prog: str, e: Exception) -> int:
    from cpbench.report import console

    console.end_status()  # a status line on the terminal must not run into the error
    sys.stderr.write(f"{prog}: error: {' '.join(str(e).split())}\n")
    return USAGE_ERROR


def cmd_run(args) -> int:
    from cpbench.bench import driver, plan as planning
    from cpbench.bench.env import torchrun_world, under_torchrun
    from cpbench.launch import LaunchTimeout, RankError

    launcher = "torchrun" if under_torchrun() else "self"
    try:
        run, attention, options = _request(args)
        plan = planning.plan(run, attention, options, launcher=launcher)
    except ValueError as e:
        if launcher == "self" or torchrun_world()[0] == 0:  # rank 0 speaks
            return _fail("cpbench run", e)
        return USAGE_ERROR
    if launcher == "torchrun":
        return driver.torchrun_main(plan)
    try:
        return driver.launch(plan)
    except (RankError, LaunchTimeout) as e:
        why = f"{e} (--deadline)" if isinstance(e, LaunchTimeout) else str(e)
        kept = f"; records written so far are in {plan.out}" if plan.out else ""
        sys.stderr.write(f"cpbench run: {why}{kept}\n")
        return 1


def cmd_strategies(args) -> int:
    lines = []
    for name in sorted(strategies.names()):
        cls = strategies.get(name)
        lines.append(f"{name:<22} {cls.description}")
        for f, typ in _options_of(cls):
            usage = _option_usage(f.name, typ, f.metadata.get("choices"))
            lines.append(f"{'':<24}{usage}  default {f.default}: {f.metadata.get('help', '')}")
        if cls.causal_only:
            lines.append(f"{'':<24}(causal attention only)")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def cmd_report(args) -> int:
    from cpbench import report, results

    logging.basicConfig(level=logging.WARNING, format="cpbench report: %(message)s",
                        stream=sys.stderr)
    try:
        records = [r for path in args.files for r in results.read(path)]
    except (OSError, ValueError) as e:
        return _fail("cpbench report", e)
    if args.compare and args.format not in ("table", "markdown"):
        return _fail("cpbench report", ValueError(
            f"--compare prints tables; use --format table or markdown, not {args.format}"))
    if args.plot:
        from cpbench.report import plot
        try:
            plot.check_target(args.plot)  # before any output: the fix, not half a report
        except ValueError as e:
            return _fail("cpbench report", e)
    sweep_view = args.view == "sweep" or (args.view == "auto" and records
                                          and not report.sweep.one_launch(records))
    if args.compare == "placement":
        note = report.tables.simulated_note(records)
        text = (f"Compared{note}\n\n" if note else "") + \
            report.sweep.compare_placement(records, args.format)
    elif sweep_view and args.format in ("table", "markdown"):
        text = report.sweep.sweep_report(records, args.format)
    else:  # csv / json: every row, whatever the view
        text = report.report(records, args.format)
    sys.stdout.write(text)
    if args.plot:
        try:
            note = report.tables.simulated_note(records).strip(" ()") or None
            plot.plot(records, args.plot, title_note=note)
        except (OSError, ValueError) as e:
            return _fail("cpbench report", e)
        sys.stderr.write(f"cpbench report: plot written to {args.plot}\n")
    return 0


def cmd_sweep(args) -> int:
    import shlex

    from cpbench import sweep

    try:
        if args.timeout is not None and args.timeout <= 0:
            raise ValueError(f"--timeout must be a positive number of seconds, "
                             f"got {args.timeout:g}")
        config = sweep.load(args.config)
        commands = [sweep.command(config, case, args.out, args.launcher)
                    for case in config.cases]
    except sweep.SweepError as e:
        sys.stderr.write(f"cpbench sweep: {e}\n")
        return USAGE_ERROR
    except ValueError as e:
        return _fail("cpbench sweep", e)
    if args.dry_run:
        for case, cmd in zip(config.cases, commands):
            sys.stdout.write(f"[{case.index}] {case.label}: {shlex.join(cmd)}\n")
        return 0
    try:
        return sweep.run(config, args.out, rerun_failed=args.rerun_failed,
                         timeout=args.timeout, launcher=args.launcher)
    except KeyboardInterrupt:
        sys.stderr.write("cpbench sweep: interrupted; the running case was stopped (rows it "
                         "had finished are kept, the rest not recorded); re-run the same "
                         "command to finish the missing cases\n")
        return 130
    except (OSError, ValueError) as e:  # e.g. an --out that is damaged or not writable
        return _fail("cpbench sweep", e)


def cmd_simulate(args) -> int:
    from cpbench.report import console

    prog = "cpbench simulate"
    with console.transient_progress():  # a status line on a terminal; results on stdout
        return _simulate(args, prog)


def _simulate(args, prog: str) -> int:
    from cpbench.report import console
    from cpbench.sim import command, hardware, validate
    from cpbench.topology import Topology

    try:
        hw = hardware.load(args.hardware)
        if args.validate and (args.out or args.plot or args.compare_placements):
            raise ValueError("--validate prints its own table; drop --out, --plot and "
                             "--compare-placements, or run them separately")
        if args.validate:
            text = validate.report(validate.run(validate.load(args.validate), hw), hw)
            sys.stdout.write(text)
            return 0
        nodes = hw.nodes if args.nodes is None else args.nodes
        gpn = hw.gpus_per_node if args.gpus_per_node is None else args.gpus_per_node
        if nodes < 1 or gpn < 1:
            raise ValueError(f"--nodes and --gpus-per-node must be >= 1, got {nodes} x {gpn}")
        topo = Topology(world_size=nodes * gpn, ranks_per_node=gpn)
        given, options = _problem(args)
        given.pop("seqlen", None)  # a list here: one simulation per length
        attention = {**GPU_ATTENTION, **given}
        AttentionConfig(**attention)  # one line for a bad shape, before anything is built
        seqlens = list(args.seqlen or (GPU_ATTENTION["seqlen"],))
        if args.plot:
            from cpbench.report import plot
            plot.check_target(args.plot)  # before any output: the fix, not half a report
        if (args.out or "").lower() == "none":
            args.out = None
        if args.out:
            from cpbench.bench.plan import open_out
            open_out(args.out)
        cases = None
        if args.compare_placements:
            if options:
                raise ValueError("--compare-placements tries every option value itself; "
                                 "drop the strategy options")
            cases = command.placement_cases(args.strategy, topo)
        records, skipped = command.simulate(args.strategy, options, attention, seqlens, topo,
                                            hw, cases=cases)
    except (OSError, ValueError) as e:
        return _fail(prog, e)
    if args.compare_placements:
        text = command.render_comparison(command.compare_placements(records), hw, topo,
                                         args.format)
    else:
        text = command.render(records, hw, topo, args.format)
        if skipped and args.format in ("table", "markdown"):
            text += "not simulated (the configuration does not allow them):\n" + \
                "".join(f"  {why}\n" for why in skipped)
    console.end_status()
    if args.out:
        from cpbench import results
        for record in records:
            results.append(args.out, record)
        text += f"records: {args.out}\n" if args.format in ("table", "markdown") else ""
    sys.stdout.write(text)
    if args.plot:
        try:
            plot.plot(records, args.plot, title_note=f"simulated on {hw.name}")
        except (OSError, ValueError) as e:
            return _fail(prog, e)
        sys.stderr.write(f"{prog}: plot written to {args.plot}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
