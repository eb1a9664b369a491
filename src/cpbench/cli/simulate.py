"""``cpbench simulate``: predict the run tables for a GPU cluster (no GPU needed).

Predict FWD / FWD+BWD time, memory and TFLOPs per GPU of each strategy on a cluster from the
strategies' own schedules and a hardware preset.
"""

from __future__ import annotations

import sys
import textwrap

from cpbench.cli import args as cli_args
from cpbench.config import (
    FORMATS,
    GPU_ATTENTION,
    AttentionConfig,
    packed_problems,
)
from cpbench.errors import UsageError
from cpbench.mask import parse_size
from cpbench.settings import attention_settings

PROG = "cpbench simulate"


def _parse_sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(t) for t in text.split(",") if t.strip()) or (parse_size(text),)


def _parse_counts(text: str) -> tuple[int, ...]:
    counts = tuple(int(t) for t in text.split(",") if t.strip())
    if not counts:
        raise ValueError(text)
    return counts


_PRESETS = "(the hardware presets)"  # the epilog's place holder, filled when help prints


class _PresetsHelp(cli_args.KeepLines):
    """simulate's help, its epilog the presets: read from their files only when the help is
    printed, not each time a process builds the parser (every rank of every run)."""

    def add_text(self, text):
        if text == _PRESETS:
            from cpbench.sim import hardware

            text = "hardware presets (--hardware NAME; configs/hardware/NAME.yaml):\n" + \
                "\n".join(f"  {name:<12} {line}" for name, line in hardware.preset_lines())
        super().add_text(text)


def add_parser(sub) -> None:
    p = cli_args.command(sub, "simulate", __doc__, main, formatter_class=_PresetsHelp,
                         epilog=_PRESETS)
    attention = p.add_argument_group("attention problem (default: seed 001's)")
    cli_args.add_model(attention)
    for setting in attention_settings():
        if setting.name == "seqlen":
            attention.add_argument("--seqlen", type=cli_args.converter(_parse_sizes, "sizes"),
                                   metavar="S[,S...]", help="global sequence length(s), e.g. "
                                   f"128K,256K,512K (default {GPU_ATTENTION['seqlen']})")
        else:
            cli_args.add_setting(attention, setting, help=setting.help)
    g = p.add_argument_group("cluster")
    g.add_argument("--hardware", metavar="PRESET|FILE.yaml",
                   help="hardware preset (listed below; --list-hardware adds their sources) or "
                        "a YAML file (default a800-sxm; with --validate, the preset whose "
                        "evidence names the table)")
    g.add_argument("--list-hardware", action="store_true",
                   help="list the shipped hardware presets, each with where its numbers come "
                        "from, and exit")
    g.add_argument("--kernel", metavar="NAME",
                   help="the attention kernel priced: one the preset has curves for (fa2, fa3, "
                        "cudnn, fa4; --list-hardware lists each preset's; default the one the "
                        "field runs on that GPU)")
    integer = cli_args.converter(cli_args.read_number(int), "an integer")
    sizes = cli_args.converter(_parse_counts, "whole numbers")
    g.add_argument("--nodes", type=sizes, metavar="N[,N...]",
                   help="nodes (default: the preset's); several (1,2,4,8): a capacity table, "
                        "the best strategy at each scale marked")
    g.add_argument("--tokens-per-gpu", type=cli_args.converter(parse_size, "a size"),
                   metavar="T", help="tokens per GPU (e.g. 8k): each scale's sequence length "
                                     "is T x its GPUs (over --batch); a capacity table")
    g.add_argument("--gpus-per-node", type=integer, help="GPUs per node (default: the preset's)")
    s = p.add_argument_group("what to simulate")
    s.add_argument("--strategy", type=cli_args.converter(cli_args.strategy_names, "names"),
                   default=("all",), metavar="NAME[,NAME...]|all",
                   help="strategies (default all)")
    s.add_argument("--seed", type=integer, default=0,
                   help="seed sampling a --documents distribution (default 0)")
    s.add_argument("--packings", type=integer, default=1, metavar="K",
                   help="with a --documents distribution: K packings of it (seeds --seed, "
                        "--seed+1, ...), each predicted; the tables add each strategy's "
                        "median over them and the spread (default 1)")
    s.add_argument("--compare-placements", action="store_true",
                   help="every valid placement / split / window of the strategies in one "
                        "table, fastest first, each strategy's winner and its margin beside "
                        "the model's stated error")
    s.add_argument("--validate", metavar="FILE.csv",
                   help="predict published rows (configs/validation/*.csv) and print the "
                        "relative errors; ignores the other flags but --hardware")
    s.add_argument("--memory-from", metavar="DRYRUN.jsonl",
                   help="take each row's memory from a `cpbench dryrun --out` record of the "
                        "same case where there is one (the model's estimate and its error "
                        "beside it), the model's estimate elsewhere")
    _add_self_check(p, integer)
    s.add_argument("--plot", metavar="OUT.png",
                   help="also draw TFLOPs/s per GPU against Seq Len; with --compare-placements, "
                        "each placement's time relative to its strategy's fastest, one "
                        "panel (needs matplotlib)")
    s.add_argument("--details", action="store_true",
                   help="also each case's time by named term (kernel, block size, NCCL "
                        "contention, merge / rescale, layout copies, launch / sync, "
                        "communication): why a strategy wins")
    s.add_argument("--format", choices=FORMATS, default="table")
    s.add_argument("--wide", action="store_true",
                   help="every column of every table (default: tables fit the terminal, "
                        "120 columns when it is not one)")
    s.add_argument("--out", metavar="FILE.jsonl",
                   help="also append the predictions as result records (marked simulated; "
                        "`cpbench report` re-renders them, beside measured ones); with "
                        "--self-check, the measured records (re-check them with --measured)")
    cli_args.add_strategy_options(p, {s.name for s in attention_settings()})


