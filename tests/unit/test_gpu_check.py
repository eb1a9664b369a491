"""scripts/gpu_check.py (`make gpu-check`): its runner (a command past its limit killed with its
children, the run going on after a failure, steps out of time skipped, the summary written),
what each step plans with a GPU, with fake CUDA only and with neither, and how its findings
read real records: kernels beside FA2's published figures, the run's memory beside its dry
run's, strategies' verdicts under threads. The end-to-end CPU run is CI's `make gpu-check`."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import gpu_check  # noqa: E402
import gpu_check_report as report  # noqa: E402
import gpu_check_runner as runner  # noqa: E402
import gpu_check_steps as steps  # noqa: E402

CPU_ENV = {"torch": "2.13.0+cpu", "cuda": None, "cuda_available": False}
FAKE_ENV = {"torch": "2.14.1+cu130", "cuda": "13.0", "cuda_available": False}
GPU_ENV = {"torch": "2.11.0+cu130", "cuda": "13.0", "cuda_available": True,
           "gpu": "NVIDIA H200", "modules": {"flash_attn": False, "flash_attn_interface": False}}
CUDA_STEPS = {"sdpa", "kernels", "threads", "gpu-tests", "calibrate"}


def _ctx(tmp_path, env) -> gpu_check.Context:
    ctx = gpu_check.Context(sys.executable, tmp_path)
    ctx.logs.mkdir(parents=True, exist_ok=True)
    ctx.adopt(env)
    return ctx


def _py(code: str, timeout: float, label: str = "py") -> steps.Command:
    return steps.Command(label, [sys.executable, "-c", code], timeout)


def _argv_of(proc: Path) -> list[str]:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:  # gone meanwhile
        return []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow  # seconds of waiting on a child's limit (test-fast leaves it out)
def test_a_command_past_its_limit_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    # sh, not python: its grandchild and pid file exist within milliseconds, well inside the
    # 2-s limit on a busy host too (a python took longer there: no pid file, CI failed)
    slow = steps.Command("sh", ["sh", "-c", f"sleep 60 & echo $! > {pid_file}; echo started; "
                                            "sleep 60"], 2)
    step = steps.Step("slow", "a slow step", 60, lambda c: [slow, _py("print(7)", 30)])
    t0 = time.monotonic()
    result = runner.run_step(step, 1, _ctx(tmp_path, CPU_ENV), time.monotonic() + 60,
                                lambda line: None)
    assert time.monotonic() - t0 < 30
    assert [c["status"] for c in result["commands"]] == ["timeout", "ok"]
    assert result["status"] == "timeout"
    assert not _alive(int(pid_file.read_text()))  # the grandchild went with the group
    log = (tmp_path / "logs" / "01-slow.log").read_text()
    assert "started" in log and "# timeout" in log and "\n7\n" in log


def test_a_command_refused_as_bad_usage_stops_its_step_only(tmp_path):
    """Exit 2 (a flag this cpbench lacks: --launcher threads before it exists) would refuse
    the step's later commands alike: they are skipped, saying so."""
    usage = "import sys; print('error: unrecognized arguments: --launcher', file=sys.stderr); " \
            "sys.exit(2)"
    step = steps.Step("t", "threads", 60, lambda c: [_py(usage, 30, "n=2"), _py("1", 30, "n=4")])
    result = runner.run_step(step, 5, _ctx(tmp_path, CPU_ENV), time.monotonic() + 60,
                                lambda line: None)
    assert [c["status"] for c in result["commands"]] == ["failed", "skipped"]
    assert result["reason"] == ("n=2: exit 2: error: unrecognized arguments: --launcher; 1 "
                                "command(s) skipped: 'n=2' was refused (exit 2: bad usage), "
                                "see the log")


def _fake_steps(monkeypatch):
    env = 'print("GPU_CHECK_ENV " + __import__("json").dumps(%r))' % CPU_ENV
    monkeypatch.setattr(steps, "STEPS", [
        steps.Step("env", "env", 30, lambda c: [_py(env, 30)], steps.read.read_env),
        steps.Step("broken", "fails", 30, lambda c: [
            _py("import sys; print('boom: no such thing', file=sys.stderr); sys.exit(3)", 30),
            _py("print('after')", 30)]),
        steps.Step("cuda", "a CUDA step", 30, steps._gpu),
        steps.Step("slow", "eats the budget", 600, lambda c: [_py("import time; "
                                                                  "time.sleep(60)", 600)]),
        steps.Step("late", "after the budget", 30, lambda c: [_py("print(1)", 30)]),
    ])
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 1)


