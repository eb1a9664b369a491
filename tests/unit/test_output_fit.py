"""Output that fits (issue 34, item 4): every default table of ``run``, ``report``, ``compare``
and ``simulate`` within 120 columns when stdout is not a terminal, rendered from realistic
records (tests/fixtures/bench_cpu_4ranks.jsonl: `cpbench run --strategy all --nproc 4
--check --iters 3 --warmup 1` on the 2-core CPU machine, i.e. `make bench` with fewer
iterations; and predictions of `cpbench simulate` on three topologies); `--wide` keeps every
column; "ranks" where the ranks are CPU processes; `make bench` under 100 lines; plots with
at most 8 series a panel, no two alike."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import logging
import re
import sys
from pathlib import Path

import pytest
from test_compare_profile import A_SHARES, B_SHARES, _record
from test_guards import _comm, _with
from test_results import fake_record

from cpbench import cli, report, results
from cpbench.report import placements, render
from cpbench.report.render import WIDE, Fit, fitting

FIXTURES = Path(__file__).parents[1] / "fixtures"
BENCH = FIXTURES / "bench_cpu_4ranks.jsonl"
LIMIT = 120


def _width(text: str) -> int:
    return max(len(line) for line in text.splitlines())


@pytest.fixture(scope="module")
def bench() -> list[dict]:
    return results.read(BENCH)


@pytest.fixture(scope="module")
def simulated() -> list[dict]:
    """Six strategies (their variants: 13 series) at three lengths on 1, 2 and 4 nodes of 8
    A800s: the 3-topology plot of the issue."""
    from cpbench.config import GPU_ATTENTION
    from cpbench.sim import command, hardware
    from cpbench.topology import Topology

    hw = hardware.load("a800-sxm")
    out = []
    for nodes in (1, 2, 4):
        recs, _ = command.simulate(("zigzag", "ring", "usp", "megatron-cp", "llama3", "local"),
                                   {}, dict(GPU_ATTENTION), [131072, 262144, 524288],
                                   Topology(world_size=8 * nodes, ranks_per_node=8), hw)
        out += recs
    return out


def _write(path: Path, records: list[dict]) -> Path:
    for r in records:
        results.append(path, r)
    return path


def _slower(records: list[dict], factor: float) -> list[dict]:
    """The same run with every iteration ``factor`` times as long (compare's run B)."""
    out = copy.deepcopy(records)
    for r in out:
        for phase, ranks in (r.get("samples_ms") or {}).items():
            if ranks:
                r["samples_ms"][phase] = [[t * factor for t in rank] for rank in ranks]
        r["derived"] = results.derive(r)
    return out


def _cli(capsys, *argv) -> str:
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory, bench, simulated) -> dict[str, Path]:
    tmp_path = tmp_path_factory.mktemp("files")
    return {"bench": _write(tmp_path / "bench.jsonl", bench),
            "slower": _write(tmp_path / "slower.jsonl", _slower(bench, 1.2)),
            "sim": _write(tmp_path / "sim.jsonl", simulated),
            "mixed": _write(tmp_path / "mixed.jsonl", simulated + bench),
            "profiled_a": _write(tmp_path / "pa.jsonl", [_record(A_SHARES, seed=1)]),
            "profiled_b": _write(tmp_path / "pb.jsonl", [_record(B_SHARES, seed=2)])}


COMMANDS = {
    "report": ["report", "{bench}"],
    "report --view sweep": ["report", "{bench}", "--view", "sweep"],
    "report --compare placement": ["report", "{bench}", "--compare", "placement"],
    "report --compare upstream": ["report", "{bench}", "--compare", "upstream"],
    "report --best": ["report", "{bench}", "--best"],
    "report --accuracy": ["report", "{bench}", "--accuracy"],
    "report simulated": ["report", "{sim}"],
    "report simulated --compare placement": ["report", "{sim}", "--compare", "placement"],
    "report simulated --best": ["report", "{sim}", "--best"],
    "report measured + simulated": ["report", "{mixed}"],
    "compare": ["compare", "{bench}", "{slower}"],
    "compare profiled": ["compare", "{profiled_a}", "{profiled_b}"],
    "simulate": ["simulate"],
    "simulate --seqlen 128K,256K,512K": ["simulate", "--seqlen", "128K,256K,512K"],
}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_default_table_fits_120_columns(name, files, capsys):
    argv = [a.format(**files) for a in COMMANDS[name]]
    out = _cli(capsys, *argv)
    assert _width(out) <= LIMIT, "\n".join(line for line in out.splitlines()
                                           if len(line) > LIMIT)


