"""Result records: one JSON object per line, one line per (strategy, options, config).

A record holds what is needed to re-run it and to recompute every figure printed from it:
- ``schema_version``;
- ``config``: ``strategy``, ``options`` (and the options' defaults, to label rows), the
  ``attention`` problem and the ``run`` settings (``RunConfig.to_dict()``, resolved);
- ``kernel`` (the backend that ran), ``topology``, ``ranks_per_problem`` (ranks sharing one
  attention problem: the world for CP strategies, 1 for a no-CP baseline);
- ``env``: versions, device, hosts per rank, launcher, git sha, UTC time, SLURM_JOB_ID; or,
  for a prediction of ``cpbench simulate``, ``simulated: true`` and the ``hardware`` preset;
- ``resolved``: the options as the strategy resolved them on this topology (e.g. the
  Ulysses × ring split, a window taken from the node size); the options themselves when the
  strategy resolves nothing;
- ``status``: "ok", "OOM" or "failed", with ``error`` (and ``traceback`` when failed): how the
  build, check and timing went;
- raw measurements: ``samples_ms`` {"fwd", "bwd", "fwd_bwd"}: per rank, per timed iteration,
  each kept as soon as it was measured (a phase that failed later leaves the earlier ones);
  each iteration's forward and backward timed on their own within one step (``bench.timer``;
  records before it hold no "bwd", and their BWD is not derived: a difference of two medians
  was no measurement); ``timing``: the warm-up steps run and whether their times settled,
  and ``step``: how the step's parts were timed, "back-to-back" (FWD then BWD with no sync or
  barrier between them, as a training step and the seeds' scripts run them: ``bench.timer``);
  a record whose BWD was timed on its own without it held the harness's sync and barrier
  between FWD and BWD inside FWD+BWD, and is marked ``derived.step_synced``;
  ``memory_bytes`` per rank, measured after the timings with its own ``memory_status`` and
  ``memory_error`` (null bytes when that step failed or ran out of memory; the timings stay);
  ``check``: per tensor max abs / max rel error and verdict;
- ``derived``: the figures computed from the above by ``derive`` (kept for other tools;
  readers recompute them rather than trust them);
- optionally ``sweep`` (the case a sweep wrote a failure record for), ``simulation``
  (what ``cpbench simulate`` predicted beside the times), ``upstream`` (the library an
  adapter strategy ran: package, version, the flash-attn beneath it) and ``profile``
  (``cpbench run --profile``: the slowest rank's step breakdown and every rank's trace; see
  ``cpbench.bench.profiling``, or ``{"error", "traces"}`` when profiling failed) and
  ``balance`` (from the layout and the mask: attended pairs per rank and per ring step, and
  ``imbalance`` = max / mean over ranks), ``dryrun`` (``cpbench dryrun``: the device, its
  memory, and per rank run its peaks, bytes sent and declared, error and file:line),
  ``padding`` (under documents: the strategy's document and sequence multiples, the real and
  padded sequence, ``padded_tokens``, their ``fraction`` of the padded sequence, the tail's
  pad and the padded lengths; FLOPs count real pairs only) and ``packing`` (the index of the
  packing under ``--packings K``: seed + index sampled the documents), ``round`` (under
  ``--rounds K``: ``index`` and ``count``; ``cpbench.rounds`` pools a case's rounds) and
  ``comm`` (the bytes each rank sent in the timed step, per timed phase, whether its timed
  steps differed, and what the strategy's schedule declares per phase: ``comm_section``).
  ``derived.flags``: the physics guards' findings (``cpbench.guards``), and
  ``derived.not_measured``: why the row's times and memory are not measurements (ranks as
  threads on one device), else null; ``ideal`` (``cpbench.ideal``,
  the one definition, ``definition: "share"``: the kernel alone on each GPU's share, one block
  of S / N tokens timed alone or priced, ``times`` N over: ``fwd_ms`` / ``bwd_ms``, the
  ``block``, ``tokens_per_gpu``; or ``{"none": why}``), from which
  ``derived.fraction_of_ideal`` (FWD+BWD, FWD with --fwd-only) and ``fraction_of_ideal_fwd``:
  the ideal step over the measured one (an older record's ideal, with a ``rank``: the slowest
  rank's blocks, is read, gives no fraction and is marked ``derived.ideal_superseded``);
  ``sizes`` (per rank: the world it ran in, its CP
  ring's size and its shard's tokens), which ``cpbench.guards`` holds to what was asked;
  ``load`` (how busy others kept rank 0's host while the case timed: ``bench.load``) and
  ``estimate`` (what the case was estimated to take before the run, ``step_s``, ``case_s``
  and its ``parts``: ``bench.estimate``; ``revised_s``, that re-estimated from the load and
  what the cases before it took, ``at_load_s``, the same at the load the case met,
  ``took_s``, what it took, and ``parts_s``, where that went: ``bench.eta``).
  ``derived.not_measured``: why the row's timings do not measure CP (``guards.not_measured``:
  ranks sharing cores, a busy host), or null. Where a row is flagged or does not measure CP,
  its figures derived as CP performance (TFLOP/s, fraction of ideal, the slowest rank) are
  not among ``derived``'s figures but under ``derived.withheld`` (``guards.withhold``).
The mask is part of the problem: ``config.attention.documents`` (the lengths) and
``window_size``; ``derived.flops_counted`` says whether FLOPs come from the seeds' formula
(plain causal / full) or the exact attended pairs (documents, windows).

``make_record`` is the one constructor: the driver, the sweep's failure records and the
simulator's predictions all build records through it. ``record_key`` says which row of a run a
record is (its config, less how it was launched), so re-runs and resumed sweeps match rows.

Appends write whole lines, flushed and fsynced, so a crash can at worst leave a torn last
line, which ``read`` skips with a warning.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from cpbench import guards, metrics
from cpbench import ideal as ideal_def
from cpbench.errors import UsageError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from cpbench.config import AttentionConfig, RunConfig

SCHEMA_VERSION = 1
OK, OOM, FAILED, TIMEOUT = "ok", "OOM", "failed", "timeout"
STATUSES = (OK, OOM, FAILED, TIMEOUT)  # timeout: a sweep's case ran past its limit
# what a case measured (null until it did), and the sections some records add
MEASURED = ("resolved", "error", "traceback", "samples_ms", "memory_bytes", "memory_status",
            "memory_error", "check")
SECTIONS = ("sweep", "simulation", "upstream", "profile", "balance", "dryrun", "padding",
            "packing", "round", "comm", "ideal", "sizes", "load", "timing", "estimate")
# a row's key: what was asked for, not what a machine resolved it to (the device, the kernel
# "auto" became), so a sweep checked on a login node matches records made on GPUs
KEY_RUN_FIELDS = ("kernel", "warmup", "iters", "fwd_only", "check", "seed")

log = logging.getLogger("cpbench")


def make_record(*, strategy: str, options: DataclassInstance, attention: AttentionConfig,
                run: RunConfig, kernel: str, world_size: int, ranks_per_node: int,
                ranks_per_problem: int, env: dict[str, Any], status: str = OK,
                **measured: Any) -> dict[str, Any]:
    """A record: ``options`` is the strategy's Options instance, ``attention`` and ``run``
    the config dataclasses; ``measured`` any of MEASURED and SECTIONS (the rest null). JSON-
    safe (as a reader of the file sees it), with ``derived`` filled."""
    unknown = set(measured) - set(MEASURED) - set(SECTIONS)
    assert not unknown and status in STATUSES, (unknown, status)
    record = {
        "schema_version": SCHEMA_VERSION,
        "config": {"strategy": strategy, "options": dataclasses.asdict(options),
                   "option_defaults": dataclasses.asdict(type(options)()),
                   "attention": attention.to_dict(), "run": run.to_dict()},
        "kernel": kernel,
        "topology": {"world_size": world_size, "ranks_per_node": ranks_per_node,
                     "num_nodes": world_size // ranks_per_node},
        "ranks_per_problem": ranks_per_problem, "env": env, "status": status,
        **dict.fromkeys(MEASURED), **measured,
    }
    safe: dict[str, Any] = json.loads(json.dumps(record, default=str))
    safe["derived"] = derive(safe)
    return safe


def comm_section(per_rank: list[list[float]], counted: str) -> dict[str, Any]:
    """The ``comm`` section from each rank's [FWD bytes, FWD varied, FWD+BWD bytes, FWD+BWD
    varied, declared fwd, declared bwd] (-1: not counted / not declared)."""
    def column(i: int, kind: Callable[[float], Any] = int) -> list[Any] | None:
        values = [kind(r[i]) if r[i] >= 0 else None for r in per_rank]
        return None if all(v is None for v in values) else values

    declared = {"fwd": column(4), "bwd": column(5)}
    return {"counted": counted,
            "sent_bytes": {p: column(i) for p, i in (("fwd", 0), ("fwd_bwd", 2))
                           if column(i) is not None},
            "varies": {p: column(i, bool) for p, i in (("fwd", 1), ("fwd_bwd", 3))
                       if column(i - 1) is not None},
            "schedule_bytes": declared if declared["fwd"] is not None else None}


def case_key(*, strategy: str, options: dict[str, Any], attention: dict[str, Any],
             run: dict[str, Any], world_size: int, ranks_per_node: int) -> str:
    """The key of one row: what was asked for (see KEY_RUN_FIELDS), as canonical JSON."""
    return json.dumps({"strategy": strategy, "options": options, "attention": attention,
                       "run": {k: run.get(k) for k in KEY_RUN_FIELDS},
                       "world_size": world_size, "ranks_per_node": ranks_per_node},
                      sort_keys=True)


def record_key(record: dict[str, Any]) -> str:
    """What identifies a record's row across runs: its config, less how it was launched
    (output file, format, timeouts)."""
    cfg, topo = record["config"], record["topology"]
    return case_key(strategy=cfg["strategy"], options=cfg["options"],
                    attention=cfg["attention"], run=cfg["run"],
                    world_size=topo["world_size"], ranks_per_node=topo["ranks_per_node"])


def _json(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True)


def as_read(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as ``read`` gives it back once appended (keys sorted, JSON's types): a run
    renders its summary from what ``cpbench report`` will read, not from a live dict."""
    back: dict[str, Any] = json.loads(_json(record))
    return back