# real commands against a real budget of seconds: others' load moves what runs out of time
# (two busy loops: a step's first command past its cap), so it runs in CI's idle phase
@pytest.mark.timing
def test_the_run_goes_on_after_a_failure_and_skips_what_is_out_of_time(tmp_path, monkeypatch,
                                                                       capsys):
    _fake_steps(monkeypatch)
    out = tmp_path / "results"
    rc = gpu_check.main(["--out", str(out), "--budget", "8"])
    summary = json.loads((out / "summary.json").read_text())
    got = {s["key"]: (s["status"], s.get("reason", "")) for s in summary["steps"]}
    assert rc == 1  # a step failed
    assert got["env"][0] == "ok"
    assert got["broken"] == ("failed", "py: exit 3: boom: no such thing")  # the next one ran
    assert got["cuda"] == ("skipped", "no CUDA: torch 2.13.0+cpu is a build without CUDA")
    assert got["slow"][0] == "timeout" and got["late"] == ("skipped", "out of time")
    assert summary["where"].startswith("no CUDA")
    page = (out / "summary.md").read_text()
    assert "out of time" in page and "no CUDA: torch 2.13.0+cpu" in page
    capsys.readouterr()
    assert gpu_check.main(["--report", str(out)]) == 0
    assert capsys.readouterr().out == page  # the reader renders the folder's page
    assert gpu_check.main(["--report", str(tmp_path / "nothing")]) == 2


def test_compact_packs_the_logs_and_a_rerun_replaces_only_its_own_files(tmp_path,
                                                                        monkeypatch):
    _fake_steps(monkeypatch)
    monkeypatch.setattr(steps, "STEPS", steps.STEPS[:2])
    out = tmp_path / "results"
    gpu_check.main(["--out", str(out), "--compact"])
    (out / "mine.txt").write_text("kept")
    gpu_check.main(["--out", str(out), "--compact"])
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "mine.txt", "records.jsonl",
                                                     "summary.json", "summary.md"]
    foreign = tmp_path / "elsewhere"
    (foreign / "logs").mkdir(parents=True)
    (foreign / "logs" / "x").write_text("not ours")
    assert gpu_check.main(["--out", str(foreign)]) == 2
    assert (foreign / "logs" / "x").exists()


