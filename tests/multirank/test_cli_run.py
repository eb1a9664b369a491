"""End to end, as a user types it: ``cpbench run`` with --nproc, ``cpbench report`` on its
JSONL, and ``torchrun benchmarks/run.py``."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

# starts cpbench commands with ranks of their own: one at a time across xdist workers
pytestmark = pytest.mark.command

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--seqlen", "256", "--heads", "2", "--head-dim", "16", "--warmup", "1",
         "--iters", "2", "--check"]


def _cpbench(*args, timeout=120):
    cmd = [sys.executable, "-c", "import sys; from cpbench.cli import main; sys.exit(main())",
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _summary(text: str) -> str:
    """From the summary title to the end of the efficiency block."""
    tail = text[text.index("Benchmark Summary:"):]
    return tail.split("\nrecords: ")[0].rstrip("\n")


def test_run_then_report_reproduces_the_table(tmp_path):
    out = tmp_path / "r.jsonl"
    run = _cpbench("run", "--strategy", "zigzag,local", "--nproc", "2", *SMALL,
                   "--out", str(out), "--details")
    assert run.returncode == 0, run.stderr
    assert "PASS" in run.stdout and "FAIL" not in run.stdout
    rep = _cpbench("report", str(out))
    assert rep.returncode == 0, rep.stderr
    assert _summary(rep.stdout) == _summary(run.stdout)
    assert "Benchmark Results for" not in rep.stdout  # the blocks are opt-in
    rep = _cpbench("report", str(out), "--details")
    assert rep.stdout.count("Benchmark Results for") == 3  # the baseline at both ends, zigzag
    for block in rep.stdout.split("\n\n" + "=" * 50)[:-1]:  # every detail block, verbatim
        assert block.strip("=\n") in run.stdout
    csv = _cpbench("report", str(out), "--format", "csv")
    df = pd.read_csv(io.StringIO(csv.stdout))
    # the baseline at both ends of the run, both pooled into the efficiency (none where the
    # machine's load or shared cores kept the timings from measuring CP: then it says why)
    assert list(df["strategy"]) == ["local", "zigzag", "local"]
    assert df["cp_efficiency"].notna()[1] == df["not_measured"].isna().all()


def test_torchrun_entry(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", str(REPO / "benchmarks" / "run.py"), "--strategy", "ring",
           *SMALL, "--out", str(tmp_path / "r.jsonl")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    # rank 0 alone prints: one line for the case, no detail block unless --details
    cases = re.findall(r"^\[1/1\] ring: done in .*$", done.stdout, re.M)
    assert len(cases) == 1 and re.search(r", check PASS, FWD \S+ ms, FWD\+BWD \S+ ms(,|$)",
                                         cases[0]), done.stdout
    assert "Benchmark Results for" not in done.stdout and "Benchmark Summary:" in done.stdout
    # a pass the physics guards flag stays a PASS, the flag said after it on both lines (two
    # timed iterations of 256 tokens on a loaded host: a backward timed below its forward)
    assert re.search(r"^1 case\(s\): 1 done; check: 1 PASS( \(1 flagged: ring: .*)?$",
                     done.stdout, re.M), done.stdout  # whole, if not


def test_torchrun_bad_input_is_named_as_the_root_cause(tmp_path):
    """Bad input under a real torchrun: rank 0 says it once, and torchrun's failure summary
    names cpbench's line as the root cause with the worker's exit code 2. torchrun's own
    status stays its own (1: its agent raises ChildFailedError for any failed worker)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", str(REPO / "benchmarks" / "run.py"), "--strategy", "zigzg"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    line = ("cpbench run: error: argument --strategy: unknown strategy 'zigzg' (did you mean "
            "zigzag?); see cpbench strategies")
    workers, summary = done.stderr.split("Traceback (most recent call last)", 1)
    assert workers.count(line) == 1  # rank 0 alone prints
    root = summary.split("Root Cause (first observed failure):", 1)[1]
    assert "exitcode  : 2 " in root
    assert f"traceback : {line}" in root


def test_torchrun_bad_input_is_said_when_rank_0_starts_last(tmp_path):
    """A busy host can start rank 0 seconds after the others (here: 5 s late, by design).
    torchrun's agent stops every worker at the first exit, so the others wait for rank 0:
    it still says the line (it was stopped before it spoke), and is the root cause."""
    late = tmp_path / "late_rank0.py"
    late.write_text("import os, sys, time\n"
                    "if os.environ['RANK'] == '0':\n    time.sleep(5)\n"
                    "from cpbench.run import main\nsys.exit(main())\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", str(late), "--strategy", "zigzg"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    workers, summary = done.stderr.split("Traceback (most recent call last)", 1)
    assert workers.startswith("cpbench run: error: argument --strategy: unknown strategy "
                              "'zigzg'"), done.stderr
    root = summary.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 0 " in root and "exitcode  : 2 " in root


def test_torchrun_refusal_comes_first_in_three_lines_and_keeps_the_question(tmp_path):
    """The headline request under torchrun, as a user types it (torchrun's own 4-line
    OMP_NUM_THREADS banner included): cpbench's refusal starts within the first 5 lines, before
    torchrun's report, in 3 lines of at most 120 columns; its suggestion is the same 4 ranks
    at 512K, on a preset it names."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(REPO / "src")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "4", str(REPO / "benchmarks" / "run.py"), "--strategy", "zigzag", "--seqlen",
           "524288"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env=env)
    lines = done.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("cpbench run: error:"))
    assert first < 5, done.stderr
    refusal = lines[first:first + 3]
    assert [line.startswith("  ") for line in refusal] == [False, True, True]
    assert all(len(line) <= 120 for line in refusal)
    assert "zigzag at seqlen 512K on 4 ranks" in refusal[0]
    # torchrun's 4 local ranks: one node of 4
    assert refusal[2].startswith("  cpbench simulate --nodes 1 --gpus-per-node 4 --strategy "
                                 "zigzag --seqlen 512K")
    assert "preset a800-sxm" in refusal[1]
    assert lines.index(next(line for line in lines if "Traceback" in line)) > first + 2
