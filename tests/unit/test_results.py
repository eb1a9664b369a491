"""JSONL records: whole-line appends, a torn last line skipped with a warning, derived figures
recomputed from the raw samples."""

import fcntl
import json
import logging
import threading

import pytest

from cpbench import results
from cpbench.errors import UsageError
from cpbench.report import dataframe, labels


def fake_record(strategy="zigzag", *, status="ok", fwd=None, fwd_bwd=None, memory=None,
                ranks_per_problem=4, options=None, defaults=None, seqlen=1024, check=None,
                fwd_only=False, error=None, resolved=None, memory_status=None,
                memory_error=None, samples=None, bwd=None):
    """A record as the driver writes it (4 ranks, 2 × 2), with given per-rank samples (BWD:
    by default each iteration's FWD+BWD less its FWD, as a step timed part by part gives)."""
    world = 4
    fwd = fwd if fwd is not None else [[10.0, 11.0, 12.0]] * world
    fwd_bwd = fwd_bwd if fwd_bwd is not None else [[30.0, 31.0, 35.0]] * world
    if bwd is None:
        bwd = [[b - f for f, b in zip(fr, br)] for fr, br in zip(fwd, fwd_bwd)]
    ok = status == "ok"
    record = {
        "schema_version": results.SCHEMA_VERSION,
        "config": {"strategy": strategy, "options": options or {},
                   "option_defaults": defaults if defaults is not None else (options or {}),
                   "attention": {"batch": 1, "seqlen": seqlen, "heads": 8, "kv_heads": None,
                                 "head_dim": 32, "dtype": "fp32", "causal": True},
                   "run": {"device": "cpu", "warmup": 1, "iters": 3, "fwd_only": fwd_only,
                           "kernel": "auto", "check": check is not None, "seed": 0}},
        "kernel": "sdpa-cpu",
        "topology": {"world_size": world, "ranks_per_node": 2, "num_nodes": 2},
        "ranks_per_problem": ranks_per_problem,
        "env": {"utc": "2025-01-01T00:00:00Z", "git_sha": "abc"},
        "status": status, "error": error,
        "resolved": resolved,
        "samples_ms": samples if samples is not None else
        ({"fwd": fwd, **({} if fwd_only else {"bwd": bwd}),
          "fwd_bwd": None if fwd_only else fwd_bwd} if ok else None),
        "memory_bytes": (memory or [2 ** 20] * world) if ok and not memory_status else None,
        "memory_status": memory_status, "memory_error": memory_error,
        "check": check,
    }
    record["derived"] = results.derive(record)
    return record


def test_append_read_roundtrip(tmp_path):
    path = tmp_path / "sub" / "r.jsonl"
    recs = [fake_record("ring"), fake_record("zigzag", status="OOM")]
    for r in recs:
        results.append(path, r)
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 3  # whole lines, newline-terminated
    assert results.read(path) == recs


