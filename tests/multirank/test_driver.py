"""The driver on real gloo ranks: check, timing, records, the printed tables; an OOM or an
exception in one strategy becomes its row's status and the run goes on; a failed memory
measurement keeps the timings; one rank failing inside a ring is recorded with its own error,
the process group is formed again and the next case runs; a rank dying is recorded."""

from __future__ import annotations

import inspect
import io
import os
import subprocess
import sys
import time

import pytest
import torch
from rankpool import run_ranks

from cpbench import launch, report, results, strategies
from cpbench.bench import driver, steps
from cpbench.bench import plan as planning
from cpbench.bench.agreement import is_collective_error
from cpbench.bench.load import Load
from cpbench.config import RunConfig
from cpbench.report.render import WIDE, fitting
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


class InjectedMemoryOom(Ring):
    """Times fine, then runs out of memory in the memory measurement (a call made inside
    ``bench.memory.peak_bytes``: the warm-up's length depends on when the step settles)."""

    name = "test-mem-oom"
    description = "raises torch.OutOfMemoryError when memory is measured (test)"

    def attention(self, q, k, v):
        if any(f.function == "peak_bytes" for f in inspect.stack()):
            raise torch.OutOfMemoryError("CUDA out of memory (injected, memory step)")
        return super().attention(q, k, v)


IDLE = Load(foreign_cpu_s=0.0, wall_s=1.0, cpus=2)  # nobody else on the host
BUSY = Load(foreign_cpu_s=2.0, wall_s=1.0, cpus=2)  # others held both cores


class FixedMeter:
    """The driver's load meter (``steps.meter``) reading ``load`` whatever the host runs:
    the tables' verdicts on the machine then depend on what the test says, not on its load."""

    def __init__(self, load: Load):
        self.fixed, self.load = load, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.load = self.fixed


def run_driver(rank, world, names, out, check, inject, flags=None, attention=None, load=IDLE):
    """A rank of ``cpbench run``: returns (exit status, what rank 0 printed). ``flags``:
    RunConfig fields (default: warm-up 1, 2 iterations); ``attention``: the shape (SMALL);
    ``load``: what rank 0's load meter reads."""
    if inject:  # registered in the rank processes only, never in pytest's own registry
        for cls in (InjectedOom, InjectedFailure, InjectedError, InjectedMemoryOom):
            strategies.register(cls)
        import faults  # noqa: F401 - registers test-oom-in-ring, as the GPU and sbatch jobs do
    flags = {"warmup": 1, "iters": 2} if flags is None else flags
    plan = planning.plan(RunConfig(strategy=names, nproc=world, check=check, out=out, **flags),
                         dict(SMALL if attention is None else attention), {}, launcher="self")
    stdout, sys.stdout = sys.stdout, io.StringIO()
    meter, steps.meter = steps.meter, lambda rank, launcher: FixedMeter(load)
    try:
        code = driver.rank_main(rank, world, plan)
        return code, sys.stdout.getvalue()
    finally:  # the rank serves later tests (rankpool): as it found it
        sys.stdout, steps.meter = stdout, meter


def test_check_time_record_and_report(tmp_path):
    out = str(tmp_path / "r.jsonl")
    (code, text), (code1, text1) = run_ranks(run_driver, 2, ("ring", "local"), out, True,
                                             False, {"warmup": 1, "iters": 2, "details": True},
                                             timeout=120)
    assert code == code1 == 0
    assert text1 == ""  # only rank 0 prints
    verdicts = [line.split()[-1] for line in text.splitlines() if "max abs" in line]
    assert verdicts == ["PASS"] * 15  # out, lse, dq, dk, dv for each case
    records = results.read(out)
    # the baseline timed at both ends of the run
    assert [r["config"]["strategy"] for r in records] == ["local", "ring", "local"]
    for r in records:
        assert r["status"] == "ok" and r["schema_version"] == results.SCHEMA_VERSION
        assert len(r["samples_ms"]["fwd"]) == 2 and len(r["samples_ms"]["fwd"][0]) == 2
        assert len(r["samples_ms"]["fwd_bwd"]) == 2 and min(r["memory_bytes"]) > 0
        assert r["env"]["hostnames"] and r["env"]["torch"] == torch.__version__
        assert r["env"]["cpus_usable"] == len(os.sched_getaffinity(0))
        assert r["derived"] == results.derive(r)
    assert [r["ranks_per_problem"] for r in records] == [1, 2, 1]
    # the printed tables are exactly what the report renders from the file
    assert report.summary(records) in text
    for r in records:
        assert report.detail(r) in text
        assert r["timing"]["split"] and 1 <= r["timing"]["warmup"] <= 3  # 1 at least, + iters
        assert len(r["samples_ms"]["bwd"][0]) == 2 and r["derived"]["bwd_ms"] > 0
        assert r["estimate"]["step_s"] > 0 and r["load"]["wall_s"] > 0
    # the meter read an idle host: the efficiency (a busy one's in the next test)
    assert not any(r["derived"]["not_measured"] for r in records)
    assert "CP efficiency = T_local / (N · T_cp)" in text