# real commands against a real budget of seconds: others' load moves what runs out of time
# (two busy loops: a step's first command past its cap), so it runs in CI's idle phase
@pytest.mark.timing
def test_only_reruns_one_step_under_the_whole_budget(tmp_path, monkeypatch):
    """On a GPU a step stops at its cap and a command at its limit; --only STEP runs that step
    alone (after env), under the rerun budget instead: what ran out of time gets the room."""
    env = 'print("GPU_CHECK_ENV " + __import__("json").dumps(%r))' % GPU_ENV
    two_s = "import time; time.sleep(2)"
    monkeypatch.setattr(steps, "STEPS", [
        steps.Step("env", "env", 30, lambda c: [_py(env, 30)], steps.read.read_env),
        steps.Step("limited", "a command past its limit", 30, lambda c: [_py(two_s, 1)]),
        steps.Step("capped", "a step past its cap", 6, lambda c: [_py(two_s, 30, "first"),
                                                                 _py("print(1)", 30, "then")]),
        steps.Step("other", "another", 30, lambda c: [_py("print(1)", 30)])])
    out = tmp_path / "all"
    assert gpu_check.main(["--out", str(out), "--steps", "limited,capped"]) == 1
    got = {s["key"]: (s["status"], s["reason"]) for s in
           json.loads((out / "summary.json").read_text())["steps"]}
    assert got["limited"][0] == "timeout"
    assert got["capped"] == ("partial", "1 command(s) skipped: out of time")
    for key in ("limited", "capped"):
        out = tmp_path / key
        assert gpu_check.main(["--out", str(out), "--only", key]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert [(s["key"], s["status"]) for s in summary["steps"]] == [
            ("env", "ok"), *[(k, "ok" if k == key else "skipped")
                             for k in ("limited", "capped", "other")]]
        assert summary["steps"][-1]["reason"] == "not chosen (--only)"
        assert summary["budget_s"] == gpu_check.ONLY_BUDGET_S
    assert gpu_check.main(["--out", str(tmp_path / "x"), "--only", "nope"]) == 2
    with pytest.raises(SystemExit) as bad:  # one or the other
        gpu_check.main(["--out", str(tmp_path / "x"), "--only", "slow", "--steps", "slow"])
    assert bad.value.code == 2


def test_the_caps_fit_the_budget_and_a_rerun_and_the_docs_say_them():
    """The whole run on a GPU: every step gets its cap inside the default budget (the last,
    uncapped, at least a step's minimum), and no step needs more than a rerun has; the page's
    step table lists the steps in this order with these caps."""
    caps = [s.timeout_s for s in steps.STEPS]
    assert caps[-1] is None and None not in caps[:-1]
    assert sum(caps[:-1]) + gpu_check.MIN_STEP_S <= gpu_check.DEFAULT_BUDGET_S
    assert max(caps[:-1]) < gpu_check.ONLY_BUDGET_S
    page = (SCRIPTS.parent / "docs" / "gpu-check.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `([\w-]+)` \|.*\| (\d+|the rest[^|]*) \|[^|]*\|$", page,
                      re.M)
    assert [(int(n), key, cap) for n, key, cap in rows] == [
        (i + 1, s.key, str(s.timeout_s) if s.timeout_s else rows[-1][2])
        for i, s in enumerate(steps.STEPS)]
    assert f"--budget SECONDS` (default {gpu_check.DEFAULT_BUDGET_S}" in page


def test_a_relative_out_holds_every_file_the_steps_write(tmp_path, monkeypatch):
    """The steps' commands run in the checkout: a relative --out is made absolute first, so
    what they write under it lands in the same folder as the summary (a lent machine hands
    back only that folder)."""
    _fake_steps(monkeypatch)
    writes = "import sys; open(sys.argv[1], 'w').write('{}')"
    monkeypatch.setattr(steps, "STEPS", steps.STEPS[:1] + [steps.Step(
        "writer", "writes a record", 30, lambda c: [steps.Command(
            "w", [sys.executable, "-c", writes, str(c.logs / "02-writer.jsonl")], 30)])])
    monkeypatch.chdir(tmp_path)
    assert gpu_check.main(["--out", "results"]) == 0
    assert (tmp_path / "results" / "logs" / "02-writer.jsonl").exists()
    assert (tmp_path / "results" / "records.jsonl").read_text() == "{}\n"


def test_each_cuda_step_says_why_it_is_skipped_without_a_gpu(tmp_path):
    for env, prefix in ((CPU_ENV, "no CUDA: torch 2.13.0+cpu is a build without CUDA"),
                        (FAKE_ENV, "no CUDA GPU: torch 2.14.1+cu130 is a CUDA build")):
        ctx = _ctx(tmp_path, env)
        plans = {s.key: s.plan(ctx) for s in steps.STEPS}
        for key in CUDA_STEPS:
            assert isinstance(plans[key], str) and plans[key].startswith(prefix), key
        assert isinstance(plans["doctor"], list) and isinstance(plans["env"], list)
    cpu = {s.key: s.plan(_ctx(tmp_path, CPU_ENV)) for s in steps.STEPS}
    assert cpu["fake-gpu"].startswith("no CUDA") and "fake-GPU venv" in cpu["fake-gpu"]
    assert all(c.argv[c.argv.index("--device") + 1] == "cpu" for c in cpu["memory"])
    fake = {s.key: s.plan(_ctx(tmp_path, FAKE_ENV)) for s in steps.STEPS}
    assert [c.label for c in fake["memory"]] == ["dryrun local (fake cuda)"]
    assert "cuda" in fake["memory"][0].argv and "tests/fake_gpu" in fake["fake-gpu"][0].argv


def test_with_a_gpu_every_step_runs_on_it(tmp_path):
    ctx = _ctx(tmp_path, GPU_ENV)
    plans = {s.key: s.plan(ctx) for s in steps.STEPS}
    assert all(isinstance(p, list) and p for p in plans.values())
    kernels = [c.argv for c in plans["kernels"]]
    sizes = [(a[a.index("--seqlen") + 1], a[a.index("--batch") + 1]) for a in kernels]
    # 16K tokens a call up to 16K, as the published figures; the 16K one first
    assert sizes == [("16384,32768", "1"), ("4096", "4"), ("8192", "2")]
    assert all(a[a.index("--kernel") + 1] == "sdpa" for a in kernels)  # no flash-attn here
    found = steps.read_kernels(ctx, [])
    assert found["left_out"] == ["flash-attn: not installed", "flash-attn3: not installed"]
    threads = [c.argv for c in plans["threads"]]
    seen = [(a[a.index("--nproc") + 1], "--documents" in a, "--window-size" in a)
            for a in threads]  # the acceptance case first; the masks at 4 ranks
    assert seen == [("4", False, False), ("8", False, False), ("4", True, False),
                    ("4", False, True)]
    assert all(a[a.index("--launcher") + 1] == "threads" and "--check" in a
               and a[a.index("--kv-heads") + 1] != a[a.index("--heads") + 1] for a in threads)
    run, dry = plans["memory"]
    assert "torch.distributed.run" in run.argv and "--check" in run.argv
    assert dry.argv[dry.argv.index("--hardware") + 1] == "h200-sxm"


@pytest.mark.slow  # the CPU memory meter's first use imports torch's fake-tensor machinery
def test_kernel_rows_sit_beside_fa2s_published_figures(tmp_path):
    from cpbench.bench import kernelrun

    out = steps._kernels_out(_ctx(tmp_path, GPU_ENV))  # _ctx makes logs/
    grid = kernelrun.Grid(kernels=("sdpa-cpu",), seqlens=(512,), heads=(1,), head_dims=(16,),
                          dtypes=("fp32",), causal=(True, False))
    recs, _ = kernelrun.run_grid(grid, device="cpu", warmup=0, iters=1, capacity_bytes=None,
                                 out=str(out))
    found = steps.read_kernels(_ctx(tmp_path, GPU_ENV), [])
    causal, full = found["rows"]
    assert (causal["causal"], full["causal"]) == (True, False)
    assert causal["fwd_published"] == 191 and causal["bwd_published"] is None
    assert full["fwd_published"] == 309 and full["bwd_published"] == 214
    assert causal["fwd_bwd_published"] is None  # no text source gives it
    by_causal = {r["config"]["attention"]["causal"]: r["derived"] for r in recs}
    # the record's rate, or none where the guards withheld it (one step on a busy host can
    # time the backward below the forward): never a figure the record does not quote
    derived = by_causal[True]
    assert causal["fwd_tflops"] == derived.get("fwd_tflops")
    assert derived.get("fwd_tflops") or derived["withheld"]["fwd_tflops"] > 0
    assert "H200" in found["device_note"]
    page = "\n".join(report.kernels_section(found))
    assert "| 512 | 1 | causal | ok |" in page and "| 191 |" in page
    assert report.published("fwd", True, 32768) is None


def _record(strategy, status="ok", passed=True, memory=None, error=None, device="cpu"):
    return {"config": {"strategy": strategy}, "status": status, "error": error,
            "derived": {"check_passed": passed}, "memory_bytes": memory,
            "env": {"device": device, "device_name": "NVIDIA H100 80GB HBM3"}}


def _write(path: Path, recs) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_memory_findings_set_the_run_beside_its_dry_run(tmp_path):
    ctx = _ctx(tmp_path, GPU_ENV)
    mib = 2 ** 20
    _write(steps._memory_out(ctx, "run"), [_record("local", memory=[1000 * mib])])
    _write(steps._memory_out(ctx, "dryrun"), [_record("local", memory=[871 * mib])])
    found = steps.read_memory(ctx, [])
    assert found["ratio"] == pytest.approx(0.871) and found["difference_mib"] == -129.0
    assert found["fa2_workspace_bytes"] == 129 * mib  # 16K x 16 heads x 128: the issue's
    from cpbench.kernels import fa2_workspace

    for b, s, h, d in ((2, 129, 1, 72), (1, 16384, 16, 128), (3, 1000, 8, 136), (1, 64, 2, 256)):
        assert steps.fa2_workspace_bytes(b, s, h, d) == fa2_workspace.backward_bytes(
            batch=b, seqlen_q=s, seqlen_k=s, heads=h, kv_heads=h, head_dim=d, element_size=2)
    assert "check PASS" in found["run_note"]
    assert "Dry run / run: 0.871 (-129.0 MiB)" in "\n".join(report.memory_section(found))


def test_threads_findings_give_each_strategy_its_verdict(tmp_path):
    ctx = _ctx(tmp_path, GPU_ENV)
    _write(steps._threads_out(ctx, "gqa", 8), [
        _record("zigzag"), _record("ring", passed=False),
        _record("ulysses", status="failed", passed=None, error="rank 3: all_to_all timed out")])
    _write(steps._threads_out(ctx, "window", 4), [_record("zigzag")])
    found = steps.read_threads(ctx, [])
    assert found["columns"] == ["gqa n=8", "window n=4"]
    assert found["cells"]["zigzag"] == {"gqa n=8": "PASS", "window n=4": "PASS"}
    assert found["cells"]["ring"] == {"gqa n=8": "FAIL"}
    assert found["cells"]["ulysses"]["gqa n=8"].startswith("failed: rank 3")
    assert found["headline"].startswith("2 of 4 strategy cases PASS")
    assert "| ring | FAIL | - |" in "\n".join(report.threads_section(found))


def test_pytest_output_is_read_per_test_and_when_unfinished():
    done = ("tests/u.py::test_a[cuda-b1] PASSED [ 50%]\ntests/u.py::test_b FAILED [100%]\n"
            "FAILED tests/u.py::test_b - AssertionError: dq: max abs 1.0e-01  FAIL\n"
            "========== 1 failed, 1 passed in 3.2s ==========\n")
    found = steps.read.read_pytest(None, [{"text": done}])
    assert found["headline"] == "1 failed, 1 passed in 3.2s"
    assert found["verdicts"] == {"test_a[cuda-b1]": "PASSED", "test_b": "FAILED"}
    assert found["failed"] == {"test_b": "AssertionError: dq: max abs 1.0e-01  FAIL"}
    cut = steps.read.read_pytest(None, [{"text": done.split("FAILED tests")[0] + "tests/u.py::c "}])
    assert cut["headline"] == "pytest did not finish; so far 1 failed, 1 passed"


def test_a_rank_that_ignores_sigterm_goes_with_its_group(tmp_path):
    """The launcher exits on SIGTERM but a rank under it ignores it: the group is SIGKILLed
    whatever happened, so no rank keeps the GPU for the next step."""
    import subprocess

    pid_file = tmp_path / "rank.pid"
    rank = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")
    launcher = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
                f"{rank!r}], stdout=subprocess.PIPE, text=True); p.stdout.readline(); "
                f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", launcher], start_new_session=True)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    runner.kill_group(proc)
    assert not _alive(int(pid_file.read_text()))


def test_a_stop_while_the_command_starts_kills_the_started_child(tmp_path, monkeypatch):
    """SIGTERM landing inside Popen (child forked, Popen not yet returned) must not orphan the
    child: the stop is held until the process is known, then its group is killed."""
    import os
    import signal
    import subprocess

    started: list[int] = []
    real_popen = subprocess.Popen

    def popen_then_signal(*a, **k):
        proc = real_popen(*a, **k)
        started.append(proc.pid)
        os.kill(os.getpid(), signal.SIGTERM)  # delivered before Popen's caller sees the process
        return proc

    monkeypatch.setattr(runner.subprocess, "Popen", popen_then_signal)
    before = signal.signal(signal.SIGTERM, runner.interrupt)
    try:
        with open(tmp_path / "log", "w") as log, pytest.raises(KeyboardInterrupt):
            runner.run_command(steps.Command("sleep", ["sleep", "60"], 60), log, 60,
                                  lambda line: None)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert started and not _alive(started[0])


def test_sigterm_ends_the_run_with_its_child_and_keeps_what_was_measured(tmp_path):
    """A command limit above the run's (a lent machine's) stops it: the running command's
    group goes, the steps done stay in summary.json, the one running says interrupted."""
    import signal
    import subprocess

    out = tmp_path / "results"
    env_code = 'print("GPU_CHECK_ENV " + __import__("json").dumps(%r))' % CPU_ENV
    driver = f"""
import sys; sys.path.insert(0, {str(SCRIPTS)!r})
import gpu_check, gpu_check_steps as steps
versions = steps.Command("v", [sys.executable, "-c", {env_code!r}], 30)
hang = steps.Command("sleep", [sys.executable, "-c", "import time; time.sleep(300)",
                              {str(out)!r}], 300)
steps.STEPS = [steps.Step("env", "env", 30, lambda c: [versions], steps.read.read_env),
               steps.Step("hang", "hangs", 300, lambda c: [hang])]
sys.exit(gpu_check.main(["--out", {str(out)!r}]))
"""
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "$ sleep" in line:
            break
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 130
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["key"], s["status"]) for s in summary["steps"]] == [("env", "ok"),
                                                                  ("hang", "interrupted")]
    assert "interrupted" in (out / "summary.md").read_text()
    # the command's group was killed, not left behind (found by its own argument: another
    # sleep on a shared machine is not this test's)
    assert not [p for p in Path("/proc").glob("[0-9]*") if _argv_of(p)[-1:] == [str(out)]]
