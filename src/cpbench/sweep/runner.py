"""Running a sweep's cases: each its own launch (a ``cpbench run`` in its own process group,
appending to the sweep's ``--out``), so a crash, OOM or hang becomes a record and the sweep
goes on; cases already recorded ok are skipped.

A row a launch left unwritten is recorded from what its ranks left, never from the last lines
of its log (torchrun's summary there names no cause): the status and message a failing rank
left in the sweep's store (``bench.failures``: a TCPStore this process hosts for the whole
sweep), else the failure line it printed anywhere in the log, else ``timeout`` / ``failed``
with the exit status."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from cpbench import metrics, results
from cpbench.bench import failures
from cpbench.bench.plan import failure_record
from cpbench.config import flag
from cpbench.errors import UsageError
from cpbench.launch import rendezvous_port
from cpbench.report.console import fitted
from cpbench.sweep.config import Sweep, SweepCase

# SIGTERM to SIGKILL: longer than torchrun's own worker shutdown (its agent gives workers
# 30 s), so srun's step ends cleanly and the next case's srun does not wait on busy nodes
KILL_GRACE_S = 45.0
# what every launch of a case sets: the NCCL watchdog ends a rank whose collective timed out
# (aborting its communicators), so a case that hangs on NCCL ends its launch and the sweep
# records it and goes on (0 would hold the GPUs until the case's timeout; 2 keeps the
# process alive on an aborted communicator; torchrun's default is 1 too, set here explicitly)
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
# what each case's launch runs: the package's own entry, so an installed cpbench works from
# any directory (torchrun takes it as `-m cpbench.run`)
ENTRY = ("-m", "cpbench.run")
# in a --launcher, replaced per case: its own rendezvous id and a free port (a timed-out
# case's torchrun agent may still hold the last port; reusing its id would join its store)
CASE_FIELD, PORT_FIELD = "{case}", "{port}"


def run_flags(settings: dict) -> list[str]:
    """``cpbench run`` flags for a case's settings."""
    argv = []
    for k, v in settings.items():
        if v is None:
            continue
        if isinstance(v, bool):
            argv.append(flag(k) if v else f"--no-{flag(k)[2:]}")
        else:
            text = ",".join(map(str, v)) if isinstance(v, tuple) else str(v)
            # "-1,-1" would read as a flag: joined to its own (--window-size=-1,-1)
            argv += [f"{flag(k)}={text}"] if text.startswith("-") else [flag(k), text]
    return argv


def command(sweep: Sweep, case: SweepCase, out: str, launcher: str | None = None,
            port: int | None = None, entry: tuple[str, ...] = ENTRY) -> list[str]:
    """The command line of one case's launch; ``port`` fills the launcher's {port};
    ``entry``: what the launcher starts (a script in place of ``-m cpbench.run``)."""
    flags = [*run_flags(case.settings), "--out", out]
    if launcher:  # e.g. "srun ... torchrun --nnodes 4 --nproc-per-node 8 ..."
        words = [w.replace(CASE_FIELD, str(case.index)) for w in shlex.split(launcher)]
        if port is not None:
            words = [w.replace(PORT_FIELD, str(port)) for w in words]
        return [*words, *entry, *flags]
    if sweep.nodes is None:
        return [sys.executable, *entry, *flags]
    if sweep.nodes > 1:
        raise UsageError(f"{sweep.path} spans {sweep.nodes} nodes: run it through Slurm "
                         f"(scripts/slurm/) or give --launcher 'srun ... torchrun ...'")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(sweep.gpus_per_node), *entry, *flags]


