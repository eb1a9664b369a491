"""``cpbench compare`` end to end on a real run's records (tests/fixtures/compare_run.jsonl:
`cpbench run --strategy zigzag,ulysses,local --nproc 2 --warmup 3 --iters 30` on the 2-core CPU
machine): a shuffled copy is the same, a ×1.2 copy is slower, bad input is one line, exit 2."""

import copy
import json
import random
import re
from pathlib import Path

import pytest

from cpbench.cli import compare as compare_cli
from cpbench.cli.args import Parser

FIXTURE = Path(__file__).parents[1] / "fixtures" / "compare_run.jsonl"
KEYS = {"case", "phase", "ratio", "ci_low", "ci_high", "p_value", "p_adjusted", "verdict"}


def cpbench_compare(*argv: str) -> int:
    """``cpbench compare …`` through the registered command, or (before it is registered in
    cli/__init__.py) through a parser holding compare alone: the same add_parser and main."""
    from cpbench import cli

    if compare_cli in cli.COMMANDS:
        return cli.main(["compare", *map(str, argv)])
    parser = Parser(prog="cpbench")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    compare_cli.add_parser(sub)
    args = parser.parse_args(["compare", *map(str, argv)])
    return args.func(args)


# `cpbench run --strategy zigzag,ring --nproc 2 --seqlen 2k --iters 20` on the 2-core machine:
# the run of issue 26's acceptance, where the old rule called one of the ×1.2 rows "same"
ZIGZAG_RING = FIXTURE.with_name("compare_zigzag_ring_2k.jsonl")


def _records(path: Path = FIXTURE) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _map_samples(records: list[dict], change) -> list[dict]:
    """A copy with each phase's per-rank samples replaced by ``change(samples_by_rank)``."""
    out = copy.deepcopy(records)
    for r in out:
        r["samples_ms"] = {phase: change(by_rank) if by_rank else by_rank
                           for phase, by_rank in r["samples_ms"].items()}
    return out


def _shuffled(by_rank):
    # the iterations' order, the same permutation on every rank: an iteration stays whole
    order = list(range(len(by_rank[0])))
    random.Random(len(by_rank[0])).shuffle(order)
    return [[row[i] for i in order] for row in by_rank]


def _scaled(factor):
    return lambda by_rank: [[x * factor for x in row] for row in by_rank]


def _json(capsys, *argv) -> list[dict]:
    assert cpbench_compare(*argv, "--format", "json") == 0
    return json.loads(capsys.readouterr().out)


def test_fixture_has_enough_iterations_for_a_verdict():
    for r in _records():
        assert r["status"] == "ok" and len(r["samples_ms"]["fwd"][0]) >= 20


def test_shuffled_copy_is_never_slower_or_faster(tmp_path, capsys):
    """The same samples in another order: ratio 1. On this noisy fixture 20 iterations
    cannot put the interval inside ±2 %, so "unclear" with the iterations that would, not a
    "same" the data do not show."""
    b = _write(tmp_path / "b.jsonl", _map_samples(_records(), _shuffled))
    assert cpbench_compare(FIXTURE, b) == 0
    out = capsys.readouterr().out
    assert "slower 0, faster 0," in out and "insufficient 0" in out
    assert "would resolve them" in out
    rows = _json(capsys, FIXTURE, b)
    assert len(rows) == 6 and {r["verdict"] for r in rows} <= {"same", "unclear"}
    assert all(r["ratio"] == pytest.approx(1.0) for r in rows)
    assert all(r["iters_to_resolve"] > 20 for r in rows if r["verdict"] == "unclear")
    # a band the spread can resolve: every row same
    wide = _json(capsys, FIXTURE, b, "--min-effect", "0.5")
    assert {r["verdict"] for r in wide} == {"same"}


def test_copy_times_1_2_is_slower_with_the_ratio_inside_its_interval(tmp_path, capsys):
    b = _write(tmp_path / "b.jsonl", _map_samples(_records(), _scaled(1.2)))
    rows = _json(capsys, FIXTURE, b)
    assert len(rows) == 6 and {r["phase"] for r in rows} == {"fwd", "fwd_bwd"}
    for r in rows:
        assert r["verdict"] == "slower", r
        assert r["ratio"] == pytest.approx(1.2)
        assert r["ci_low"] <= r["ratio"] <= r["ci_high"] and r["ci_low"] > 1.02
        assert r["p_adjusted"] < 0.05 and r["p_adjusted"] >= r["p_value"]
    # and the other way round: A is faster than B
    back = _json(capsys, b, FIXTURE)
    assert {r["verdict"] for r in back} == {"faster"}