@pytest.mark.slow  # seconds of CPU (every placement of two strategies)
def test_simulate_compare_placements_fits(capsys):
    out = _cli(capsys, "simulate", "--compare-placements", "--strategy", "usp,double-ring")
    assert _width(out) <= LIMIT


def test_run_prints_fit_and_wide_prints_every_column(bench):
    """What `cpbench run` prints last (the summary, as `cpbench report` renders it) fits;
    under --wide it is seed 001's full table, which does not (so the check above can fail)."""
    text = report.report(bench)
    assert _width(text) <= LIMIT
    with fitting(WIDE):
        wide = report.report(bench)
    assert _width(wide) > LIMIT
    header = next(line for line in wide.splitlines() if "QKV Format" in line)
    for column in ("Strategy", "Placement", "Dtype", "QKV Format", "Seq Len", "Nodes×Ranks",
                   "Imbalance", "Fraction of Ideal (%)", "Check"):
        assert column in header
    # the default: what every row shares on a line above, the essential columns kept
    lines = text.splitlines()
    assert lines[1] == ("every row: Dtype fp32, QKV Format bshd, B 1, Seq Len 1024, World 4, "
                        "Nodes×Ranks 2×2, Window None")
    header = [c.strip() for c in lines[3].split("|")]
    # TFLOP/s/rank is "-" in every row (each withheld: the file's rows shared cores): gone
    assert header == ["Strategy", "CP", "Imbal", "FWD (ms)", "FWD+BWD (ms)", "Mem (MB)",
                      "Check"]
    # CP and Imbalance carry a verdict: kept; Ideal (%) is "-" in every row: gone, so the
    # table fits with nothing hidden
    assert "not shown" not in text and "Ideal" not in text
    row = next(line for line in lines if re.match(r" +ring +\|", line))
    assert [c.strip() for c in row.split("|")][2] == "1.75"  # the imbalanced ring says so


def test_cli_wide_flags(files, capsys):
    for argv in (["report", files["bench"]], ["compare", files["bench"], files["slower"]]):
        assert _width(_cli(capsys, *argv)) <= LIMIT
        assert _width(_cli(capsys, *argv, "--wide")) > LIMIT


def test_the_terminal_width_when_stdout_is_one(monkeypatch):
    import os
    import shutil

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdout", Tty())
    monkeypatch.setattr(shutil, "get_terminal_size",
                        lambda fallback=(80, 24): os.terminal_size((200, 50)))
    assert render.width() == 200
    with fitting(WIDE):
        assert render.width() is None
    with fitting(90):
        assert render.width() == 90
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a pipe, a file: 120
    assert render.width() == LIMIT


def _rows(n: int) -> list[dict]:
    return [{"Strategy": f"strategy-{i} (option_a={i} option_b=something-long)",
             "Placement": "-", "Dtype": "bf16", "Seq Len": str(1024 * (1 + i % 2)),
             "Extra": "x" * 30, "FWD (ms)": f"{i}.00", "Flags": "-" if i % 2 else "bad"}
            for i in range(n)]


