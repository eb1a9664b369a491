"""The command line: flags generated from the configs and the registry; every bad input is one
line with the fix, exit status 2, and nothing is launched."""

import dataclasses
import subprocess
import sys
import typing

import pytest

from cpbench import cli, kernels, strategies
from cpbench.bench import plan as planning
from cpbench.config import RunConfig, parse_size


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything would start ranks or create a process group."""
    import torch.distributed as dist

    import cpbench.launch

    def forbidden(*a, **k):
        raise AssertionError("a process was launched or a process group created")

    monkeypatch.setattr(cpbench.launch, "run_ranks", forbidden)
    monkeypatch.setattr(dist, "init_process_group", forbidden)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)


def _error(capsys, *args):
    try:
        code = cli.main(["run", *args, "--out", "none"])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert len(err.rstrip("\n")) <= 120, err
    return err


def _option_not_taken_by(name):
    takes = {f.name for f in dataclasses.fields(strategies.get(name).Options)}
    for other in strategies.names():
        for f in dataclasses.fields(strategies.get(other).Options):
            if f.name not in takes:
                return f
    return None


def test_parse_size():
    assert parse_size("8k") == 8192 and parse_size("128K") == 131072
    assert parse_size("1M") == 2 ** 20 and parse_size("524288") == 524288
    with pytest.raises(ValueError, match="8k, 128K, 1M"):
        parse_size("8q")


@pytest.mark.parametrize("args,needle", [
    (["--strategy", "nope"], "unknown strategy 'nope'; see cpbench strategies"),
    (["--strategy", "ring", "--seqlen", "1001"], "try --seqlen 1000"),
    (["--kv-heads", "3"], "must divide heads 8; use one of: 1, 2, 4, 8"),
    (["--ranks-per-node", "3"], "does not divide world size 4; use one of: 1, 2, 4"),
    (["--kernel", "flash-attn"], "use --kernel"),
    (["--seqlen", "0"], "a size must be positive, got '0'; use e.g. 8k"),
    (["--seqlen", "-8k"], "a size must be positive, got '-8k'; use e.g. 8k"),
    (["--batch", "-1"], "batch must be a positive integer"),
    (["--head-dim", "0"], "head_dim must be a positive integer"),
    (["--iters", "0"], "--iters must be a positive integer"),
    (["--nproc", "100000"], "use --nproc"),
    (["--strategy", "ring", "--seqlen", "64M"], "needs >= "),
    (["--strategy", "ring", "--seqlen", "256k", "--check"], "check at 8k, time this without it"),
    (["--seqlen", "8q"], "cannot read '8q' as a size"),
    (["--dtype", "fp64"], "invalid choice: 'fp64'"),
    (["--device", "cuda"], "torchrun"),
    (["--collective-timeout", "0"], "--collective-timeout must be a positive number"),
    (["--deadline", "-5"], "--deadline must be a positive number"),
    (["--strategy", "zigzg"], "unknown strategy 'zigzg' (did you mean zigzag?); see cpbench"),
    (["--strategy", "ring,megatron"], "(did you mean megatron-cp?)"),
    # each under 120 columns, each once (a strategy named once, not by its label again)
    (["--strategy", "usp", "--ulysses-degree", "3"], "usp: ulysses degree 3 must divide 4 ranks"),
    (["--strategy", "ring", "--kernel", "nope"], "unknown kernel 'nope'; use auto, torch,"),
    (["--strategy", "ring", "--documents", "1k,2k"], "give lengths that add up to --seqlen"),
    (["--strategy", "zigzag", "--seqlen", "1k", "--documents", "100,924", "--document-padding",
      "refuse"], "zigzag over 4 ranks: 2 documents not multiples of 8 (e.g. 100); drop"),
    (["--strategy", "double-ring", "--seqlen", "1001"], ": double-ring over 4 ranks (zigzag"),
    # an abbreviation is not taken silently (allow_abbrev=False), and gets a suggestion
    (["--seq", "2k"], "unrecognized arguments: --seq 2k (did you mean --seqlen?)"),
    (["--seq-len", "2k"], "unrecognized arguments: --seq-len 2k (did you mean --seqlen?)"),
    (["--seq-len=2k", "--head", "4"],
     "(did you mean --seqlen, --heads?)"),
])
def test_bad_input_is_one_line_exit_2(no_launch, capsys, args, needle):
    assert needle in _error(capsys, *args)


def test_no_strategy_name_is_a_near_miss_when_nothing_is_near(no_launch, capsys):
    assert "did you mean" not in _error(capsys, "--strategy", "nosuch")


@pytest.mark.parametrize("argv", [["simulate", "--seq", "1k"], ["sweep", "x.yaml", "--out",
                                                                  "r.jsonl", "--dry"],
                                  ["dryrun", "--node", "2"], ["report", "x.jsonl", "--form",
                                                               "csv"]])
def test_no_command_takes_an_abbreviation(capsys, argv):
    """allow_abbrev=False on every parser: a prefix of a flag is an error naming the flag."""
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"cpbench {argv[0]}: error: unrecognized arguments: ")
    assert "(did you mean --" in err


def test_the_torchrun_entry_and_submit_sweep_take_no_abbreviation(no_launch, capsys):
    from cpbench.cli.submit_sweep import main as submit
    from cpbench.run import main as torchrun_entry

    with pytest.raises(SystemExit) as info:
        torchrun_entry(["--seq", "2k"])
    assert info.value.code == 2 and "did you mean --seqlen?" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        submit(["--nodes", "4", "--arr", "--", "--out", "r.jsonl"])
    assert info.value.code == 2 and "did you mean --array?" in capsys.readouterr().err


def test_heads_not_divisible_by_ulysses_degree(no_launch, capsys):
    assert "heads" in _error(capsys, "--strategy", "ulysses", "--heads", "6")


def test_window_not_dividing_the_ring(no_launch, capsys):
    assert "does not divide" in _error(capsys, "--strategy", "double-ring", "--window", "3")


def test_option_given_to_a_strategy_that_does_not_take_it(no_launch, capsys):
    f = _option_not_taken_by("ring")
    assert f is not None, "some registered strategy has an option ring does not take"
    flag = "--" + f.name.replace("_", "-")
    value = [] if isinstance(f.default, bool) else [str(f.default)]
    err = _error(capsys, "--strategy", "ring", flag, *value)
    assert f"does not take {flag}" in err


def test_nproc_under_torchrun(no_launch, capsys, monkeypatch):
    for var, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                           MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(var, value)
    assert "drop --nproc" in _error(capsys, "--strategy", "ring", "--nproc", "2")


def test_deadline_under_torchrun(no_launch, capsys, monkeypatch):
    for var, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                           MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(var, value)
    assert "under torchrun drop it" in _error(capsys, "--strategy", "ring", "--deadline", "60")


def test_unwritable_out_is_one_line_exit_2(no_launch, capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = cli.main(["run", "--strategy", "ring", "--out", str(blocker / "r.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "cannot write there" in err and "give another or none" in err


def test_out_directory_and_file_are_made_before_any_rank_starts(tmp_path):
    out = tmp_path / "new" / "dir" / "r.jsonl"
    p = planning.plan(RunConfig(strategy=("ring",), nproc=2, out=str(out)), {}, {},
                      launcher="self")
    assert p.out == str(out) and out.is_file() and out.read_text() == ""


def test_only_rank_0_prints_a_bad_input_under_torchrun(no_launch, capsys, monkeypatch):
    from cpbench.bench import env

    for var, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                           MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(var, value)
    waited = []  # rank 1 outlives rank 0, the one that prints (not the 30 s here)
    monkeypatch.setattr(env, "outlive_rank0", lambda: waited.append(1))
    with pytest.raises(SystemExit) as info:  # argparse's: --strategy's names are checked there
        cli.main(["run", "--strategy", "nope"])
    assert info.value.code == 2 and capsys.readouterr().err == "" and waited == [1]


@pytest.mark.parametrize("rank, args", [("0", ["--strategy", "nope"]),
                                        ("1", ["--strategy", "nope"]),
                                        ("1", ["--strategy", "ring", "--bogus-flag"])])
def test_every_rank_leaves_bad_input_for_torchrun_as_the_root_cause(no_launch, capsys,
                                                                      monkeypatch, tmp_path,
                                                                      rank, args):
    """Under torchrun each rank writes cpbench's line to its error file, as torch's own
    ErrorHandler lays it out: torchrun's summary (ProcessFailure) reads it as the message.
    A rank other than 0 outlives rank 0 (torchrun's agent stops the job at its first exit:
    rank 0, the one that prints, must be that one), and writes its file after (the summary's
    root cause is the earliest file: rank 0's)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from cpbench.bench import env

    waited: list[bool] = []  # whether the error file was there while the rank waited
    monkeypatch.setattr(env, "outlive_rank0", lambda: waited.append(error_file.exists()))
    error_file = tmp_path / "error.json"
    for var, value in dict(RANK=rank, WORLD_SIZE="2", LOCAL_RANK=rank, LOCAL_WORLD_SIZE="2",
                           MASTER_ADDR="127.0.0.1",
                           TORCHELASTIC_ERROR_FILE=str(error_file)).items():
        monkeypatch.setenv(var, value)
    try:
        code = cli.main(["run", *args])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    failure = ProcessFailure(local_rank=int(rank), pid=1, exitcode=2,
                             error_file=str(error_file))
    message = failure.message["message"]
    assert message.startswith("cpbench") and ": error: " in message
    assert ("unknown strategy 'nope'" if "nope" in args else "--bogus-flag") in message
    assert err == (message + "\n" if rank == "0" else "")  # rank 0 alone prints
    assert waited == ([] if rank == "0" else [False])  # the others wait, then write


def test_every_strategy_option_has_a_flag():
    parser = cli.build_parser()
    parser.parse_args(["run"])  # the strategy options are added when run reads its arguments
    run = next(a for a in parser._subparsers._group_actions[0].choices.values()
               if a.prog.endswith(" run"))
    flags = set(run._option_string_actions)
    for name in strategies.names():
        cls = strategies.get(name)
        hints = typing.get_type_hints(cls.Options)
        for f in dataclasses.fields(cls.Options):
            flag = "--" + f.name.replace("_", "-")
            assert flag in flags
            if hints[f.name] is bool:
                assert "--no-" + f.name.replace("_", "-") in flags
    for f in dataclasses.fields(RunConfig):
        assert "--" + f.name.replace("_", "-") in flags


def test_strategies_lists_names_descriptions_options(capsys):
    assert cli.main(["strategies"]) == 0
    out = capsys.readouterr().out
    for name in strategies.names():
        cls = strategies.get(name)
        assert f"{name} " in out and cls.description in out
        for f in dataclasses.fields(cls.Options):
            assert "--" + f.name.replace("_", "-") in out and f"default {f.default}" in out


def _plan(attention=None, options=None, **run_kw):
    return planning.plan(RunConfig(out="none", **run_kw), attention or {}, options or {},
                       launcher="self")


@pytest.mark.parametrize("nproc,rpn", [(1, 1), (2, 1), (3, 1), (4, 2), (8, 4)])
def test_self_launch_emulates_at_least_two_nodes(nproc, rpn):
    p = _plan({"seqlen": 768}, strategy=("ring",), nproc=nproc)
    assert p.ranks_per_node == rpn


def test_all_runs_every_strategy_and_variant_baselines_at_both_ends():
    p = _plan(strategy=("all",), nproc=4)
    topo = p.topo
    ran = {(c.strategy, c.options) for c in p.cases}
    own = {(n, v) for n in strategies.own_names() for v in strategies.get(n).variants(topo)}
    assert own <= ran  # every own strategy and variant runs the default (fp32) problem
    for name in set(strategies.names()) - set(strategies.own_names()):  # the adapters
        skipped = [s for s in p.skipped if s.startswith(name)]
        assert any(c.strategy == name for c in p.cases) or skipped, name
        if name.startswith("te-"):
            assert skipped and "CUDA" in skipped[0]  # GPU only: one line says so
        if name.startswith(("rfa-", "yunchang")) and name != "rfa-llama3":
            assert skipped and "fp32" in skipped[0]  # the libraries' rings are wrong in fp32
    assert ("torch-ring", strategies.get("torch-ring").Options()) in ran
    kernel = kernels.get(p.kernel)
    per_problem = [strategies.get(c.strategy)(p.attn, topo, 0, kernel=kernel, options=c.options,
                                              create_groups=False).ranks_per_problem
                   for c in p.cases]
    base = per_problem.count(1) // 2
    assert base and per_problem[:base] == per_problem[-base:] == [1] * base
    assert 1 not in per_problem[base:-base]


def test_the_baseline_is_timed_first_and_last_with_cp_strategies_between():
    p = _plan(strategy=("zigzag", "local", "ring"), nproc=2)
    assert [c.strategy for c in p.cases] == ["local", "zigzag", "ring", "local"]
    assert p.keys()[0] == p.keys()[-1]  # one row of the table, timed twice
    off = planning.plan(RunConfig(out="none", strategy=("zigzag", "local"), nproc=2), {}, {},
                        launcher="self", baseline_both_ends=False)
    assert [c.strategy for c in off.cases] == ["zigzag", "local"]
    assert [c.strategy for c in _plan(strategy=("ring",), nproc=2).cases] == ["ring"]


def test_option_applies_to_the_strategies_that_take_it():
    p = _plan(options={"placement": "ring-first"}, strategy=("usp", "ring"), nproc=4)
    usp = [c.options for c in p.cases if c.strategy == "usp"]
    assert usp and all(o.placement == "ring-first" for o in usp)
    assert [c.strategy for c in p.cases].count("ring") == 1


def test_defaults_follow_the_device():
    p = _plan(strategy=("ring",), nproc=2)
    assert p.run.device == "cpu" and p.attn.dtype == "fp32"
    assert p.run.warmup is not None and p.run.iters is not None
    assert p.out is None and p.run.ranks_per_node == 1 and p.run.nproc == 2


def test_all_skips_what_the_config_does_not_allow_but_a_named_strategy_errors():
    p = _plan({"seqlen": 1004}, strategy=("all",), nproc=4)  # ring splits 1004, zigzag cannot
    names = {c.strategy for c in p.cases}
    assert "ring" in names and "zigzag" not in names
    assert any(s.startswith("zigzag") and "try --seqlen 1008" in s for s in p.skipped)
    with pytest.raises(ValueError, match="try --seqlen 1008"):
        _plan({"seqlen": 1004}, strategy=("ring", "zigzag"), nproc=4)
    with pytest.raises(ValueError, match="try --seqlen 1000"):  # only the baseline would run
        _plan({"seqlen": 1001}, strategy=("all",), nproc=4)


def test_all_at_one_rank_runs_what_can_and_skips_the_rest_one_line_each():
    """At one rank no strategy is CP (each solves the whole problem): what this machine
    lacks (TE: CUDA only; torch-flex: no CPU backward) or what refuses the config (the
    libraries' rings in fp32) is skipped, the rest runs."""
    p = _plan(strategy=("all",), nproc=1)
    ran = {c.strategy for c in p.cases}
    assert set(strategies.own_names()) <= ran and "torch-ring" in ran
    for name in ("te-a2a", "te-p2p", "torch-flex", "rfa-zigzag"):
        assert name not in ran
        note, = [s for s in p.skipped if s.startswith(name + " ") or s.startswith(name + ":")]
        assert "\n" not in note
    assert any(s.startswith("te-p2p cannot run here") and "CUDA" in s for s in p.skipped)


def test_all_skips_a_baseline_that_cannot_fit_but_a_named_one_errors(monkeypatch):
    # 8 heads × 64 × fp32: a rank needs 16 KiB per token of its shard for q, k, v, out, grads
    monkeypatch.setattr(planning.memory, "capacity_bytes", lambda *a: 64 * 2 ** 20)
    p = _plan({"seqlen": 8192}, strategy=("all",), nproc=4)  # CP: 32 MiB; local: 128 MiB
    assert "local" not in {c.strategy for c in p.cases} and "ring" in {c.strategy for c in p.cases}
    note, = [s for s in p.skipped if s.startswith("local")]
    assert "holds all S each rank" in note and "more ranks" not in note
    with pytest.raises(ValueError, match="holds all S each rank"):
        _plan({"seqlen": 8192}, strategy=("ring", "local"), nproc=4)
    with pytest.raises(ValueError, match="or add ranks"):
        _plan({"seqlen": 32768}, strategy=("ring",), nproc=4)


def test_the_fit_check_reads_fixed_totals(monkeypatch):
    """Every torchrun rank plans alone: the verdict must not depend on what is free now."""
    from cpbench.bench import env, memory

    total = env.meminfo_bytes("MemTotal")
    if total is None:
        pytest.skip("no /proc/meminfo")
    assert memory.capacity_bytes("cpu", 4) == total // 4
    monkeypatch.setattr(memory, "meminfo_bytes",
                        lambda field: {"MemTotal": total}.get(field, 1))
    assert memory.capacity_bytes("cpu", 4) == total // 4


def test_more_local_ranks_than_gpus_is_one_line_before_any_group(no_launch, capsys,
                                                                 monkeypatch):
    """torchrun --nproc-per-node 8 on a 4-GPU node: one line naming the fix (not "invalid
    device ordinal" from set_device); the rank's GPU is made current before the plan asks
    torch.cuda anything."""
    import torch

    for var, value in dict(RANK="2", WORLD_SIZE="8", LOCAL_RANK="2", LOCAL_WORLD_SIZE="8",
                           MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(var, value)
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: calls.append("count") or 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set", d)))
    monkeypatch.setattr(planning.env_mod, "torchrun_world", lambda: (0, 8, 8))  # rank 0 speaks
    err = _error(capsys, "--strategy", "ring")
    assert "8 ranks on this node, 4 GPU(s) visible" in err and "--nproc-per-node 4" in err
    assert calls[:2] == ["count", ("set", 2)] and calls[2:] == ["count"]


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["run", "--strategy", "zigzg"], 2),
                                        (["run", "--seqlen", "8q"], 2),
                                        (["dryrun", "--strategy", "nope"], 2),
                                        (["simulate", "--strategy", "ring,nope"], 2)])
