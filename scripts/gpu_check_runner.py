"""gpu-check's runner: one command under its limit in its own process group (killed whole on
expiry or a stop), one step's commands in turn under its cap, and why a step failed.
Standard library only."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import gpu_check_steps as steps

ROOT = Path(__file__).resolve().parent.parent
HEARTBEAT_S = 30


def child_env(extra: dict) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_NCCL_ASYNC_ERROR_HANDLING="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH"))
                                        if p)
    return env


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the command's whole process group (torchrun's workers, threads' ranks), then
    SIGKILL it whatever happened (a rank may outlive its launcher, or ignore SIGTERM), and
    wait briefly until it is gone: cpbench.sweep.runner.kill_group, here without cpbench."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


@contextlib.contextmanager
def _signals_held():
    """SIGINT / SIGTERM recorded, not raised, while the body runs; the list says if one came."""
    came: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.signal(s, lambda signum, _f: came.append(signum)) for s in held}
    try:
        yield came
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def run_command(cmd: steps.Command, log, limit_s: float, say) -> dict:
    """Run one command into the step's log under ``limit_s``; its result (and output)."""
    log.write(f"$ {shlex.join(cmd.argv)}\n")
    log.flush()
    start_at = log.tell()
    t0 = time.monotonic()
    with _signals_held() as pending:  # a stop inside Popen would orphan the started child
        proc = subprocess.Popen(cmd.argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=child_env(cmd.env), start_new_session=True)
    status = "ok"
    try:
        if pending:
            raise KeyboardInterrupt
        while True:
            left = limit_s - (time.monotonic() - t0)
            try:
                proc.wait(timeout=max(0.1, min(HEARTBEAT_S, left)))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - t0 >= limit_s:
                    status = "timeout"
                    kill_group(proc)
                    break
                say(f"      ... {time.monotonic() - t0:.0f} s: {_last_line(log.name)}")
    except BaseException:
        kill_group(proc)
        raise
    seconds = time.monotonic() - t0
    rc = proc.returncode
    if status == "ok" and rc != 0:
        status = "failed"
    log.write(f"\n# {status}: exit {rc} after {seconds:.1f} s (limit {limit_s:.0f} s)\n\n")
    log.flush()
    with open(log.name, "rb") as f:
        f.seek(start_at)
        text = f.read().decode(errors="replace")
    return {"label": cmd.label, "command": shlex.join(cmd.argv), "rc": rc, "status": status,
            "seconds": round(seconds, 1), "limit_s": round(limit_s), "text": text}


def _last_line(path: str) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - 4000))
        lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:100] if lines else "(no output yet)"


def run_step(step: steps.Step, index: int, ctx, deadline: float, say) -> dict:
    """One step: its commands in turn, each under min(its own limit, the step's cap, the run's
    end). The caps are a GPU's shares of the budget: without a GPU (its CUDA steps skipped) the
    rest run under their commands' limits; under --only, under the run's end alone."""
    log_name = f"{index:02d}-{step.key}.log"
    result = {"key": step.key, "title": step.title, "status": "ok", "reason": "",
              "seconds": 0.0, "log": f"logs/{log_name}", "commands": [], "findings": {}}
    planned = step.plan(ctx)
    if isinstance(planned, str):
        result.update(status="skipped", reason=planned, log="")
        return result
    t0 = time.monotonic()
    cap = step.timeout_s if ctx.mode == "gpu" and not ctx.only else None
    step_end = deadline if cap is None else min(deadline, t0 + cap)
    with open(ctx.logs / log_name, "w") as log:
        log.write(f"# {step.title}\n")
        for cmd in planned:
            remaining = step_end - time.monotonic()
            refused = [r for r in result["commands"] if r["rc"] == 2]
            if remaining < 5 or refused:
                why = "out of time" if remaining < 5 else (
                    f"'{refused[0]['label']}' was refused (exit 2: bad usage), see the log")
                result["commands"].append({"label": cmd.label, "command": shlex.join(cmd.argv),
                                           "rc": None, "status": "skipped", "reason": why,
                                           "text": ""})
                continue
            left = remaining if ctx.only else min(cmd.timeout_s, remaining)
            say(f"    $ {cmd.label} (limit {left:.0f} s)")
            result["commands"].append(run_command(cmd, log, left, say))
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["status"] = _worst([c["status"] for c in result["commands"]])
    result["reason"] = _why(result["commands"])
    if step.read is not None:
        try:
            result["findings"] = step.read(ctx, result["commands"])
        except Exception as e:  # a finding unread is said, never a lost run
            result["findings"] = {"headline": f"could not read the results: "
                                              f"{type(e).__name__}: {e}"}
    for c in result["commands"]:
        c.pop("text", None)
    return result


def _why(commands: list[dict]) -> str:
    """The first bad command and the last line it printed (its error), and what was skipped."""
    parts = []
    bad = [c for c in commands if c["status"] in ("timeout", "failed")]
    if bad:
        c = bad[0]
        what = f"past its {c['limit_s']} s" if c["status"] == "timeout" else f"exit {c['rc']}"
        lines = [ln for ln in c["text"].splitlines() if ln.strip() and not ln.startswith("# ")]
        parts.append(f"{c['label']}: {what}" + (f": {lines[-1].strip()[:160]}" if lines else ""))
    skipped = [c for c in commands if c["status"] == "skipped"]
    if skipped:
        parts.append(f"{len(skipped)} command(s) skipped: {skipped[0]['reason']}")
    return "; ".join(parts)


def _worst(statuses: list[str]) -> str:
    for bad in ("timeout", "failed"):
        if bad in statuses:
            return bad
    return "partial" if "skipped" in statuses else "ok"


def interrupt(signum, frame):
    """SIGTERM (a command limit above the run's) ends the run as Ctrl-C does."""
    raise KeyboardInterrupt