def test_fit_lifts_notes_hides_and_wraps_in_that_order():
    fit = Fit(lift=("Dtype", "Seq Len"), drop=("Extra",), wrap=("Strategy",),
              notes=("Flags",), merge=(("Strategy", "Placement"),), short={"FWD (ms)": "F"})
    fitted = render.fit_rows(_rows(4), fit, 200)  # room: nothing hidden, nothing wrapped
    assert fitted.caption == ["every row: Dtype bf16"]  # Seq Len differs: it stays
    assert list(fitted.rows[0]) == ["Strategy", "Seq Len", "Extra", "F"]
    assert fitted.rows[0]["Strategy"].endswith(" [1]") and "[" not in fitted.rows[1]["Strategy"]
    assert fitted.notes == ["[1] bad"] and fitted.wrap_at == {}
    narrow = render.fit_rows(_rows(4), fit, 60)
    assert "Extra" not in narrow.rows[0] and narrow.notes[1].startswith("(not shown")
    assert narrow.wrap_at["Strategy"] < len(narrow.rows[0]["Strategy"])
    table = render.seed_table(narrow.rows, narrow.wrap_at)
    assert _width("\n".join(table)) <= 60
    assert len(table) > 4 + 4  # rules, header, rows: the labels broke over lines
    with fitting(60):  # render does the same, the notes under the table
        lines = render.render("t", _rows(4), "table", fit)
    assert lines[0] == "### t" and lines[1] == "every row: Dtype bf16"
    assert "[1] bad" in lines and _width("\n".join(lines)) <= 60
    with fitting(WIDE):  # --wide: every column as it was, the flags a column
        assert set(render.render(None, _rows(4), "table", fit)[1].replace("|", " ").split()) \
            >= {"Strategy", "Placement", "Dtype", "Extra", "Flags"}


def _cuda(record: dict) -> dict:
    r = copy.deepcopy(record)
    r["config"]["run"]["device"] = "cuda"
    r["kernel"] = "flash-attn"
    return r


def test_ranks_not_gpus_where_the_ranks_are_cpu_processes(tmp_path):
    from cpbench.report.labels import rank_unit

    cpu = [fake_record("zigzag", seqlen=s) for s in (1024, 2048)] + \
        [fake_record("usp", seqlen=s, options={"placement": p}) for s in (1024, 2048)
         for p in ("head-first", "ring-first")]
    gpu = [_cuda(r) for r in cpu]
    assert rank_unit(cpu) == "rank" and rank_unit(gpu) == "GPU"
    assert rank_unit(cpu[:1] + gpu[:1]) == "rank"  # mixed: a GPU is a rank, not the reverse
    threads = copy.deepcopy(gpu)
    for r in threads:
        r["env"]["launcher"] = "threads"  # ranks as threads sharing one GPU
    assert rank_unit(threads) == "rank"
    for records, unit, nodes, rate in ((cpu, "rank", "Nodes×Ranks", "TFLOP/s/rank"),
                                       (gpu, "GPU", "Nodes×GPUs", "TFLOPs/s")):
        with fitting(WIDE):
            summary = report.summary(records)
            sweep = report.sweep.sweep_report(records)
        header = [c.strip() for c in summary.splitlines()[2].split("|")]
        assert nodes in header and rate in header
        assert f"### zigzag on 2×2 {unit}s" in sweep
        assert f"### TFLOPs/s per {unit} by Seq Len" in sweep
        placement = placements.placement_view(records)
        assert placement.startswith(f"### FWD+BWD (ms) by placement on 2×2 {unit}s")
        other = "GPU" if unit == "rank" else "rank"
        assert f"×2 {other}s" not in sweep + placement and f"per {other}" not in sweep


def test_plot_labels_say_ranks_on_cpu(bench):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from cpbench.report import plot

    fig = plot.figure(bench)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert all(ax.get_ylabel() == "TFLOPs/s per rank (FWD+BWD)" for ax in axes)
    assert all(ax.get_title().startswith("2×2 ranks") for ax in axes)
    plt.close(fig)
    fig = plot.figure([_cuda(r) for r in bench])
    assert all("per GPU" in ax.get_ylabel() for ax in fig.axes if ax.get_visible())
    plt.close(fig)


def _series(ax) -> list[tuple[str, tuple, str]]:
    """(label, colour, marker) of each line an axes draws."""
    from matplotlib.colors import to_rgba

    return [(line.get_label(), to_rgba(line.get_color()), line.get_marker())
            for line in ax.get_lines()]