def append(path: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Append ``record`` as one line; returns once it is on disk. The append holds an
    exclusive lock on the file: writers sharing it (Slurm array tasks on NFS, where the
    client only emulates O_APPEND) would otherwise interleave their records."""
    line = (_json(record) + "\n").encode()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by close
        view = memoryview(line)
        while view:  # O_APPEND: each write lands at the end; loop only on a short write
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record in ``path``. A torn (unparseable) last line after valid records is
    skipped with a warning; any other unparseable line, or a line that is not a cpbench
    record, is an error."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    records: list[dict[str, Any]] = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if i == last and records:
                log.warning("%s: skipping a torn last line (%d bytes): the run writing it "
                            "stopped mid-write", path, len(line))
                continue
            raise UsageError(f"{path}:{i + 1}: not a JSON record; give cpbench's records (run, "
                             f"sweep, simulate)") from None
        records.append(_checked(record, f"{path}:{i + 1}"))
    return records


def read_from(path: str | os.PathLike[str], offset: int = 0) -> list[dict[str, Any]]:
    """The records appended to ``path`` after byte ``offset`` (what one launch wrote),
    skipping lines that do not parse (a launch killed mid-write)."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().split(b"\n")
    found = []
    for line in lines:
        try:
            record = json.loads(line) if line.strip() else None
        except ValueError:
            continue
        if isinstance(record, dict) and "config" in record:
            found.append(record)
    return found


def _checked(record: Any, where: str) -> dict[str, Any]:
    if not isinstance(record, dict) or not {"config", "status"} <= set(record):
        raise UsageError(f"{where}: not a cpbench record (no config / status); give "
                         f"cpbench's records (run, sweep, simulate)")
    version = record.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise UsageError(f"{where}: schema_version {version!r} is not one this cpbench "
                         f"reads (<= {SCHEMA_VERSION}); upgrade cpbench")
    return record


# -- derived figures -------------------------------------------------------------------------

def problem_flops(attention: dict[str, Any], mode: str) -> float:
    """FLOPs of the whole attention problem (global S, query heads) in ``mode``: the area
    its mask attends (``metrics.problem_flops``)."""
    return _flops(attention, mode)[0]


def _flops(attention: dict[str, Any], mode: str) -> tuple[float, str]:
    docs, window = attention.get("documents"), attention.get("window_size")
    return metrics.problem_flops(
        batch=attention["batch"], seqlen=attention["seqlen"], heads=attention["heads"],
        head_dim=attention["head_dim"], causal=attention["causal"],
        documents=tuple(docs) if docs else None, window=tuple(window) if window else None,
        mode=mode, v_head_dim=attention.get("v_head_dim"))


# an older record's mark: its FWD+BWD holds what the harness added between the parts
STEP_SYNCED = "FWD+BWD holds the harness's sync and barrier between FWD and BWD (older record)"


def _fractions(ideal: dict[str, Any] | None, d: dict[str, Any]) -> dict[str, Any]:
    """The ideal step (``cpbench.ideal``: the kernel alone on each GPU's share) over the
    measured step, per phase; none for an older record's ideal of another definition."""
    if not ideal or ideal.get("fwd_ms") is None:
        return {}
    if ideal_def.superseded(ideal):
        return {"ideal_superseded": ideal_def.SUPERSEDED}
    out = {"fraction_of_ideal_fwd": ideal["fwd_ms"] / d["fwd_ms"]}
    if ideal.get("bwd_ms") is not None and d.get("fwd_bwd_ms"):
        out["fraction_of_ideal"] = (ideal["fwd_ms"] + ideal["bwd_ms"]) / d["fwd_bwd_ms"]
    else:
        out["fraction_of_ideal"] = out["fraction_of_ideal_fwd"]
    return out


def derive(record: dict[str, Any]) -> dict[str, Any]:
    """Every figure a report prints, from the record's raw measurements and config, and
    the physics guards' flags on them (``cpbench.guards``)."""
    out = _figures(record)
    out["not_measured"] = guards.not_measured(record)
    out["flags"] = guards.flags(record, out)
    return guards.withhold(out)  # a flagged or not-CP row's CP figures under "withheld"


def _figures(record: dict[str, Any]) -> dict[str, Any]:
    attention = record["config"]["attention"]
    out: dict[str, Any] = {"flops_fwd": problem_flops(attention, "fwd"),
                 "flops_fwd_bwd": problem_flops(attention, "fwd_bwd"),
                 "flops_counted": _flops(attention, "fwd")[1]}
    if record.get("balance"):
        out["imbalance"] = record["balance"]["imbalance"]
    if record.get("padding"):
        out["padded_tokens"] = record["padding"]["padded_tokens"]
        out["padding_fraction"] = record["padding"]["fraction"]
    checks = record.get("check")
    out["check_passed"] = None if not checks else all(c["passed"] for c in checks)
    n = record["ranks_per_problem"]
    samples = record.get("samples_ms") or {}
    if not samples.get("fwd"):
        return out
    fwd = metrics.step_time(samples["fwd"])
    out.update(fwd_ms=fwd, fwd_tflops=metrics.tflops_per_gpu(out["flops_fwd"], n, fwd / 1e3),
               slowest_rank_fwd=metrics.slowest_rank(samples["fwd"]))
    if samples.get("fwd_bwd"):
        both = metrics.step_time(samples["fwd_bwd"])
        # timed on its own (bench.timer); an old record's FWD+BWD − FWD is not a measurement
        bwd = metrics.step_time(samples["bwd"]) if samples.get("bwd") else None
        out.update(fwd_bwd_ms=both, bwd_ms=bwd,
                   fwd_bwd_tflops=metrics.tflops_per_gpu(out["flops_fwd_bwd"], n, both / 1e3),
                   bwd_tflops=(metrics.tflops_per_gpu(problem_flops(attention, "bwd"), n,
                                                         bwd / 1e3) if bwd and bwd > 0 else None),
                   slowest_rank_fwd_bwd=metrics.slowest_rank(samples["fwd_bwd"]))
        if samples.get("bwd") and not (record.get("timing") or {}).get("step"):
            out["step_synced"] = STEP_SYNCED
    out.update(_fractions(record.get("ideal"), out))
    if record.get("memory_bytes"):
        out["memory_mb"] = max(record["memory_bytes"]) / metrics.MB
    return out