def test_append_waits_for_the_file_lock(tmp_path):
    """Another writer holding the lock (an array task on NFS) delays the append until it lets
    go, so two records never interleave."""
    path = tmp_path / "r.jsonl"
    path.touch()
    done = threading.Event()
    with open(path, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        writer = threading.Thread(target=lambda: (results.append(path, fake_record()),
                                                  done.set()))
        writer.start()
        assert not done.wait(0.3) and path.read_bytes() == b""
    writer.join(5)
    assert done.is_set() and len(results.read(path)) == 1


def test_torn_last_line_skipped_with_warning(tmp_path, caplog):
    path = tmp_path / "r.jsonl"
    results.append(path, fake_record("ring"))
    line = json.dumps(fake_record("zigzag"))
    with open(path, "a") as f:
        f.write(line[: len(line) // 2])  # a run killed mid-write
    with caplog.at_level(logging.WARNING, logger="cpbench"):
        got = results.read(path)
    assert [r["config"]["strategy"] for r in got] == ["ring"]
    assert "torn last line" in caplog.text


def test_damaged_middle_line_and_newer_schema_are_errors(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("{not json\n" + json.dumps(fake_record()) + "\n")
    with pytest.raises(ValueError, match=":1: not a JSON record"):
        results.read(path)
    newer = dict(fake_record(), schema_version=results.SCHEMA_VERSION + 1)
    path.write_text(json.dumps(newer) + "\n")
    with pytest.raises(ValueError, match="upgrade cpbench"):
        results.read(path)


def test_derive_median_of_slowest_rank():
    fwd = [[10.0, 20.0, 30.0], [12.0, 18.0, 50.0], [11.0, 19.0, 29.0], [9.0, 21.0, 1.0]]
    both = [[40.0, 60.0, 50.0]] * 3 + [[41.0, 61.0, 51.0]]
    bwd = [[25.0, 33.0, 30.0]] * 3 + [[24.0, 32.0, 31.0]]
    r = fake_record(fwd=fwd, fwd_bwd=both, bwd=bwd, memory=[1, 2 ** 21, 3, 4])
    d = results.derive(r)
    assert d["fwd_ms"] == 21.0  # slowest per iteration: 12, 21, 50
    assert d["fwd_bwd_ms"] == 51.0  # 41, 61, 51
    assert d["bwd_ms"] == 31.0  # timed on its own: 25, 33, 31 (not FWD+BWD - FWD = 30)
    assert d["memory_mb"] == 2.0
    assert d["slowest_rank_fwd_bwd"] == 3
    assert d["fwd_bwd_tflops"] == pytest.approx(
        results.problem_flops(r["config"]["attention"], "fwd_bwd") / 4 / 0.051 / 1e12)


def test_an_old_record_has_no_backward_by_subtraction():
    """Records before the backward was timed on its own: FWD+BWD − FWD of two loops' medians
    (once negative) is no measurement, so there is no BWD."""
    old = fake_record(samples={"fwd": [[40.0, 41.0, 42.0]] * 4,
                               "fwd_bwd": [[30.0, 31.0, 35.0]] * 4})
    d = results.derive(old)
    assert d["bwd_ms"] is None and d["bwd_tflops"] is None and d["fwd_bwd_ms"] == 31.0


def test_derive_failed_and_fwd_only():
    assert "fwd_ms" not in results.derive(fake_record(status="OOM"))
    d = results.derive(fake_record(fwd_only=True))
    assert d["fwd_ms"] == 11.0 and "fwd_bwd_ms" not in d


def test_what_was_measured_before_a_failure_is_derived():
    r = fake_record(status="OOM", samples={"fwd": [[10.0, 11.0, 12.0]] * 4, "fwd_bwd": None})
    d = results.derive(r)
    assert d["fwd_ms"] == 11.0 and "fwd_bwd_ms" not in d
    m = fake_record(memory_status="OOM", memory_error="rank 0: OutOfMemoryError")
    assert results.derive(m)["fwd_bwd_ms"] == 31.0 and "memory_mb" not in results.derive(m)


def test_options_label_shows_what_the_strategy_resolved():
    defaults = {"placement": "head-first", "ulysses_degree": 0, "ring_impl": "zigzag"}
    r = fake_record("usp", options=defaults, defaults=defaults,
                    resolved={**defaults, "ulysses_degree": 2, "ring_degree": 2})
    assert labels.options_label(r) == "head-first ulysses_degree=2 ring_degree=2"
    w = fake_record("double-ring", options={"window": 0}, resolved={"window": 2})
    assert labels.options_label(w) == "window=2"
    nested = fake_record("usp", options=defaults, defaults=defaults,
                         resolved={**defaults, "ulysses_degree": 2, "ring_impl": "double-ring",
                                   "ring_options": {"window": 2}})
    assert labels.options_label(nested) == \
        "head-first ulysses_degree=2 ring_impl=double-ring ring_options={window=2}"


def test_options_label():
    r = fake_record("usp", options={"placement": "ring-first", "ulysses_degree": 2,
                                    "ring_impl": "zigzag"},
                    defaults={"placement": "head-first", "ulysses_degree": 0,
                              "ring_impl": "zigzag"})
    assert labels.options_label(r) == "ring-first ulysses_degree=2"
    assert labels.options_label(fake_record("ring")) == "-"


def test_to_frame():
    df = dataframe.to_frame([fake_record("ring"), fake_record("local", ranks_per_problem=1)])
    assert list(df["strategy"]) == ["ring", "local"]
    assert df.loc[0, "fwd_ms"] == 11.0 and df.loc[1, "ranks_per_problem"] == 1


@pytest.mark.parametrize("text", ["not json at all\n", '{"a": 1}\n', "[1, 2]\n"])
def test_a_file_of_no_records_is_an_error_not_an_empty_report(tmp_path, capsys, text):
    """A torn last line is forgiven only after valid records: a file whose only line is not a
    record is the wrong file (exit 2, one line), not "no records"."""
    from cpbench.cli import main

    path = tmp_path / "r.jsonl"
    path.write_text(text)
    with pytest.raises(UsageError, match=":1: not a"):
        results.read(path)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cpbench report: error:") and ":1:" in err


def test_make_record_is_the_schema_and_survives_the_file(tmp_path):
    from cpbench.config import AttentionConfig, RunConfig
    from cpbench.strategies.usp import Usp

    opts = Usp.Options(placement="ring-first")
    rec = results.make_record(
        strategy="usp", options=opts, attention=AttentionConfig(seqlen=256),
        run=RunConfig(strategy=("usp",)).resolved("cpu"), kernel="sdpa-cpu", world_size=4,
        ranks_per_node=2, ranks_per_problem=4, env={"utc": "x"},
        samples_ms={"fwd": [[2.0, 4.0]] * 4, "fwd_bwd": [[6.0, 8.0]] * 4})
    assert rec["config"]["options"]["placement"] == "ring-first"
    assert rec["config"]["option_defaults"]["placement"] == "head-first"
    assert rec["topology"] == {"world_size": 4, "ranks_per_node": 2, "num_nodes": 2}
    assert rec["memory_bytes"] is None and rec["check"] is None and rec["status"] == "ok"
    assert rec["derived"]["fwd_ms"] == 3.0 and rec["derived"]["fwd_bwd_ms"] == 7.0
    results.append(tmp_path / "r.jsonl", rec)
    assert results.read(tmp_path / "r.jsonl") == [rec]
    assert results.record_key(rec) == results.record_key(json.loads(json.dumps(rec)))
    with pytest.raises(AssertionError):
        results.make_record(strategy="usp", options=opts, attention=AttentionConfig(),
                            run=RunConfig(), kernel="k", world_size=1, ranks_per_node=1,
                            ranks_per_problem=1, env={}, samples=[])  # not a schema key


def test_a_record_timed_with_the_harness_sync_inside_fwd_bwd_is_read_and_marked():
    """Before ``timing.step``, a sync and a barrier sat between FWD and BWD, inside FWD+BWD."""
    old = fake_record()
    assert old["derived"]["step_synced"] == results.STEP_SYNCED
    assert old["derived"]["fwd_bwd_ms"] == 31.0  # still read: the median of 30, 31, 35
    new = {**old, "timing": {"warmup": 1, "settled": True, "step": "back-to-back"}}
    assert "step_synced" not in results.derive(new)
    fwd_only = fake_record(fwd_only=True)  # no BWD part: nothing between parts
    assert "step_synced" not in fwd_only["derived"]