@pytest.mark.parametrize("which", ["simulated", "bench"])
def test_plot_panels_hold_at_most_8_series_none_alike(which, request):
    """3 simulated topologies (about 10 series each, once all in one panel) and `make
    bench`'s 17 series on one topology: a panel per topology and family, each at most 8
    lines, no two lines of a panel alike, a series alike in every panel."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from cpbench.report import plot

    records = request.getfixturevalue(which)
    fig = plot.figure(records)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    drawn = [_series(ax) for ax in axes]
    plt.close(fig)
    frame = report.sweep.latest_frame(records)
    expected = {(t, lab) for t, lab in zip(frame["topo"], frame["label"])}
    topologies = {t for t, _ in expected}
    assert len(axes) >= len(topologies)
    seen, style = set(), {}
    for ax, series in zip(axes, drawn):
        topo = ax.get_title().split(" ")[0]
        assert 1 <= len(series) <= plot.MAX_SERIES
        assert len({(c, m) for _, c, m in series}) == len(series)  # none alike in a panel
        assert len({c for _, c, _ in series}) == len(series)  # not even by colour alone
        for label, colour, marker in series:
            assert style.setdefault(label, (colour, marker)) == (colour, marker)
            seen.add((topo, label))
    assert seen == expected  # every series drawn, once per topology
    if which == "simulated":  # more lines than three panels hold: split by family too
        assert len(topologies) == 3 and len(expected) > 3 * plot.MAX_SERIES and len(axes) > 3


@contextlib.contextmanager
def _rank_zero_console(out):
    """Rank 0's console (``console.setup``) writing to ``out``; logging as it was after."""
    from cpbench.report import console

    loggers = [logging.getLogger(n) for n in ("cpbench", "cpbench.out")]
    saved = [(lg.handlers[:], lg.propagate, lg.level) for lg in loggers]
    stdout, sys.stdout = sys.stdout, out
    try:
        console.setup(0, "table")
        yield
    finally:
        sys.stdout = stdout
        for lg, (handlers, propagate, level) in zip(loggers, saved):
            lg.handlers, lg.propagate, lg.level = handlers, propagate, level


def test_make_bench_prints_under_100_lines(bench, tmp_path):
    """`make bench`'s output as the driver prints it (its header, each case's line, the
    summary), from the fixture's 18 records: under 100 lines, the summary last."""
    from cpbench.bench import runlog
    from cpbench.bench.plan import plan
    from cpbench.config import RunConfig

    p = plan(RunConfig(strategy=("all",), nproc=4, check=True, out="none"), {}, {},
             launcher="self")
    p = dataclasses.replace(p, out=str(tmp_path / "r.jsonl"))
    out = io.StringIO()
    with _rank_zero_console(out):
        runlog.header(p, 4)
        for i, record in enumerate(bench, 1):
            prefix = f"[{i}/{len(bench)}] {report.row_label(record)}"
            logging.getLogger("cpbench").info("%s", prefix, extra={"transient": "plain"})
            runlog.say_record(p, record, prefix, 1.0)
        runlog.footer(p, bench, False, False)
    text = out.getvalue()
    lines = text.splitlines()
    assert len(lines) < 100, text
    assert "Benchmark Results for" not in text  # the blocks: --details
    done = [line for line in lines if re.match(r"\[\d+/18\] .*: done in 1 s, check PASS, "
                                               r"FWD [\d.]+ ms, FWD\+BWD [\d.]+ ms$", line)]
    assert len(done) == 18
    assert max(len(line) for line in lines) <= 120  # long lines folded, continued by "  "
    unfolded = re.sub(r"\n  (?=\S)", " ", text).splitlines()
    assert unfolded[-2:] == ["18 case(s): 18 done; check: 18 PASS",
                             f"records: {p.out}  (re-render: cpbench report {p.out})"]
    assert len(results.read(p.out)) == 18  # the records keep everything
    assert json.loads(Path(p.out).read_text().splitlines()[0])["samples_ms"]