def _add_self_check(p, integer) -> None:
    c = p.add_argument_group(
        "self-check", "the model against cpbench run on this machine's CPU ranks (CPU "
        "problem defaults with 2 heads, --seqlen default 2k,4k,8k; --hardware: a preset "
        "from cpbench calibrate)")
    c.add_argument("--self-check", action="store_true",
                   help="run the cases (cpbench run --nproc) and print predicted vs measured, "
                        "the error of each row, per strategy, per length and overall")
    fraction = cli_args.converter(cli_args.read_number(float), "a number")
    for flag, kind, default, text in (
            ("--measured", None, None, "predict the rows of an earlier self-check's --out "
                                       "instead of measuring again (scored only where the "
                                       "load readings they carry pass --load-limit)"),
            ("--nproc", integer, 2, "local ranks (default 2)"),
            ("--iters", integer, None, "timed iterations a case, after 1 warm-up (default: "
                                       "about a second of the baseline's work a case, 3 at "
                                       "least)"),
            ("--rounds", integer, 3, "times each length is measured, the order reversed each "
                                     "round (default 3)"),
            ("--load-limit", fraction, 0.1, "refuse to score when other processes used more "
                                            "than this share of the cores while it measured "
                                            "a length, or while the preset was calibrated "
                                            "(default 0.1)"),
            ("--drift-limit", fraction, 0.1, "measure a length again when the machine probe "
                                             "around it is further than this from the "
                                             "preset's (default 0.1)")):
        metavar = {None: "FILE.jsonl", fraction: "FRACTION"}.get(kind)
        c.add_argument(flag, type=kind, default=default, metavar=metavar, help=text)


def main(args) -> int:
    from cpbench.report import console
    from cpbench.report.render import fitting, wide_width

    # a status line on a terminal; results on stdout, tables fitting it unless --wide
    with console.transient_progress(), fitting(wide_width(args.wide)):
        try:
            return _simulate(args)
        except (OSError, UsageError) as e:
            return cli_args.fail(PROG, e)


def _checked(args, hw):
    """(topology, attention, options, seqlens) from the flags; UsageError before any work."""
    from cpbench.topology import Topology

    nodes = hw.nodes if args.nodes is None else args.nodes[0]
    gpn = hw.gpus_per_node if args.gpus_per_node is None else args.gpus_per_node
    if nodes < 1 or gpn < 1:
        raise UsageError(f"--nodes and --gpus-per-node must be >= 1, got {nodes} x {gpn}")
    given, options = cli_args.problem(args)
    given.pop("seqlen", None)  # a list here: one simulation per length
    # a measured preset (cpbench calibrate on a CPU) models its own dtype: default to it
    dtype = GPU_ATTENTION["dtype"] if GPU_ATTENTION["dtype"] in hw.dtypes else hw.dtypes[0]
    attention = {**GPU_ATTENTION, "dtype": dtype, **given}
    if args.packings < 1:
        raise UsageError(f"--packings must be a positive integer, got {args.packings}")
    for seqlen in args.seqlen or (GPU_ATTENTION["seqlen"],):  # one line for a bad shape
        packed_problems({**attention, "seqlen": seqlen}, args.seed, args.packings)
    if args.compare_placements and options:
        raise UsageError("--compare-placements tries every option value itself; drop the "
                         "strategy options")
    if args.plot:
        from cpbench.report import plot

        plot.check_target(args.plot)  # before any output: the fix, not half a report
    if (args.out or "").lower() == "none":
        args.out = None
    if args.out:
        from cpbench.bench.outputs import open_out

        open_out(args.out)
    return (Topology(world_size=nodes * gpn, ranks_per_node=gpn), attention, options,
            list(args.seqlen or (GPU_ATTENTION["seqlen"],)))