def test_zigzag_ring_times_1_2_is_never_same_nor_faster(tmp_path, capsys):
    records = _records(ZIGZAG_RING)
    b = _write(tmp_path / "b.jsonl", _map_samples(records, _scaled(1.2)))
    rows = _json(capsys, ZIGZAG_RING, b)
    assert len(rows) == 4
    assert not {r["verdict"] for r in rows} & {"same", "faster"}
    assert sum(r["verdict"] == "slower" and r["ci_low"] <= 1.2 <= r["ci_high"]
               for r in rows) >= 3
    shuffled = _write(tmp_path / "s.jsonl", _map_samples(records, _shuffled))
    rows = _json(capsys, ZIGZAG_RING, shuffled)
    assert not {r["verdict"] for r in rows} & {"slower", "faster"}


def test_json_has_the_promised_keys_and_is_reproducible(tmp_path, capsys):
    b = _write(tmp_path / "b.jsonl", _map_samples(_records(), _scaled(1.01)))
    first, again = _json(capsys, FIXTURE, b), _json(capsys, FIXTURE, b)
    assert first == again  # seeded bootstrap
    assert all(KEYS <= set(r) for r in first)
    assert {r["case"] for r in first} == {"zigzag [S=1K]", "ulysses [S=1K]", "local [S=1K]"}
    # 1 % is inside the ±2 % band: never a changed verdict, however clear the test
    assert {r["verdict"] for r in first} <= {"same", "unclear"}
    other_seed = _json(capsys, FIXTURE, b, "--seed", "1")
    assert [r["ci_low"] for r in other_seed] != [r["ci_low"] for r in first]


def test_too_few_iterations_is_insufficient(tmp_path, capsys):
    """3 iterations a side: the most extreme ranks give p = 0.1, never below α."""
    a = _write(tmp_path / "a.jsonl", _map_samples(_records(), lambda s: [r[:3] for r in s]))
    b = _write(tmp_path / "b.jsonl",
               _map_samples(_records(), lambda s: [[x * 2 for x in r[:3]] for r in s]))
    rows = _json(capsys, a, b)
    assert {r["verdict"] for r in rows} == {"insufficient"}
    assert cpbench_compare(a, b) == 0
    assert "too few iterations (3 vs 3)" in capsys.readouterr().out


def test_unmatched_cases_environment_and_last_record(tmp_path, capsys):
    records = _records()
    b_records = _map_samples(records[:2], _scaled(1.2))  # no `local` in B
    for r in b_records:
        r["env"]["torch"] = "2.14.0+cpu"
        r["config"]["run"]["iters"] = 50  # how it was launched does not make another case
    stale = _map_samples(records[:1], _scaled(0.5))  # zigzag recorded twice: the last counts
    stale[0]["env"]["utc"] = "2026-01-01T00:00:00Z"  # by an earlier run (a re-run)
    b = _write(tmp_path / "b.jsonl", stale + b_records)
    assert cpbench_compare(FIXTURE, b) == 0
    out = capsys.readouterr().out
    assert "Only in A (1): local [S=1K]" in out and "Only in B" not in out
    assert "torch  2.13.0+cpu  →  2.14.0+cpu" in out
    assert "slower 4" in out


def test_several_files_per_run(tmp_path, capsys):
    records = _records()
    a1, a2 = _write(tmp_path / "a1.jsonl", records[:1]), _write(tmp_path / "a2.jsonl",
                                                               records[1:])
    b = _write(tmp_path / "b.jsonl", _map_samples(records, _scaled(1.2)))
    rows = _json(capsys, "--a", a1, a2, "--b", b)
    assert len(rows) == 6 and {r["verdict"] for r in rows} == {"slower"}


def test_markdown_has_seed_004s_sections(tmp_path, capsys):
    b = _write(tmp_path / "b.jsonl", _map_samples(_records(), _scaled(1.2)))
    assert cpbench_compare(FIXTURE, b, "--format", "markdown") == 0
    text = capsys.readouterr().out
    sections = ["**What else changed:**", "## 1. High-Level Performance Summary",
                "## 2. Step Time Distribution Comparison", "### Overview",
                "### Key Findings:", "### Detailed comparison table", "## 4. Legend"]
    positions = [text.index(s) for s in sections]
    assert positions == sorted(positions)
    assert "| Time Rank | A Time (ms) | B Time (ms) | Δ (ms) | Δ (%) |" in text
    assert "B is **slower**" in text and "Suspicion Score" in text