def test_the_run_prints_what_report_prints_of_its_file(tmp_path, capsys):
    """The run's summary and outcome are ``cpbench report``'s text of the records it wrote:
    the same function, width and records (as the file gives them back). An outcome line
    over 120 columns (flagged passes, as a busy host gives) was folded by the run's console
    and not by report: tests/multirank/test_cli_run.py's re-render then differed."""
    from types import SimpleNamespace

    from cpbench.bench import runlog

    passed = [{"tensor": "out", "max_abs": 1e-6, "max_rel": 1e-7, "passed": True}]
    records = [fake_record("zigzag", check=passed),
               _with(fake_record("test-cp-off", check=passed),
                     sizes={"world": [4] * 4, "cp": [1] * 4, "local_seqlen": [1024] * 4}),
               _with(fake_record("ring", check=passed), comm=_comm([0] * 4, [0] * 4))]
    assert len(report.outcome_line(records)) > 120
    path = tmp_path / "r.jsonl"
    for r in records:
        results.append(path, r)
    p = SimpleNamespace(run=SimpleNamespace(wide=False, format="table"), out=str(path))
    out = io.StringIO()
    with _rank_zero_console(out):
        runlog.footer(p, records, False, False)
    printed, said = out.getvalue().split("\nrecords: ")
    assert said.startswith(f"{path}  (re-render: cpbench report")
    assert cli.main(["report", str(path)]) == 0
    assert capsys.readouterr().out == printed + "\n"
    assert max(map(len, printed.splitlines())) <= 120


def test_skipped_cases_a_line_per_reason():
    from cpbench.report.lines import skipped_lines

    why = "ring-flash-attn 0.1.8 computes wrong gradients in fp32"
    te = "transformer-engine runs on CUDA GPUs only (this run is on cpu)"
    yc = "yunchang 0.6.4 computes wrong gradients in fp32"
    reasons = [f"rfa-ring: {why}", f"rfa-zigzag: {why}", f"te-a2a cannot run here: {te}",
               f"te-p2p cannot run here: {te}",
               *(f"yunchang-usp (ulysses_degree=0, placement={p}, ring_impl={r}): {yc}"
                 for p, r in (("head-first", "basic"), ("ring-first", "zigzag"))),
               "a note without a name"]
    assert skipped_lines(reasons) == [
        f"skipped rfa-ring, rfa-zigzag: {why}",
        f"skipped te-a2a, te-p2p cannot run here: {te}",
        f"skipped yunchang-usp (2 cases): {yc}",
        "skipped a note without a name"]


def test_a_refusal_in_its_own_words_is_said_once_with_its_count():
    """--sinks: each yunchang-usp variant is refused in words that name the strategy
    (``strategies.base``), no ``name: `` before them; the line counts the cases, never an empty
    name before the count (was "skipped  (3 cases): yunchang-usp (yunchang) cannot ...")."""
    from cpbench.bench.plan import plan
    from cpbench.config import RunConfig
    from cpbench.report.lines import skipped_lines

    run = RunConfig(strategy=("yunchang-usp", "zigzag"), nproc=4, out="none")
    refusals = [r for r in plan(run, {"seqlen": 1024, "sinks": True}, {},
                                launcher="threads").skipped if "sinks" in r]
    refusal = "yunchang-usp (yunchang) cannot add attention sinks once per query; drop --sinks"
    assert len(refusals) > 1 and set(refusals) == {refusal}  # a variant each, one reason
    assert skipped_lines(refusals) == [f"skipped {len(refusals)} cases: {refusal}"]
    assert skipped_lines(refusals[:1]) == [f"skipped {refusal}"]


