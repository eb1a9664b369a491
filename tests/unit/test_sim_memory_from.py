"""``cpbench simulate --memory-from``: a row with a dry run of its case takes the dry run's
peak (the model's estimate and its error kept beside it); a row without one keeps the
estimate; a dry-run peak above the card makes the row OOM."""

from __future__ import annotations

import json

import pytest

from cpbench import results
from cpbench.cli import main

PROBLEM = ["--seqlen", "8k", "--dtype", "bf16", "--heads", "8", "--head-dim", "64"]
TOPO = ["--hardware", "a800-sxm", "--nodes", "1", "--gpus-per-node", "4"]


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    path = tmp_path_factory.mktemp("dry") / "dry.jsonl"
    assert main(["dryrun", "--device", "cpu", *TOPO, *PROBLEM, "--strategy", "zigzag,local",
                 "--out", str(path)]) == 0
    return path


def _simulate(tmp_path, dry_path, capsys) -> tuple[list[dict], str]:
    out = tmp_path / "sim.jsonl"
    assert main(["simulate", *TOPO, *PROBLEM, "--strategy", "zigzag,ring,local",
                 "--memory-from", str(dry_path), "--out", str(out)]) == 0
    return results.read(out), capsys.readouterr().out


def test_rows_with_a_dry_run_take_its_peak(tmp_path, dry, capsys):
    measured = {r["config"]["strategy"]: max(r["memory_bytes"]) for r in results.read(dry)}
    records, text = _simulate(tmp_path, dry, capsys)
    by_name = {r["config"]["strategy"]: r for r in records}
    for name in ("zigzag", "local"):
        sim = by_name[name]["simulation"]
        assert sim["memory_source"] == "dryrun"
        assert by_name[name]["memory_bytes"] == [measured[name]]
        assert sim["memory_model_error"] == pytest.approx(
            sim["memory_model_bytes"] / measured[name] - 1)
    assert by_name["ring"]["simulation"]["memory_source"] == "model"
    assert "memory: 2 row(s) from the dry run" in text and "1 row(s) from the model" in text


def test_a_dry_run_above_the_card_makes_the_row_oom(tmp_path, dry, capsys):
    bigger = tmp_path / "big.jsonl"
    lines = []
    for r in results.read(dry):
        r["memory_bytes"] = [200 * 2 ** 30 for _ in r["memory_bytes"]]
        lines.append(json.dumps(r))
    bigger.write_text("\n".join(lines) + "\n")
    records, _ = _simulate(tmp_path, bigger, capsys)
    zigzag = next(r for r in records if r["config"]["strategy"] == "zigzag")
    assert zigzag["status"] == results.OOM and "the dry run measured" in zigzag["error"]


def test_a_file_without_dry_runs_is_refused(tmp_path, capsys):
    empty = tmp_path / "none.jsonl"
    empty.write_text("")
    assert main(["simulate", *TOPO, *PROBLEM, "--memory-from", str(empty)]) == 2
    assert "no dry-run record" in capsys.readouterr().err