def list_hardware() -> str:
    """Every shipped preset: its name and machine, and under it where its numbers come
    from."""
    from cpbench.sim import hardware

    lines = ["Hardware presets (cpbench/sim/presets/*.yaml; --hardware NAME or a YAML file):"]
    width = max(len(n) for n in hardware.names())
    pad = " " * (width + 4)
    for name, description in hardware.preset_lines():
        hw = hardware.load(name)
        lines += [f"  {name:<{width}}  {description}",
                  f"{pad}source: {hw.source or 'not stated'}"]
        for i, (kernel, summary, sources) in enumerate(hw.kernel_choices):
            mark = " (default)" if i == 0 else ""
            lines += textwrap.wrap(f"kernel {kernel}{mark}: {summary or 'not summarised'}; "
                                   f"sources: {', '.join(sources) or 'none named'}", 116,
                                   initial_indent=pad, subsequent_indent=pad + "  ")
    return "\n".join(lines) + "\n"


def _hardware(args):
    """--hardware and --kernel; without --hardware, a800-sxm, or for --validate the preset
    whose evidence names the table (the GPU its rows ran on) and that evidence's kernel."""
    from cpbench.sim import hardware

    if args.hardware or not args.validate:
        return hardware.load(args.hardware or "a800-sxm", args.kernel)
    name, kernel = hardware.preset_of_table(args.validate) or ("a800-sxm", None)
    return hardware.load(name, args.kernel or kernel)


def _simulate(args) -> int:
    from cpbench.report import console
    from cpbench.report.render import prose
    from cpbench.sim import command, measured_memory

    if args.list_hardware:
        sys.stdout.write(list_hardware())
        return 0
    hw = _hardware(args)
    if args.self_check:
        return _self_check(args, hw)
    if args.validate:
        return _validate(args, hw)
    topo, attention, options, seqlens = _checked(args, hw)
    if args.tokens_per_gpu is not None or (args.nodes and len(args.nodes) > 1):
        return _capacity(args, hw, topo, attention, options, seqlens)
    peaks = measured_memory.load(args.memory_from) if args.memory_from else None
    cases = command.placement_cases(args.strategy, topo) if args.compare_placements else None
    records, skipped = command.simulate(args.strategy, options, attention, seqlens, topo, hw,
                                        cases=cases, seed=args.seed, packings=args.packings)
    if peaks is not None:
        measured_memory.apply(records, peaks)
    shown = records  # the plot draws what the table shows
    if args.compare_placements:
        shown = [r for rows in command.compare_placements(records) for r in rows]
        text = command.render_comparison([shown], hw, topo, args.format)
    else:
        text = command.render(records, hw, topo, args.format, with_details=args.details)
        if peaks is not None and args.format in ("table", "markdown"):
            text += measured_memory.summary(records, args.memory_from)
        if skipped and args.format in ("table", "markdown"):
            text += "not simulated (the configuration does not allow them):\n" + \
                "".join(f"{line}\n" for line in prose([f"  {why}" for why in skipped]))
    console.end_status()
    if args.out:
        from cpbench import results

        for record in records:
            results.append(args.out, record)
        text += f"records: {args.out}\n" if args.format in ("table", "markdown") else ""
    sys.stdout.write(text)
    if args.plot:
        _plot(args, shown, hw)
    return 0


def _plot(args, records: list[dict], hw) -> None:
    """The plot of what the table shows: with --compare-placements, report's one panel of
    the placements' differences (``report --compare placement --plot``), else TFLOPs/s
    against Seq Len."""
    from cpbench.report import placements, plot

    note = f"simulated on {hw.name}"
    if args.compare_placements:
        from cpbench.sim.validate import stated_error

        error = stated_error(hw)
        placements.plot(records, args.plot, f"{note}; the model's stated error: "
                        f"{error.what}" if error else note)
    else:
        plot.plot(records, args.plot, title_note=note)
    sys.stderr.write(f"{PROG}: plot written to {args.plot}\n")