def test_a_case_in_one_line():
    from cpbench.report.lines import case_line, outcome_line

    ok = fake_record("zigzag", check=[{"tensor": "out", "max_abs": 1e-6, "max_rel": 1e-7,
                                       "passed": True}])
    assert case_line(ok, 2.34) == "done in 2.3 s, check PASS, FWD 11.00 ms, FWD+BWD 31.00 ms"
    wrong = fake_record("ring", check=[{"tensor": "dq", "max_abs": 1.0, "max_rel": 0.5,
                                        "passed": False}])
    assert case_line(wrong, 1.0).startswith("done in 1 s, check FAIL, FWD ")
    oom = fake_record("usp", status="OOM", error="rank 1: OutOfMemoryError: CUDA out\nmore")
    assert case_line(oom, 3.0) == "OOM in 3 s, rank 1: OutOfMemoryError: CUDA out"
    fwd_then_oom = fake_record("usp", status="OOM", error="rank 0: OutOfMemoryError",
                               samples={"fwd": [[10.0, 11.0, 12.0]] * 4, "fwd_bwd": None})
    assert case_line(fwd_then_oom, 3.0) == ("OOM in 3 s, FWD 11.00 ms, FWD+BWD OOM, "
                                            "rank 0: OutOfMemoryError")
    mem = fake_record("ring", memory_status="OOM", memory_error="rank 1: OutOfMemoryError")
    assert case_line(mem, 1.0).endswith("FWD+BWD 31.00 ms, memory OOM")
    assert case_line(fake_record(fwd_only=True), 1.0) == "done in 1 s, FWD 11.00 ms"
    flagged = _with(fake_record("zigzag"), comm=_comm([0] * 4, [0] * 4))
    assert flagged["derived"]["flags"]  # a guard's: the line says so too
    assert "flagged: FWD rank 0: sent 0 B, schedule says 100 B" in case_line(flagged, 1.0)
    assert outcome_line([ok, wrong, oom]) == "3 case(s): 2 done, 1 OOM; check: 1 PASS, 1 FAIL"


def test_the_check_summary_names_the_flags_of_what_passed():
    """A strategy that ran without CP (one rank doing the work) passes its check: the run's
    line says so, as its table does."""
    from cpbench.report.lines import outcome_line

    passed = [{"tensor": "out", "max_abs": 1e-6, "max_rel": 1e-7, "passed": True}]
    ok = fake_record("zigzag", check=passed)
    cp_off = _with(fake_record("test-cp-off", check=passed),
                   sizes={"world": [4] * 4, "cp": [1] * 4, "local_seqlen": [1024] * 4})
    silent = _with(fake_record("ring", check=passed), comm=_comm([0] * 4, [0] * 4))
    assert outcome_line([ok]) == "1 case(s): 1 done; check: 1 PASS"
    assert outcome_line([ok, cp_off, silent]) == (
        "3 case(s): 3 done; check: 3 PASS (2 flagged: test-cp-off: CP over 1 ranks, asked for "
        "4 (+1 more); ring: FWD rank 0: sent 0 B, schedule says 100 B (+1 more))")


def test_plot_draws_flagged_rates_as_marks_and_says_not_cp(bench):
    """A flagged row (guards: FWD above FWD+BWD) is no point on its line but a labelled mark
    at 0; so are rows whose timings do not measure CP (4 ranks on 2 cores), the title saying
    why."""
    pytest.importorskip("matplotlib")
    import copy

    import matplotlib.pyplot as plt

    from cpbench.report import plot

    def drawn(records):
        fig = plot.figure(records)
        texts = [t.get_text() for ax in fig.axes for t in ax.texts]
        points = sum(len(line.get_xdata()) for ax in fig.axes for line in ax.get_lines())
        title = fig._suptitle.get_text().replace("\n", " ")
        plt.close(fig)
        return texts, points, title

    # 4 ranks on 2 cores: no rate is a point (guards.withhold), each case a mark; the
    # baseline, timed at both ends beyond their spread, is flagged (drifted)
    texts, points, title = drawn(bench)
    assert points == 0 and "timings do not measure CP (4 ranks share 2 cores)" in title
    assert texts.count("not CP") == 16 and texts.count("flagged") == 1
    records = copy.deepcopy(bench)
    zigzag = next(r for r in records if r["config"]["strategy"] == "zigzag")
    samples = zigzag["samples_ms"]
    samples["fwd"] = [[3 * t for t in rank] for rank in samples["fwd_bwd"]]
    for r in records:
        r["env"]["cpus_usable"] = 16
    texts2, points2, title2 = drawn(records)
    # measured: the 16 CP cases are points but zigzag, now flagged beside the baseline
    assert texts2.count("flagged") == 2 and "not CP" not in texts2 and points2 == 15
    assert "do not measure CP" not in title2
