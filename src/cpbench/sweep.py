"""``cpbench sweep``: run a YAML sweep of ``cpbench run`` cases, one launch per case.

A sweep config::

    topology: {nodes: 1, gpus_per_node: 8}   # GPUs: each case under torchrun; CPU: base.nproc
    timeout: 1800                           # seconds per case (a case may set its own)
    base: {heads: 40, head_dim: 128, dtype: bf16, causal: true}
    sweep: {strategy: [ring, zigzag], seqlen: [128K, 256K]}   # the product, first key outermost
    cases: [{strategy: usp, placement: ring-first, seqlen: 1M}]  # irregular extra cases

Setting names are those of ``cpbench run`` (RunConfig and AttentionConfig fields, strategy
options) with ``_`` for ``-``. Every case is validated with ``bench.plan.plan`` before anything
runs; every error is listed at once, each with the case it came from.

Each case is its own launch (a ``cpbench run`` subprocess in its own process group, appending
to the sweep's ``--out``), so a crash, OOM or hang of one case becomes a record with status
``failed`` / ``OOM`` / ``timeout`` and the sweep goes on. A case is done when every row its
plan expects has an ``ok`` record in the file, matched by ``record_key`` (the record's config:
strategy, options, attention problem, measurement settings, the kernel asked for, world and
node size), so a re-run skips it; ``--rerun-failed`` retries cases whose latest record is not
ok. A case re-run as a whole appends new rows; readers take the latest row per key.

GPU configs (with ``topology``) are planned as rank 0 of that torchrun job would plan them;
on a machine without CUDA the fit check is left to each launch, which plans again where it
runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from cpbench import kernels, results, strategies
from cpbench.config import (ATTENTION_PARSE, GPU_ATTENTION, GPU_ITERS, AttentionConfig,
                            RunConfig, flag)

TIMEOUT = "timeout"  # a status beside results.OK / OOM / FAILED: the case ran past its limit
TOP_KEYS = ("topology", "timeout", "base", "sweep", "cases", "description")
SWEEP_ONLY = ("timeout",)  # settings of the sweep itself, not passed to `cpbench run`
RESERVED = ("out",)  # the sweep sets these
# a row's key: what was asked for, not what this machine resolved it to (the device, the
# kernel "auto" became), so a sweep checked on a login node matches records made on GPUs
KEY_RUN_FIELDS = ("kernel", "warmup", "iters", "fwd_only", "check", "seed")
KILL_GRACE_S = 5.0
REPO_RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"


class SweepError(ValueError):
    """A sweep config that cannot run; ``errors`` lists every problem found."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__(f"{len(errors)} error(s) in the sweep config:\n  " + "\n  ".join(errors))


@dataclass(frozen=True)
class SweepCase:
    index: int  # 1-based, in run order
    settings: dict  # `cpbench run` settings (typed), timeout excluded
    label: str  # the settings that differ from base
    timeout: float | None
    plan: object = None  # bench.plan.Plan, filled by validation
    keys: tuple[str, ...] = ()  # record_key of every row the plan expects


@dataclass(frozen=True)
class Sweep:
    path: str
    cases: tuple[SweepCase, ...]
    nodes: int | None  # None: local --nproc ranks
    gpus_per_node: int | None


# -- settings ----------------------------------------------------------------------------------

def _fields() -> dict:
    """Setting name → (how to read it from YAML text, its type)."""
    import typing

    from cpbench.cli import _base_type, _strategy_options

    out = {}
    for cls, parse_map in ((AttentionConfig, ATTENTION_PARSE), (RunConfig, {})):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out[f.name] = (f.metadata.get("parse") or parse_map.get(f.name),
                           _base_type(hints[f.name]))
    for name, owners in _strategy_options().items():
        out[name] = (None, owners[0][2])
    return out


