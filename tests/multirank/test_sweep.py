"""``cpbench sweep`` end to end with real launches (2 local gloo ranks, tiny shapes): failures
recorded and passed over, a re-run that launches nothing, ``--rerun-failed``, Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpbench import results
from cpbench.sweep import runner

# starts cpbench commands with ranks of their own: one at a time across xdist workers
pytestmark = pytest.mark.command

REPO = Path(__file__).resolve().parents[2]
# collective_timeout: a hang guard. Under two busy loops a starved rank kept its peer in one
# collective past the 60-s floor of the derived timeout, and the case failed (its peer left)
BASE = ("base: {nproc: 2, heads: 2, head_dim: 16, seqlen: 256, warmup: 0, iters: 1, "
        "collective_timeout: 900}\n")


# a guard against a hang, not a measure: under others' load a launch's start (python, torch)
# alone took a minute (busy-loop runs of the suite: 3 cases past 120 s; a sweep past 600 s)
def _sweep(*args, timeout=1200):
    cmd = [sys.executable, "-m", "cpbench.cli", "sweep", *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=env)


def _statuses(out: Path) -> list[tuple[str, int, str]]:
    return [(r["config"]["strategy"], r["config"]["run"]["seed"], r["status"])
            for r in results.read(out)]


@pytest.mark.timeout(3700)  # three sweeps, each under _sweep's hang guard
def test_failures_recorded_then_resume_then_rerun_failed(tmp_path):
    config, out = tmp_path / "s.yaml", tmp_path / "r.jsonl"
    # case 1 dies at run time (its --deadline stops the launch before any rank reports),
    # case 2 outlives its timeout; case 3 runs: one bad case must not cost the others
    config.write_text(BASE + """cases:
  - {strategy: ring, seed: 1, deadline: 0.5}
  - {strategy: ring, seed: 2, timeout: 0.5}
  - {strategy: zigzag, seed: 3}
""")
    first = _sweep(config, "--out", out)
    assert first.returncode == 1, first.stdout + first.stderr
    assert _statuses(out) == [("ring", 1, results.FAILED), ("ring", 2, results.TIMEOUT),
                              ("zigzag", 3, results.OK)]
    failed, timed_out = results.read(out)[:2]
    # the launch itself recorded the case its deadline stopped (cpbench run keeps what it lost)
    assert "did not finish" in failed["error"] and "(--deadline)" in failed["error"]
    assert failed["env"]["launcher"] == "self" and "sweep" not in failed
    assert "timeout of 0.5 s" in timed_out["error"]
    # not a tty: one plain line per case, no \r, folded at 120 columns (continued by "  ")
    assert max(len(line) for line in first.stdout.splitlines()) <= 120
    lines = re.sub(r"\n  (?=\S)", " ", first.stdout).splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == ["[1/3] strategy=ring seed=1 "
                                                          "deadline=0.5", "[2/3] strategy=ring "
                                                          "seed=2 timeout=0.5",
                                                          "[3/3] strategy=zigzag seed=3"]
    # the clock's reading is the host's (minutes under two busy loops): its form is ours
    assert re.search(r"\| elapsed \d+:\d\d:\d\d \| ~\d+:\d\d:\d\d left$", lines[2]), lines[2]
    assert "\r" not in first.stdout

    before = out.read_bytes()
    again = _sweep(config, "--out", out)  # nothing to do: no launch, no record
    assert again.returncode == 0, again.stdout + again.stderr
    assert out.read_bytes() == before
    assert "0 case(s) run, 3 skipped" in again.stdout
    assert again.stdout.count("--rerun-failed retries it") == 2
    assert "[3/3] strategy=zigzag seed=3: done earlier" in again.stdout

    # case 2's cause gone (the same row: a timeout is not part of a row's key); case 1 still
    # fails: --rerun-failed retries both, and only them
    config.write_text(BASE + """cases:
  - {strategy: ring, seed: 1, deadline: 0.5}
  - {strategy: ring, seed: 2}
  - {strategy: zigzag, seed: 3}