def test_rounds_record_abba_order_check_once_and_pool_in_the_summary(tmp_path):
    out = str(tmp_path / "r.jsonl")
    flags = {"warmup": 1, "iters": 2, "rounds": 2}
    (code, text), _ = run_ranks(run_driver, 2, ("zigzag", "ring"), out, True, False, flags,
                                None, BUSY, timeout=120)
    assert code == 0
    # the meter read a host others kept busy: every row says its timings do not measure CP
    assert "not measuring CP:" in text and "CP efficiency =" not in text
    records = results.read(out)
    assert all("others kept 2.0 of 2 cores busy" in r["derived"]["not_measured"]
               for r in records)
    assert [(r["config"]["strategy"], r["round"]["index"]) for r in records] == [
        ("zigzag", 0), ("ring", 0), ("ring", 1), ("zigzag", 1)]
    assert [bool(r["check"]) for r in records] == [True, True, False, False]
    assert all(c["rms_rel"] is not None for c in records[0]["check"])
    summary = text[text.index("Benchmark Summary"):].splitlines()
    # one pooled row, one drift line (a guard's flag may name the strategy too, under load)
    rows = [line for line in summary
            if "|" in line and line.split("|")[0].split()[:1] == ["zigzag"]]
    drift = [line for line in summary if line.strip().startswith("zigzag S=")]
    assert len(rows) == 1 and len(drift) == 1, "\n".join(summary)
    assert "Drift between rounds (each round's median; the rows pool all rounds):" in summary


def test_oom_failure_and_wrong_results_do_not_stop_the_run(tmp_path):
    out = str(tmp_path / "r.jsonl")
    names = ("test-oom", "test-fail", "test-wrong", "test-mem-oom", "ring")
    (code, text), (code1, _) = run_ranks(run_driver, 2, names, out, True, True, timeout=120)
    assert code == code1 == 1  # a failed strategy or check makes the run fail, at the end
    records = results.read(out)
    assert [r["status"] for r in records] == ["OOM", "failed", "ok", "ok", "ok"]
    assert [r["derived"]["check_passed"] for r in records] == [None, None, False, True, True]
    assert "injected" in records[0]["error"] and "injected failure" in records[1]["error"]
    assert "RuntimeError" in records[1]["traceback"]
    with fitting(WIDE):  # every column, seed 001's layout
        lines = report.summary(records).splitlines()
    header = [c.strip() for c in lines[2].split("|")]
    cells = [dict(zip(header, (c.strip() for c in line.split("|")))) for line in lines[4:9]]
    assert [cells[0][c] for c in ("FWD (ms)", "FWD+BWD (ms)", "TFLOP/s/rank")] == ["OOM"] * 3
    # memory ran out of memory after the timings: they stay, memory is null with the reason
    mem = records[3]
    assert mem["memory_bytes"] is None and mem["memory_status"] == "OOM"
    assert "injected, memory step" in mem["memory_error"]
    assert len(mem["samples_ms"]["fwd"]) == len(mem["samples_ms"]["fwd_bwd"]) == 2
    assert mem["derived"]["fwd_bwd_ms"] > 0 and "memory_mb" not in mem["derived"]
    assert cells[3]["Memory (MB)"] == "OOM" and float(cells[3]["FWD+BWD (ms)"]) > 0
    assert report.summary(records) in text


def test_an_oom_inside_a_ring_is_recorded_and_the_next_case_runs(tmp_path):
    """Rank 1 runs out of memory at its third call while rank 0 waits for it in the ring,
    with default flags at S = 2K (`cpbench run --strategy test-oom-in-ring,zigzag --nproc 2
    --seqlen 2k`): the case is recorded OOM with rank 1's message, the ranks form the process
    group again and zigzag runs; well within two minutes (not a 600 s collective timeout)."""
    out = str(tmp_path / "r.jsonl")
    t0 = time.monotonic()
    (code, text), (code1, _) = launch.run_ranks(  # new ranks: the recovery re-forms the world
        run_driver, 2, ("test-oom-in-ring", "zigzag"), out, False, True, {},
        {"seqlen": 2048}, timeout=120, collective_timeout=None, leave_together=False)
    took = time.monotonic() - t0
    assert took < 60, took
    assert code == code1 == 0  # an OOM row is a result, not a failure of the run
    records = results.read(out)
    assert [(r["config"]["strategy"], r["status"]) for r in records] == [
        ("test-oom-in-ring", "OOM"), ("zigzag", "ok")]
    assert records[0]["error"].startswith("rank 1: OutOfMemoryError: CUDA out of memory "
                                          "(injected on rank 1, call 3)")
    assert records[0]["config"]["run"]["collective_timeout"] is None  # the default: per case
    assert records[1]["derived"]["fwd_bwd_ms"] > 0
    assert "forming the process group again" in text and "not run" not in text


@pytest.mark.parametrize("dies", [0, 1])
def test_a_rank_dying_mid_case_is_recorded_as_failed(tmp_path, dies):
    """`cpbench run --nproc 2` where one rank's process exits inside the second case: the
    first case's record is kept, the dying case is recorded failed, the third is named as not
    run, exit 1. Rank 1 dying: rank 0 sees its collective fail and records the case. Rank 0
    dying: no rank is left to write, so the launching process records it."""
    out = tmp_path / "r.jsonl"
    code = "import sys, dying; from cpbench.cli import main; sys.exit(main(sys.argv[1:]))"
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "CPBENCH_TEST_DIE_RANK": str(dies),
           "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", code, "run", "--strategy", "ring,test-die,local", "--nproc", "2",
         "--seqlen", "128", "--heads", "2", "--head-dim", "16", "--warmup", "0", "--iters", "1",
         "--out", str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stderr
    records = results.read(out)
    assert [(r["config"]["strategy"], r["status"]) for r in records] == [
        ("local", "ok"), ("ring", "ok"), ("test-die", "failed")]
    assert records[1]["derived"]["fwd_bwd_ms"] > 0
    assert f"rank {dies} died with exit code 7" in done.stderr
    if dies == 0:  # the launcher matched the first local's record, not the last's
        assert "rank 0 died with exit code 7" in records[2]["error"]
    else:  # rank 0's own view: its collective with the dead rank failed
        error = records[2]["error"]
        assert error.startswith("rank 0: ") and is_collective_error(RuntimeError(error))
    assert "not run: local" in done.stdout + done.stderr