def _coerce(name: str, value, spec) -> object:
    parse, typ = spec
    if value is None:
        return None
    if name == "strategy" and isinstance(value, list):
        value = ",".join(map(str, value))
    if typ is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if parse is not None:
        return parse(str(value))
    if typ in (int, float) and isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return typ(value)
    except (TypeError, ValueError):
        raise ValueError(f"cannot read {name}: {value!r} as {typ.__name__}") from None


def _check_keys(where: str, mapping, allowed: dict, errors: list[str]) -> dict:
    if not isinstance(mapping, dict):
        errors.append(f"{where}: expected a mapping of settings, got {type(mapping).__name__}")
        return {}
    good = {}
    for k, v in mapping.items():
        name = str(k).replace("-", "_")
        if name in RESERVED:
            errors.append(f"{where}: {name!r} is set by `cpbench sweep` (use --out); drop it")
        elif name not in allowed and name not in SWEEP_ONLY:
            near = difflib.get_close_matches(name, [*allowed, *SWEEP_ONLY], n=1)
            errors.append(f"{where}: unknown setting {k!r}"
                          + (f" (did you mean {near[0]!r}?)" if near else "")
                          + "; settings are `cpbench run` flags, e.g. seqlen, strategy")
        else:
            good[name] = v
    return good


def _label(settings: dict, base: dict) -> str:
    diff = {k: v for k, v in settings.items() if k not in base or base[k] != v}
    return " ".join(f"{k}={v}" for k, v in diff.items()) or "base"


# -- keys --------------------------------------------------------------------------------------

def _key(strategy, options, attention, run, world, ranks_per_node) -> str:
    return json.dumps({"strategy": strategy, "options": options, "attention": attention,
                       "run": {k: run.get(k) for k in KEY_RUN_FIELDS},
                       "world_size": world, "ranks_per_node": ranks_per_node},
                      sort_keys=True)


def record_key(record: dict) -> str:
    """What identifies a record's row across runs: its config, less how it was launched
    (output file, format, timeouts)."""
    cfg = record["config"]
    return _key(cfg["strategy"], cfg["options"], cfg["attention"], cfg["run"],
                record["topology"]["world_size"],
                record["topology"]["ranks_per_node"])


def plan_keys(p) -> tuple[str, ...]:
    """``record_key`` of every row a plan will record."""
    run = json.loads(json.dumps(p.run.to_dict()))
    attn = json.loads(json.dumps(p.attn.to_dict()))
    return tuple(_key(c.strategy, json.loads(json.dumps(dataclasses.asdict(c.options))), attn,
                      run, p.world_size, p.ranks_per_node) for c in p.cases)


# -- loading and validation --------------------------------------------------------------------

def _validate(settings: dict, topology: tuple | None):
    from cpbench.bench import plan as planning

    run_names = {f.name for f in dataclasses.fields(RunConfig)}
    attn_names = {f.name for f in dataclasses.fields(AttentionConfig)}
    run = RunConfig(**{k: v for k, v in settings.items() if k in run_names and v is not None},
                    out="none")
    attention = {k: v for k, v in settings.items() if k in attn_names and v is not None}
    options = {k: v for k, v in settings.items()
               if k not in run_names | attn_names and v is not None}
    if topology is None:
        return planning.plan(run, attention, options, launcher="self")
    # planned as its torchrun job would be; what fits is decided where it runs (each launch
    # plans again there), not against this host's memory
    return planning.plan(run, attention, options, launcher="torchrun",
                         job=(topology[0] * topology[1], topology[1]))


