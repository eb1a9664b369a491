"""The dry run's memory is the memory ``cpbench run`` measures: the same cases on 4 gloo ranks
and on fake tensors, rank by rank, through both CLIs (issue 23's acceptance at a small size)."""

from __future__ import annotations

import json

from test_cli_run import _cpbench

from cpbench import results

STRATEGIES = "zigzag,ring,ulysses,megatron-cp,llama3,usp,burst,double-ring,torch-ring"
PROBLEM = ["--seqlen", "1024", "--heads", "4", "--head-dim", "32", "--dtype", "fp32"]


def _by_case(path) -> dict:
    return {(r["config"]["strategy"], json.dumps(r["config"]["options"], sort_keys=True)):
            r["memory_bytes"] for r in results.read(str(path))
            if r["config"]["strategy"] != "local"}  # the baseline: no dry run


def test_dry_run_peak_is_the_measured_peak(tmp_path):
    run = _cpbench("run", "--strategy", STRATEGIES, "--nproc", "4", *PROBLEM, "--warmup", "0",
                   "--iters", "1", "--out", str(tmp_path / "run.jsonl"), timeout=600)
    assert run.returncode == 0, run.stderr
    # `run --nproc 4` places its ranks 2 nodes x 2 (the topology is part of the case)
    dry = _cpbench("dryrun", "--strategy", STRATEGIES, "--nodes", "2", "--gpus-per-node", "2",
                   *PROBLEM, "--device", "cpu", "--ranks", "0,1,2,3",
                   "--out", str(tmp_path / "dry.jsonl"), timeout=600)
    assert dry.returncode == 0, dry.stderr
    measured, predicted = _by_case(tmp_path / "run.jsonl"), _by_case(tmp_path / "dry.jsonl")
    assert set(predicted) == set(measured) and len(measured) > len(STRATEGIES.split(","))
    off = [(case, p, m) for case in measured for p, m in zip(predicted[case], measured[case])
           if abs(p / m - 1) > 0.10]
    assert not off, off