def test_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    b = _write(tmp_path / "b.jsonl", _map_samples(_records(), _scaled(1.2)))
    out = tmp_path / "dist.png"
    assert cpbench_compare(FIXTURE, b, "--plot", out) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def _one_line_exit_2(capsys, *argv) -> str:
    assert cpbench_compare(*argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    not_records = tmp_path / "x.jsonl"
    not_records.write_text('{"hello": 1}\n')
    assert "not a cpbench record" in _one_line_exit_2(capsys, FIXTURE, not_records)
    text = tmp_path / "t.txt"
    text.write_text("FWD 12.3 ms\n")
    assert "not a JSON record" in _one_line_exit_2(capsys, text, FIXTURE)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "no records" in _one_line_exit_2(capsys, FIXTURE, empty)
    assert "No such file" in _one_line_exit_2(capsys, FIXTURE, tmp_path / "missing.jsonl")
    other = copy.deepcopy(_records())
    for r in other:
        r["config"]["attention"]["seqlen"] = 2048
    other_path = _write(tmp_path / "other.jsonl", other)
    assert "no case is in both runs" in _one_line_exit_2(capsys, FIXTURE, other_path)
    assert "give two results files" in _one_line_exit_2(capsys, FIXTURE)
    assert "not a mix" in _one_line_exit_2(capsys, FIXTURE, "--b", FIXTURE)
    assert "--alpha" in _one_line_exit_2(capsys, FIXTURE, FIXTURE, "--alpha", "1.5")


def test_bad_flag_values_are_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cpbench_compare(FIXTURE, FIXTURE, "--format", "csv")
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as e:
        cpbench_compare(FIXTURE, FIXTURE, "--min-effect", "two")
    assert e.value.code == 2 and "cannot read 'two'" in capsys.readouterr().err


def test_a_baseline_timed_at_both_ends_of_a_run_pools_its_samples():
    from cpbench.compare import match

    first = {"config": {"strategy": "local", "options": {}, "attention": {"seqlen": 8}},
             "topology": {"world_size": 2, "ranks_per_node": 1}, "kernel": "k",
             "env": {"utc": "t0"}, "samples_ms": {"fwd": [[1.0, 2.0], [1.5, 2.5]]}}
    last = {**first, "samples_ms": {"fwd": [[3.0], [3.5]]}}
    other_run = {**first, "env": {"utc": "t1"}, "samples_ms": {"fwd": [[9.0], [9.5]]}}
    pooled, = match.latest([first, last]).values()
    assert pooled["samples_ms"]["fwd"] == [[1.0, 2.0, 3.0], [1.5, 2.5, 3.5]]
    alone, = match.latest([first, last, other_run]).values()  # a later run replaces it
    assert alone["samples_ms"]["fwd"] == [[9.0], [9.5]]


# a load section as rank 0's meter reads it with two busy loops on the 2 cores
BUSY = {"foreign_cpu_s": 19.0, "wall_s": 10.0, "cpus": 2, "share": 0.95, "ranks_cores": 2}


def _busy(records: list[dict], which=lambda r: True) -> list[dict]:
    out = copy.deepcopy(records)
    for r in out:
        if which(r):
            r["load"] = BUSY
    return out


def test_runs_that_do_not_measure_cp_get_no_verdict_and_say_why(tmp_path, capsys):
    """Both runs timed while others kept the cores busy: a ×1.2 copy, slower on an idle
    machine, is not comparable, each row saying why; the findings count them."""
    a = _write(tmp_path / "a.jsonl", _busy(_records()))
    b = _write(tmp_path / "b.jsonl", _busy(_map_samples(_records(), _scaled(1.2))))
    assert cpbench_compare(a, b) == 0
    out = capsys.readouterr().out
    assert "slower 0, faster 0, same 0, unclear 0, insufficient 0, not comparable 6" in out
    # each row marked with its reasons, numbered under the table
    assert len(re.findall(r"\[S=1K\] \[1,2\] .*\| not comparable", out)) == 6
    assert "[1] A: others kept 1.9 of 2 cores busy: timings do not measure CP\n" in out
    assert "[2] B: others kept 1.9 of 2 cores busy: timings do not measure CP\n" in out
    assert "6 (case, phase)s are not comparable" in out
    rows = _json(capsys, a, b)
    assert len(rows) == 6 and {r["verdict"] for r in rows} == {"not comparable"}
    for r in rows:  # the times are kept, no ratio is given
        assert r["ratio"] is None and r["median_b_ms"] == pytest.approx(1.2 * r["median_a_ms"])
        assert r["reason"].startswith("A: others kept 1.9 of 2 cores busy: timings do not "
                                      "measure CP; B: others kept")
    assert cpbench_compare(a, b, "--format", "markdown") == 0
    assert "*not comparable*" in capsys.readouterr().out


def test_one_busy_side_leaves_the_other_cases_tested(tmp_path, capsys):
    """B's zigzag alone timed on a busy machine: its rows are not comparable, the others get
    their verdicts (slower, the ×1.2), Holm over those alone."""
    b_records = _busy(_map_samples(_records(), _scaled(1.2)),
                      lambda r: r["config"]["strategy"] == "zigzag")
    b = _write(tmp_path / "b.jsonl", b_records)
    rows = _json(capsys, FIXTURE, b)
    by = {(r["case"].split()[0], r["phase"]): r for r in rows}
    assert {by[("zigzag", p)]["verdict"] for p in ("fwd", "fwd_bwd")} == {"not comparable"}
    assert by[("zigzag", "fwd")]["reason"].startswith("B: others kept 1.9 of 2 cores busy")
    assert {r["verdict"] for k, r in by.items() if k[0] != "zigzag"} == {"slower"}


def test_a_step_timed_with_the_harness_sync_against_one_without_gets_no_verdict(
        tmp_path, capsys):
    """A's records as the timer wrote them before timing.step (BWD on its own, a sync and a
    barrier between FWD and BWD inside FWD+BWD); B's without that sync: not comparable."""
    synced = _records()
    for r in synced:
        r["samples_ms"]["bwd"] = [[b - f for f, b in zip(fr, br)] for fr, br in
                                  zip(r["samples_ms"]["fwd"], r["samples_ms"]["fwd_bwd"])]
    a = _write(tmp_path / "a.jsonl", synced)
    b = _write(tmp_path / "b.jsonl", _records())
    rows = _json(capsys, a, b)
    assert rows and {r["verdict"] for r in rows} == {"not comparable"}
    assert {r["reason"] for r in rows} == {
        "A: FWD+BWD holds the harness's sync and barrier between FWD and BWD (older record), "
        "the other's not"}
    same = _json(capsys, a, _write(tmp_path / "a2.jsonl", synced))  # both synced: tested
    assert "not comparable" not in {r["verdict"] for r in same}


def test_a_run_compared_with_itself_is_warned(tmp_path, capsys):
    """The same path twice, or a copy with the same bytes: one warning line on stderr; two
    different runs: none."""
    copy_path = _write(tmp_path / "copy.jsonl", _records())
    for b in (FIXTURE, copy_path):
        assert cpbench_compare(FIXTURE, b) == 0
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("cpbench compare: warning: A and B ")
        assert err[0].endswith("the run is compared with itself")
    other = _write(tmp_path / "b.jsonl", _map_samples(_records(), _scaled(1.2)))
    assert cpbench_compare(FIXTURE, other) == 0
    assert "compared with itself" not in capsys.readouterr().err


def test_what_else_changed_says_the_load_each_run_ran_under(tmp_path, capsys):
    """The records' load meter readings (``load``: others' CPU seconds over the timing's
    wall time): 0.9 of 2 cores in A, 1.0 in B; the fixture's records have none."""
    records = _records()
    busier = copy.deepcopy(records)
    for r in records:
        r["load"] = {"foreign_cpu_s": 9.0, "wall_s": 10.0, "cpus": 2, "share": 0.45}
    for r in busier:
        r["load"] = {"foreign_cpu_s": 10.0, "wall_s": 10.0, "cpus": 2, "share": 0.5}
    a, b = _write(tmp_path / "a.jsonl", records), _write(tmp_path / "b.jsonl", busier)
    assert cpbench_compare(a, b) == 0
    out = capsys.readouterr().out
    assert "load  others kept 0.9 of 2 cores busy  →  others kept 1.0 of 2 cores busy" in out
    assert "nothing the records capture" not in out