def load(path: str | os.PathLike) -> Sweep:
    """Read and validate a sweep config; raises SweepError listing every problem."""
    try:
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise SweepError([f"{path}: {e}"]) from None
    errors: list[str] = []
    if not isinstance(doc, dict):
        raise SweepError([f"{path}: expected a mapping with base / sweep / cases"])
    for k in doc:
        if k not in TOP_KEYS:
            errors.append(f"top level: unknown key {k!r}; allowed: {', '.join(TOP_KEYS)}")
    spec = _fields()
    topo = doc.get("topology")
    nodes = gpus = None
    if topo is not None:
        if not isinstance(topo, dict) or set(topo) - {"nodes", "gpus_per_node"} or not all(
                isinstance(topo.get(k), int) and topo[k] >= 1 for k in ("nodes", "gpus_per_node")):
            errors.append(f"topology: expected {{nodes: N, gpus_per_node: G}} with positive "
                          f"integers, got {topo!r}")
        else:
            nodes, gpus = topo["nodes"], topo["gpus_per_node"]
    base = _check_keys("base", doc.get("base") or {}, spec, errors)
    axes = _check_keys("sweep", doc.get("sweep") or {}, spec, errors)
    for k, v in axes.items():
        if not isinstance(v, list) or not v:
            errors.append(f"sweep: {k} must be a non-empty list of values, got {v!r}")
    raw_cases = [{**base, **dict(zip(axes, combo))}
                 for combo in itertools.product(*[v if isinstance(v, list) else [v]
                                                  for v in axes.values()])] if axes else []
    extra = doc.get("cases") or []
    if not isinstance(extra, list):
        errors.append("cases: expected a list of mappings of settings")
        extra = []
    for i, c in enumerate(extra, 1):
        raw_cases.append({**base, **_check_keys(f"cases[{i}]", c, spec, errors)})
    if not axes and not extra:
        raw_cases = [dict(base)]
    default_timeout = doc.get("timeout")
    if nodes is not None:
        # GPU runs: seed 001's defaults, written out, so that the command lines and the rows'
        # keys do not depend on whether the machine checking the sweep has a GPU
        gpu_defaults = {**GPU_ATTENTION, **GPU_ITERS}
        raw_cases = [{**gpu_defaults, **raw} for raw in raw_cases]
        base = {**gpu_defaults, **base}
    cases, seen = [], {}
    for i, raw in enumerate(raw_cases, 1):
        label = _label(raw, base)
        where = f"case {i} ({label})"
        settings, bad = {}, False
        for k, v in raw.items():
            if k in SWEEP_ONLY:
                continue
            try:
                settings[k] = _coerce(k, v, spec[k])
            except ValueError as e:
                errors.append(f"{where}: {e}")
                bad = True
        timeout = raw.get("timeout", default_timeout)
        if timeout is not None and (isinstance(timeout, bool) or
                                    not isinstance(timeout, (int, float)) or timeout <= 0):
            errors.append(f"{where}: timeout must be a positive number of seconds, "
                          f"got {timeout!r}")
            bad = True
        if nodes is not None and settings.get("nproc") is not None:
            errors.append(f"{where}: nproc starts local CPU ranks; this config has a "
                          f"topology (torchrun): drop nproc")
            bad = True
        if bad:
            continue
        try:
            p = _validate(settings, (nodes, gpus) if nodes is not None else None)
        except ValueError as e:
            errors.append(f"{where}: {' '.join(str(e).split())}")
            continue
        keys = plan_keys(p)
        for k in keys:
            if k in seen:
                errors.append(f"{where}: repeats a row of case {seen[k]}; drop one of them")
                break
            seen[k] = i
        cases.append(SweepCase(index=i, settings=settings, label=label,
                               timeout=None if timeout is None else float(timeout),
                               plan=p, keys=keys))
    if errors:
        raise SweepError(errors)
    return Sweep(path=str(path), cases=tuple(cases), nodes=nodes, gpus_per_node=gpus)


# -- launching ---------------------------------------------------------------------------------

def run_flags(settings: dict) -> list[str]:
    """``cpbench run`` flags for a case's settings."""
    argv = []
    for k, v in settings.items():
        if v is None:
            continue
        if isinstance(v, bool):
            argv.append(flag(k) if v else f"--no-{flag(k)[2:]}")
        elif isinstance(v, tuple):
            argv += [flag(k), ",".join(v)]
        else:
            argv += [flag(k), str(v)]
    return argv