def _validate(args, hw) -> int:
    from cpbench.sim import validate

    if args.out or args.plot or args.compare_placements or args.memory_from:
        raise UsageError("--validate prints its own table; drop --out, --plot, "
                         "--compare-placements and --memory-from, or run them separately")
    sys.stdout.write(validate.report(validate.run(validate.load(args.validate), hw), hw,
                                     args.validate, fmt=args.format))
    return 0


def _capacity(args, hw, topo, attention, options, seqlens) -> int:
    from cpbench.sim import capacity

    if args.compare_placements or args.memory_from or args.plot or args.format != "table" \
            or len(seqlens) > 1 or args.packings > 1:
        raise UsageError("a capacity table (--tokens-per-gpu, several --nodes) takes one "
                         "problem in table format; drop --seqlen lists, --compare-placements, "
                         "--memory-from, --plot, --packings and --format")
    if args.tokens_per_gpu is not None and args.tokens_per_gpu < 1:
        raise UsageError(f"--tokens-per-gpu must be positive, got {args.tokens_per_gpu}")
    nodes = list(args.nodes or (hw.nodes,))
    if min(nodes) < 1:
        raise UsageError(f"--nodes must be >= 1, got {','.join(map(str, nodes))}")
    records, skipped = capacity.sweep(args.strategy, options, {**attention,
                                                               "seqlen": seqlens[0]},
                                      nodes, topo.ranks_per_node, args.tokens_per_gpu, hw)
    if args.out:
        from cpbench import results

        for record in records:
            results.append(args.out, record)
    sys.stdout.write(capacity.render(records, hw, skipped))
    return 0


def _self_check(args, hw) -> int:
    from cpbench import results
    from cpbench.sim import selfcheck, selfcheck_report

    if args.validate or args.plot or args.compare_placements or args.memory_from:
        raise UsageError("--self-check prints its own table; drop --validate, --plot, "
                         "--compare-placements and --memory-from")
    if args.nodes is not None or args.gpus_per_node is not None:
        raise UsageError("--self-check predicts the topology cpbench run --nproc uses; drop "
                         "--nodes and --gpus-per-node")
    limits = selfcheck.Limits(load=args.load_limit, drift=args.drift_limit)
    if args.measured:  # an earlier self-check's measurements, predicted again: judged by
        # the load readings they carry
        records = selfcheck.ok_records(results.read(args.measured))
        nproc = max((r["topology"]["world_size"] for r in records), default=0)
        measured = selfcheck.from_records(records)
    else:
        measured, nproc = _self_check_measure(args, hw, limits), args.nproc
        records = measured.records
    rows, skipped = selfcheck.compare(records, hw)
    text, scored = selfcheck_report.render(rows, hw, nproc, skipped, measured, limits)
    sys.stdout.write(text)
    return 0 if scored else 1


def _self_check_measure(args, hw, limits):
    from cpbench.config import CPU_ATTENTION
    from cpbench.sim import selfcheck

    if args.nproc < 2 or (args.iters is not None and args.iters < 1) or args.rounds < 1:
        raise UsageError("--self-check needs --nproc >= 2, --iters >= 1 and --rounds >= 1")
    if not (limits.load > 0 and limits.drift > 0):
        raise UsageError("--load-limit and --drift-limit must be positive")
    from cpbench.sim import selfcheck_report

    why = selfcheck_report.refusal(None, hw, limits)  # before minutes of measuring
    if why:
        raise UsageError(why.replace("not scored: ", "the check would not be scored: ")
                         + " (or --load-limit 1 to measure anyway)")
    given, options = cli_args.problem(args)
    given.pop("seqlen", None)
    attention = {**CPU_ATTENTION, "heads": selfcheck.HEADS, **given}
    AttentionConfig(**attention)
    if attention["dtype"] not in hw.dtypes:
        raise UsageError(f"the {hw.name} preset models {'/'.join(hw.dtypes)} kernels; give "
                         f"--dtype {hw.dtypes[0]} or a preset from cpbench calibrate")
    if args.out:
        from cpbench.bench.outputs import open_out

        open_out(args.out)
    return selfcheck.measure(args.strategy, attention, options,
                             list(args.seqlen or selfcheck.SEQLENS), nproc=args.nproc,
                             warmup=1, iters=args.iters, rounds=args.rounds, hw=hw,
                             limits=limits, out=args.out)