def test_help_and_bad_arguments_answer_without_importing_torch(argv, code):
    """torch's import takes seconds: ``--help`` and a mistake in the flags are answered
    before it (the strategy options, which need every strategy, are added when a command's
    parser reads its arguments; the names are checked against the registry's list)."""
    script = ("import sys\nfrom cpbench.cli import main\n"
              f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    code = e.code\n"
              "print(code, 'torch' in sys.modules, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    *said, last = done.stderr.splitlines()
    assert last == f"{code} False", done.stderr
    assert len(said) == (0 if code == 0 else 1) and all(len(line) <= 120 for line in said)


def test_python_dash_m_cpbench_is_the_command():
    done = subprocess.run([sys.executable, "-m", "cpbench", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("usage: cpbench ")


@pytest.mark.parametrize("args", [["--strategy", "ulysses", "--heads", "6"],
                                  ["--strategy", "ring", "--seqlen", "1001"],
                                  ["--strategy", "ring", "--kernel", "flash-attn"],
                                  ["--strategy", "ring", "--check"],
                                  ["--strategy", "ring", "--device", "cuda"],
                                  ["--strategy", "ring", "--nproc", "4"]])
def test_dryruns_errors_suggest_only_its_own_flags(capsys, args):
    """A fix names flags of the command it is given for: dryrun has no --nproc, --check or
    --launcher (run's), and a near miss is never --help."""
    import re

    parser = cli.build_parser()
    parser.parse_args(["dryrun"])  # its strategy options added, as when it runs
    dryrun = parser._subparsers._group_actions[0].choices["dryrun"]
    try:
        code = cli.main(["dryrun", *args])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    if code == 0:  # a CUDA build of torch runs the --device cuda dry run
        return
    assert code == 2 and len(err.splitlines()) == 1 and len(err.rstrip("\n")) <= 120, err
    given = {a for a in args if a.startswith("--")}
    fix = err.replace("(see cpbench dryrun --help)", "")  # the pointer to help is no fix
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", fix)) - given
    assert named <= set(dryrun._option_string_actions) - {"--help"}, err


def test_a_commands_help_lists_the_strategy_options(capsys):
    """The options added when a command reads its arguments are there for --help too."""
    with pytest.raises(SystemExit) as info:
        cli.main(["dryrun", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "strategy options" in out and "--ulysses-degree" in out
