"""The driver on real gloo ranks: check, timing, records, the printed tables; an OOM or an
exception in one strategy becomes its row's status and the run goes on."""

from __future__ import annotations

import io
import sys

import torch

from cpbench import report, results, strategies
from cpbench.bench import driver
from cpbench.bench import plan as planning
from cpbench.config import RunConfig
from cpbench.launch import run_ranks
from cpbench.strategies.ring import Ring

SMALL = {"seqlen": 128, "heads": 2, "head_dim": 16}


class InjectedOom(Ring):
    """Runs out of memory on every rank, as equal shards do on a real GPU."""

    name = "test-oom"
    description = "raises torch.OutOfMemoryError (test)"

    def attention(self, q, k, v):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 TiB (injected)")


class InjectedFailure(Ring):
    name = "test-fail"
    description = "raises RuntimeError (test)"

    def attention(self, q, k, v):
        raise RuntimeError("injected failure")


class InjectedError(Ring):
    name = "test-wrong"
    description = "returns a wrong output (test)"

    def attention(self, q, k, v):
        out, lse = super().attention(q, k, v)
        return out * 1.5, lse


def run_driver(rank, world, names, out, check, inject):
    """A rank of ``cpbench run``: returns (exit status, what rank 0 printed)."""
    if inject:  # registered in the rank processes only, never in pytest's own registry
        strategies.register(InjectedOom)
        strategies.register(InjectedFailure)
        strategies.register(InjectedError)
    plan = planning.plan(RunConfig(strategy=names, nproc=world, check=check, out=out, warmup=1,
                                 iters=2), dict(SMALL), {}, launcher="self")
    stdout, sys.stdout = sys.stdout, io.StringIO()
    try:
        code = driver.rank_main(rank, world, plan)
        return code, sys.stdout.getvalue()
    finally:
        sys.stdout = stdout


def test_check_time_record_and_report(tmp_path):
    out = str(tmp_path / "r.jsonl")
    (code, text), (code1, text1) = run_ranks(run_driver, 2, ("ring", "local"), out, True,
                                             False, timeout=120)
    assert code == code1 == 0
    assert text1 == ""  # only rank 0 prints
    verdicts = [line.split()[-1] for line in text.splitlines() if "max abs" in line]
    assert verdicts == ["PASS"] * 10  # out, lse, dq, dk, dv for each strategy
    records = results.read(out)
    assert [r["config"]["strategy"] for r in records] == ["ring", "local"]
    for r in records:
        assert r["status"] == "ok" and r["schema_version"] == results.SCHEMA_VERSION
        assert len(r["samples_ms"]["fwd"]) == 2 and len(r["samples_ms"]["fwd"][0]) == 2
        assert len(r["samples_ms"]["fwd_bwd"]) == 2 and min(r["memory_bytes"]) > 0
        assert r["env"]["hostnames"] and r["env"]["torch"] == torch.__version__
        assert r["derived"] == results.derive(r)
    assert [r["ranks_per_problem"] for r in records] == [2, 1]
    # the printed tables are exactly what the report renders from the file
    assert report.summary(records) in text
    for r in records:
        assert report.detail(r) in text
    assert "CP efficiency = T_local / (N · T_cp)" in text


def test_oom_failure_and_wrong_results_do_not_stop_the_run(tmp_path):
    out = str(tmp_path / "r.jsonl")
    names = ("test-oom", "test-fail", "test-wrong", "ring")
    (code, text), (code1, _) = run_ranks(run_driver, 2, names, out, True, True, timeout=120)
    assert code == code1 == 1  # a failed strategy or check makes the run fail, at the end
    records = results.read(out)
    assert [r["status"] for r in records] == ["OOM", "failed", "ok", "ok"]
    assert [r["derived"]["check_passed"] for r in records] == [None, None, False, True]
    assert "injected" in records[0]["error"] and "injected failure" in records[1]["error"]
    assert "RuntimeError" in records[1]["traceback"]
    lines = report.summary(records).splitlines()
    header = [c.strip() for c in lines[2].split("|")]
    oom = dict(zip(header, (c.strip() for c in lines[4].split("|"))))
    assert [oom[c] for c in ("FWD (ms)", "FWD+BWD (ms)", "TFLOPs/s")] == ["OOM"] * 3
    assert report.summary(records) in text