""")
    rerun = _sweep(config, "--out", out, "--rerun-failed")
    assert rerun.returncode == 1, rerun.stdout + rerun.stderr
    assert _statuses(out)[3:] == [("ring", 1, results.FAILED), ("ring", 2, results.OK)]
    assert "2 case(s) run, 1 skipped" in rerun.stdout
    assert "[3/3] strategy=zigzag seed=3: done earlier" in rerun.stdout


def _procs(*, mentioning: str | None = None, group: int | None = None) -> list[int]:
    """Processes whose command line mentions ``mentioning`` or whose process group is
    ``group``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            state, pgid = stat[0], int(stat[2])
        except (OSError, IndexError, ValueError):
            continue
        if state != "Z" and ((mentioning and mentioning.encode() in cmdline)
                             or pgid == group):  # zombies are gone, only not yet reaped
            found.append(int(pid))
    return found


def _signal_state(pid: int) -> str:
    """Each thread's signal masks and where it waits: why a process did not act on a signal."""
    keys = ("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    parts = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task")):
        try:
            lines = Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines()
            wchan = Path(f"/proc/{pid}/task/{tid}/wchan").read_text()
        except OSError:
            continue
        fields = [line.split(":\t")[1] for line in lines if line.split(":")[0] in keys]
        parts.append(f"{tid} {wchan} {' '.join(fields)}")
    return "; ".join(parts)


@pytest.mark.timeout(600)  # the start guard below, then the stop
def test_ctrl_c_stops_the_case_and_leaves_a_readable_file(tmp_path):
    config, out = tmp_path / "s.yaml", tmp_path / "r.jsonl"
    config.write_text(BASE + "cases: [{strategy: ring, iters: 100000}]\n")
    cmd = [sys.executable, "-m", "cpbench.cli", "sweep", str(config), "--out", str(out)]
    # a suite started in the background by a script (`make test &`) ignores SIGINT, and so
    # would the sweep (an inherited SIG_IGN survives exec, and Python keeps it): start it as a
    # terminal would, its SIGINT at the default
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=REPO)
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        _interrupt_and_check(proc, out)
    finally:  # a failed or interrupted test leaves no sweep of 100,000 iterations running
        _kill_all(proc)


def _kill_all(proc) -> None:
    proc.kill()  # in pytest's own group: killed alone
    for pid in _procs(mentioning=str(proc.args[-1])):  # the case's launch leads its group
        try:
            if os.getpgid(pid) != os.getpgid(0):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=30)


def _interrupt_and_check(proc, out: Path) -> None:
    deadline, group = time.monotonic() + 240, None  # a hang guard: a busy host starts slowly
    while time.monotonic() < deadline:  # until the case's launch has started its 2 ranks
        leaders = [p for p in _procs(mentioning=str(out)) if p != proc.pid]  # `cpbench run`
        group = os.getpgid(leaders[0]) if leaders else None
        if group is not None and len(_procs(group=group)) >= 3:
            break
        time.sleep(0.2)
    if group is None or len(_procs(group=group)) < 3:  # say why where the sweep stopped
        said = proc.communicate(timeout=30)[1][-2000:] if proc.poll() is not None else ""
        pytest.fail(f"the case did not start (the sweep: exit {proc.poll()}) {said}")
    assert group != os.getpgid(proc.pid)  # the launch leads its own group: it and its ranks
    before = _signal_state(proc.pid)
    proc.send_signal(signal.SIGINT)
    # a hang guard past the sweep's own stop: SIGTERM, up to KILL_GRACE_S, SIGKILL, as long
    # again for the group to go (30 s failed in CI and under load with the sweep still in it)
    try:
        stdout, stderr = proc.communicate(timeout=2 * runner.KILL_GRACE_S + 30)
    except subprocess.TimeoutExpired:
        now = _signal_state(proc.pid)
        raise AssertionError(f"the sweep did not stop; before SIGINT: {before}; now: {now}; "
                             f"its group: {_procs(group=group)}") from None
    assert proc.returncode == 130, stdout + stderr
    assert "interrupted" in stderr
    assert not out.exists() or results.read(out) == []  # the interrupted case wrote nothing
    assert _procs(group=group) == []  # the whole process group was stopped