def command(sweep: Sweep, case: SweepCase, out: str, launcher: str | None = None) -> list[str]:
    """The command line of one case's launch."""
    flags = [*run_flags(case.settings), "--out", out]
    if launcher:  # e.g. "srun ... torchrun --nnodes 4 --nproc-per-node 8 ..."
        return [*shlex.split(launcher), str(REPO_RUN), *flags]
    if sweep.nodes is None:
        return [sys.executable, "-m", "cpbench.cli", "run", *flags]
    if sweep.nodes > 1:
        raise ValueError(f"{sweep.path} spans {sweep.nodes} nodes: run it through Slurm "
                         f"(scripts/slurm/) or give --launcher 'srun ... torchrun ...'")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(sweep.gpus_per_node), str(REPO_RUN), *flags]


def _repair_tail(path: Path) -> None:
    """Cut a torn last line (a launch killed mid-write) so the next append starts clean."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        data = f.seek(0) or f.read()
        f.truncate(data.rfind(b"\n") + 1)
        f.flush()
        os.fsync(f.fileno())


def _read_from(path: Path, offset: int) -> list[dict]:
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().split(b"\n")
    found = []
    for line in lines:
        with contextlib.suppress(ValueError):
            if line.strip():
                found.append(json.loads(line))
    return found


def _latest(path: Path) -> dict[str, str]:
    """record_key → status of its latest record in ``path``."""
    if not path.exists():
        return {}
    return {record_key(r): r["status"] for r in results.read(path)}


def _failure_record(case: SweepCase, index: int, status: str, error: str,
                    returncode: int | None, log_path: str) -> dict:
    p = case.plan
    c = p.cases[index]
    cls = strategies.get(c.strategy)
    strat = cls(p.attn, p.topo, 0, kernel=kernels.get(p.kernel), options=c.options,
                create_groups=False)
    from cpbench.bench.env import utc_now

    record = {
        "schema_version": results.SCHEMA_VERSION,
        "config": {"strategy": c.strategy, "options": dataclasses.asdict(c.options),
                   "option_defaults": dataclasses.asdict(cls.Options()),
                   "attention": p.attn.to_dict(), "run": p.run.to_dict()},
        "kernel": p.kernel,
        "topology": {"world_size": p.world_size, "ranks_per_node": p.ranks_per_node,
                     "num_nodes": p.topo.num_nodes},
        "ranks_per_problem": strat.ranks_per_problem, "resolved": None,
        "env": {"utc": utc_now(), "launcher": "sweep",
                "slurm_job_id": os.environ.get("SLURM_JOB_ID")},
        "status": status, "error": error, "traceback": None, "samples_ms": None,
        "memory_bytes": None, "memory_status": None, "memory_error": None, "check": None,
        "sweep": {"case": case.index, "label": case.label, "returncode": returncode,
                  "log": log_path},
    }
    record = json.loads(json.dumps(record))
    record["derived"] = results.derive(record)
    return record


def _tail(path: Path, lines: int = 4) -> str:
    """The last lines a launch printed (its first line, the command, left out), as one."""
    text = path.read_text(errors="replace") if path.exists() else ""
    shown = [line.rsplit("\r", 1)[-1].strip() for line in text.splitlines()[1:]]
    return " | ".join([t for t in shown if t][-lines:]) or "(no output)"


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop a case's launch and every process it started (its own process group), and wait
    (briefly) until they are gone, so the next case does not share the cores with them."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
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


def _launch(sweep: Sweep, case: SweepCase, out: Path, log_path: Path, timeout: float | None,
            launcher: str | None) -> tuple[int | None, bool]:
    """(exit status, timed out). Output goes to ``log_path``; Ctrl-C stops the case's
    processes and propagates."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as log_file:
        log_file.write(("$ " + shlex.join(command(sweep, case, str(out), launcher)) + "\n")
                       .encode())
        log_file.flush()
        proc = subprocess.Popen(command(sweep, case, str(out), launcher), stdout=log_file,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return proc.returncode, True
        except BaseException:  # Ctrl-C, or the sweep itself being stopped
            _kill_group(proc)
            raise


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _stop_on_sigterm(signum, frame):
    # a scheduler ending the sweep: unwind like Ctrl-C so the running case's group is killed
    raise KeyboardInterrupt(f"signal {signum}")


def run(sweep: Sweep, out: str, *, rerun_failed: bool = False, timeout: float | None = None,
        launcher: str | None = None, stream=None) -> int:
    """Run every case not already recorded ok; 0 when every case ends ok, 1 otherwise.
    Ctrl-C (or SIGTERM) stops the running case's processes and raises KeyboardInterrupt;
    rows that case had finished stay in ``out``, the rest are not recorded."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return _run(sweep, out, rerun_failed=rerun_failed, timeout=timeout,
                    launcher=launcher, stream=stream)
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return _run(sweep, out, rerun_failed=rerun_failed, timeout=timeout,
                    launcher=launcher, stream=stream)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(sweep: Sweep, out: str, *, rerun_failed: bool, timeout: float | None,
         launcher: str | None, stream) -> int:
    stream = stream or sys.stdout
    tty = stream.isatty()
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _repair_tail(out_path)
    logs = out_path.with_name(out_path.name + ".logs")
    latest = _latest(out_path)
    todo, n = [], len(sweep.cases)

    def say(text: str, transient: bool = False) -> None:
        if transient and not tty:
            return
        stream.write(("\r\033[K" if tty else "") + text + ("" if transient else "\n"))
        stream.flush()

    for case in sweep.cases:
        statuses = [latest.get(k) for k in case.keys]
        if all(s == results.OK for s in statuses):
            say(f"[{case.index}/{n}] {case.label}: done earlier, skipped")
        elif not rerun_failed and None not in statuses:
            bad = sorted({s for s in statuses if s != results.OK})
            say(f"[{case.index}/{n}] {case.label}: recorded {'/'.join(bad)} earlier, skipped "
                f"(--rerun-failed retries it)")
        else:
            todo.append(case)
    start, durations, failed = time.monotonic(), [], False
    for i, case in enumerate(todo):
        limit = timeout if timeout is not None else case.timeout
        digest = hashlib.sha1("\n".join(case.keys).encode()).hexdigest()[:10]
        log_path = logs / f"case{case.index:03d}_{digest}.log"
        say(f"[{case.index}/{n}] {case.label}: running ({i + 1} of {len(todo)} to run)",
            transient=True)
        t0 = time.monotonic()
        _repair_tail(out_path)
        offset = out_path.stat().st_size if out_path.exists() else 0
        rc, timed_out = _launch(sweep, case, out_path, log_path, limit, launcher)
        _repair_tail(out_path)
        written = {record_key(r): r["status"] for r in _read_from(out_path, offset)}
        missing = [j for j, k in enumerate(case.keys) if k not in written]
        tail = _tail(log_path)
        if timed_out:
            status, error = TIMEOUT, f"no result within the case's timeout of {limit:g} s"
        elif "out of memory" in tail.lower() or "outofmemory" in tail.lower():
            status, error = results.OOM, f"the launch ran out of memory (exit {rc}): {tail}"
        else:
            status, error = results.FAILED, f"the launch exited {rc} without this row: {tail}"
        for j in missing:
            rec = _failure_record(case, j, status, error, rc, str(log_path))
            results.append(out_path, rec)
            written[case.keys[j]] = status
        outcome = [written[k] for k in case.keys]
        failed |= any(s != results.OK for s in outcome)
        durations.append(time.monotonic() - t0)
        left = len(todo) - i - 1
        eta = sum(durations) / len(durations) * left
        summary = "ok" if all(s == results.OK for s in outcome) else \
            ", ".join(f"{s}" for s in outcome)
        say(f"[{case.index}/{n}] {case.label}: {summary} in {durations[-1]:.1f} s | "
            f"elapsed {_clock(time.monotonic() - start)} | ~{_clock(eta)} left"
            + (f" | log {log_path}" if summary != "ok" else ""))
    say(f"sweep: {len(todo)} case(s) run, {n - len(todo)} skipped; records in {out}")
    return 1 if failed else 0