def _repair_tail(path: Path) -> None:
    """Cut a torn last line (a launch killed mid-write) so the next append starts clean."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        # the appends' lock (results.append): a writer sharing the file (an array task) is
        # never cut mid-record
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        f.truncate(data.rfind(b"\n") + 1)
        f.flush()
        os.fsync(f.fileno())


def _latest(path: Path) -> dict[str, str]:
    """record_key → status of its latest record in ``path``."""
    if not path.exists():
        return {}
    return {results.record_key(r): r["status"] for r in results.read(path)}


def kill_group(proc: subprocess.Popen) -> None:
    """Stop a case's launch and every process it started (its own process group), and wait
    (briefly) until they are gone, so the next case does not share the cores with them."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_GRACE_S)
    # ranks may outlive the launcher: SIGKILL the group whatever happened
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def _launch(cmd: list[str], log_path: Path, timeout: float | None,
            store_address: str | None = None) -> tuple[int | None, bool]:
    """(exit status, timed out). Output goes to ``log_path``; Ctrl-C stops the case's
    processes and propagates."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **NCCL_ERROR_HANDLING)
    if store_address:
        env[failures.STORE_ENV] = store_address
    with open(log_path, "wb") as log_file:
        log_file.write(("$ " + shlex.join(cmd) + "\n").encode())
        log_file.flush()
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return proc.returncode, True
        except BaseException:  # Ctrl-C, or the sweep itself being stopped
            kill_group(proc)
            raise


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _stop_on_sigterm(signum, frame):
    # a scheduler ending the sweep: unwind like Ctrl-C so the running case's group is killed
    raise KeyboardInterrupt(f"signal {signum}")


class _Console:
    """Progress lines: a transient status line on a terminal, plain lines elsewhere."""

    def __init__(self, stream):
        self.stream, self.tty = stream, stream.isatty()

    def __call__(self, text: str, transient: bool = False) -> None:
        if transient and not self.tty:
            return
        text = fitted(text, transient)
        self.stream.write(("\r\033[K" if self.tty else "") + text + ("" if transient else "\n"))
        self.stream.flush()


def run(sweep: Sweep, out: str, *, rerun_failed: bool = False, timeout: float | None = None,
        launcher: str | None = None, entry: tuple[str, ...] = ENTRY, stream=None) -> int:
    """Run every case not already recorded ok; 0 when every case ends ok, 1 otherwise.
    Ctrl-C (or SIGTERM) stops the running case's processes and raises KeyboardInterrupt;
    rows that case had finished stay in ``out``, the rest are not recorded."""
    import threading

    runner = _Runner(sweep, Path(out), rerun_failed, timeout, launcher,
                     _Console(stream or sys.stdout), entry)
    if threading.current_thread() is not threading.main_thread():
        return runner.run()
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return runner.run()
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Runner:
    def __init__(self, sweep: Sweep, out: Path, rerun_failed: bool, timeout: float | None,
                 launcher: str | None, say: _Console, entry: tuple[str, ...] = ENTRY):
        self.sweep, self.out, self.rerun_failed = sweep, out, rerun_failed
        self.timeout, self.launcher, self.say, self.entry = timeout, launcher, say, entry
        self.logs = out.with_name(out.name + ".logs")
        self.store = self.store_address = None

    def _todo(self) -> list[SweepCase]:
        """The cases to run; a line for each one skipped."""
        latest, n, todo = _latest(self.out), len(self.sweep.cases), []
        for case in self.sweep.cases:
            statuses = [latest.get(k) for k in case.keys]
            if all(s == results.OK for s in statuses):
                self.say(f"[{case.index}/{n}] {case.label}: done earlier, skipped")
            elif not self.rerun_failed and None not in statuses:
                bad = sorted({s for s in statuses if s is not None and s != results.OK})
                self.say(f"[{case.index}/{n}] {case.label}: recorded {'/'.join(bad)} earlier, "
                         f"skipped (--rerun-failed retries it)")
            else:
                todo.append(case)
        return todo

    def run(self) -> int:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        _repair_tail(self.out)
        todo, n = self._todo(), len(self.sweep.cases)
        if todo:  # the ranks' failures come back through it; without it, through the logs
            try:
                self.store, self.store_address = failures.host_store(
                    local=self.launcher is None)
            except Exception as e:  # noqa: BLE001 - the logs still carry the failure lines
                self.say(f"sweep: no failure store ({e}); failures are read from the logs")
        start, durations, failed = time.monotonic(), [], False
        for i, case in enumerate(todo):
            # what its launch's own plan estimated here (bench.estimate), where it could
            est = sum(e.case_s for e in case.plan.estimates) if case.plan.estimates else None
            guess = f", estimated {metrics.duration(est)}" if est is not None else ""
            self.say(f"[{case.index}/{n}] {case.label}: running ({i + 1} of {len(todo)} to "
                     f"run{guess})", transient=True)
            t0 = time.monotonic()
            outcome, log_path = self._case(case)
            failed |= any(s != results.OK for s in outcome)
            durations.append(time.monotonic() - t0)
            eta = sum(durations) / len(durations) * (len(todo) - i - 1)
            summary = "ok" if all(s == results.OK for s in outcome) else ", ".join(outcome)
            self.say(f"[{case.index}/{n}] {case.label}: {summary} in {durations[-1]:.1f} s"
                     + (f" (estimated {metrics.duration(est)}, its launch's start-up not "
                        f"counted)" if est is not None else "")
                     + " | "
                     f"elapsed {_clock(time.monotonic() - start)} | ~{_clock(eta)} left"
                     + (f" | log {log_path}" if summary != "ok" else ""))
        self.say(f"sweep: {len(todo)} case(s) run, {n - len(todo)} skipped; records in "
                 f"{self.out}")
        self._say_accuracy()
        return 1 if failed else 0

    def _say_accuracy(self) -> None:
        """A sweep that checks: the error table over its cases, so an nproc or topology axis
        shows the error's growth with ring size without a second command."""
        from cpbench.report.accuracy import accuracy_table

        keys = {k for case in self.sweep.cases for k in case.keys}
        checked = [r for r in results.read(self.out) if r.get("check")
                   and results.record_key(r) in keys] if self.out.exists() else []
        if checked:
            self.say("\n" + accuracy_table(checked).rstrip("\n"))

    def _case(self, case: SweepCase) -> tuple[list[str], Path]:
        """Launch one case; record every row it left unwritten; the status of each row."""
        limit = self.timeout if self.timeout is not None else case.timeout
        digest = hashlib.sha1("\n".join(case.keys).encode()).hexdigest()[:10]
        log_path = self.logs / f"case{case.index:03d}_{digest}.log"
        _repair_tail(self.out)
        offset = self.out.stat().st_size if self.out.exists() else 0
        cmd = command(self.sweep, case, str(self.out), self.launcher, rendezvous_port(),
                      self.entry)
        rc, timed_out = _launch(cmd, log_path, limit, self.store_address)
        _repair_tail(self.out)
        written = {results.record_key(r): r["status"]
                   for r in results.read_from(self.out, offset)}
        log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
        for j, key in enumerate(case.keys):
            if key not in written:
                left = self._left_by_ranks(case, j, log_text)
                status, error = _why(rc, timed_out, limit, left, log_path, log_text)
                results.append(self.out, failure_record(
                    case.plan, j, status, error,
                    sweep={"case": case.index, "label": case.label, "returncode": rc,
                           "log": str(log_path)}))
                written[key] = status
        return [written[k] for k in case.keys], log_path

    def _left_by_ranks(self, case: SweepCase, j: int, log_text: str) -> tuple[str, str] | None:
        """(status, "rank r: message") a failing rank left for row ``j``: in the store, else
        its failure line anywhere in the log."""
        found = None
        if self.store is not None:
            found = failures.from_store(self.store, case.keys[j], case.plan.world_size)
        return found or failures.from_log(log_text, case.plan.cases[j].label)


def _why(rc: int | None, timed_out: bool, limit: float | None,
         left: tuple[str, str] | None, log_path: Path, log_text: str = "") -> tuple[str, str]:
    """The status and error of a row a launch left unwritten: what its failing rank said
    (OOM or failed), else timeout or failed. The log's last line is context in the message
    only (under torchrun it is the agent's summary): it never sets the status."""
    ended = f"the launch ended (exit {rc}) before the row was recorded; log {log_path}"
    if left is not None:
        status, msg = left
        return status, f"{msg} ({ended})"
    if timed_out:
        return results.TIMEOUT, f"no result within the case's timeout of {limit:g} s"
    lines = [line.rsplit("\r", 1)[-1].strip() for line in log_text.splitlines()[1:]]
    last = next((line for line in reversed(lines) if line), None)
    return results.FAILED, f"no rank reported a failure: {ended}" + (
        f"; its last line: {last}" if last else "")
