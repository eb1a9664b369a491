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
- raw measurements: ``samples_ms`` {"fwd", "fwd_bwd"}: per rank, per timed iteration, each
  kept as soon as it was measured (a phase that failed later leaves the earlier ones);
  ``memory_bytes`` per rank, measured after the timings with its own ``memory_status`` and
  ``memory_error`` (null bytes when that step failed or ran out of memory; the timings stay);
  ``check``: per tensor max abs / max rel error and verdict;
- ``derived``: the figures computed from the above by ``derive`` (kept for other tools;
  readers recompute them rather than trust them).

Appends write whole lines, flushed and fsynced, so a crash can at worst leave a torn last
line, which ``read`` skips with a warning.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Iterable

from cpbench.bench import flops as flops_mod
from cpbench.bench import timer
from cpbench.bench.memory import MB

SCHEMA_VERSION = 1
OK, OOM, FAILED = "ok", "OOM", "failed"
STATUSES = (OK, OOM, FAILED)

log = logging.getLogger("cpbench")


def append(path: str | os.PathLike, record: dict) -> None:
    """Append ``record`` as one line; returns once it is on disk."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(line)
        while view:  # O_APPEND: each write lands at the end; loop only on a short write
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: str | os.PathLike) -> list[dict]:
    """Every record in ``path``. A torn (unparseable) last line is skipped with a warning;
    an unparseable line elsewhere is an error."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    records = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if i == last:
                log.warning("%s: skipping a torn last line (%d bytes): the run writing it "
                            "stopped mid-write", path, len(line))
                continue
            raise ValueError(f"{path}:{i + 1}: not a JSON record; the file is damaged")
        version = record.get("schema_version")
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise ValueError(f"{path}:{i + 1}: schema_version {version!r} is not one this "
                             f"cpbench reads (<= {SCHEMA_VERSION}); upgrade cpbench")
        records.append(record)
    return records


# -- derived figures -------------------------------------------------------------------------

def problem_flops(attention: dict, mode: str) -> float:
    """FLOPs of the whole attention problem (global S, query heads) in ``mode``."""
    return flops_mod.attention_flops(
        batch=attention["batch"], seqlen_q=attention["seqlen"], seqlen_k=attention["seqlen"],
        heads=attention["heads"], head_dim=attention["head_dim"], causal=attention["causal"],
        mode=mode)


def derive(record: dict) -> dict:
    """Every figure a report prints, from the record's raw measurements and config."""
    attention = record["config"]["attention"]
    out: dict = {"flops_fwd": problem_flops(attention, "fwd"),
                 "flops_fwd_bwd": problem_flops(attention, "fwd_bwd")}
    checks = record.get("check")
    out["check_passed"] = None if not checks else all(c["passed"] for c in checks)
    n = record["ranks_per_problem"]
    samples = record.get("samples_ms") or {}
    if not samples.get("fwd"):
        return out
    fwd = timer.step_time(samples["fwd"])
    out.update(fwd_ms=fwd, fwd_tflops=flops_mod.tflops_per_gpu(out["flops_fwd"], n, fwd / 1e3),
               slowest_rank_fwd=timer.slowest_rank(samples["fwd"]))
    if samples.get("fwd_bwd"):
        both = timer.step_time(samples["fwd_bwd"])
        bwd = both - fwd  # as seed 001's Burst lines print it
        out.update(fwd_bwd_ms=both, bwd_ms=bwd,
                   fwd_bwd_tflops=flops_mod.tflops_per_gpu(out["flops_fwd_bwd"], n, both / 1e3),
                   bwd_tflops=(flops_mod.tflops_per_gpu(problem_flops(attention, "bwd"), n,
                                                         bwd / 1e3) if bwd > 0 else None),
                   slowest_rank_fwd_bwd=timer.slowest_rank(samples["fwd_bwd"]))
    if record.get("memory_bytes"):
        out["memory_mb"] = max(record["memory_bytes"]) / MB
    return out


def options_label(record: dict) -> str:
    """The options that set this row apart, as the strategy resolved them: a placement bare,
    the others as k=v where they differ from the strategy's defaults (an automatic 0 that
    resolved to 2 shows as 2) or are not options at all (e.g. a ring degree the strategy
    derived); "-" when none do."""
    cfg = record["config"]
    shown = {**cfg["options"], **(record.get("resolved") or {})}
    defaults = cfg.get("option_defaults", {})
    parts = [str(shown["placement"])] if "placement" in shown else []
    parts += [f"{k}={option_text(v)}" for k, v in shown.items()
              if k != "placement" and (k not in defaults or defaults[k] != v)]
    return " ".join(parts) or "-"


def option_text(value) -> str:
    """An option's value as labels print it; nested options (a composite strategy's inner
    one) as ``{k=v,…}``."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}={option_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def to_frame(records: Iterable[dict]):
    """One pandas row per record: the problem, topology, status and every derived figure."""
    import pandas as pd

    rows = []
    for r in records:
        cfg, d = r["config"], derive(r)
        a = cfg["attention"]
        rows.append({
            "strategy": cfg["strategy"], "options": options_label(r),
            "dtype": a["dtype"], "batch": a["batch"], "seqlen": a["seqlen"],
            "heads": a["heads"], "kv_heads": a["kv_heads"] or a["heads"],
            "head_dim": a["head_dim"], "causal": a["causal"],
            "world": r["topology"]["world_size"], "nodes": r["topology"]["num_nodes"],
            "ranks_per_node": r["topology"]["ranks_per_node"],
            "ranks_per_problem": r["ranks_per_problem"], "kernel": r["kernel"],
            "device": cfg["run"]["device"], "fwd_only": cfg["run"]["fwd_only"],
            "status": r["status"], "error": r.get("error"),
            "memory_status": r.get("memory_status"), "memory_error": r.get("memory_error"),
            **{k: d.get(k) for k in ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "memory_mb",
                                     "fwd_tflops", "bwd_tflops", "fwd_bwd_tflops",
                                     "check_passed")},
            "utc": r["env"].get("utc"), "git_sha": r["env"].get("git_sha"),
            "simulated": bool(r["env"].get("simulated")),
        })
    return pd.DataFrame(rows)
