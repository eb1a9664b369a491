"""``cpbench simulate --memory-from DRYRUN.jsonl``: memory as the dry run measured it.

The dry run (``cpbench dryrun``) executes the strategy's own code on fake tensors and counts
every allocation, rank by rank; the memory model (``sim.memory``) is an estimate of the same.
Where a dry-run record of the same case (strategy, options, attention problem, topology)
exists, a prediction takes the dry run's peak and keeps the model's beside it, so the
table says how far the estimate is from what was measured; elsewhere the estimate stands.
Under a mask a CPU dry run measures the CPU's masked kernels, which hold score tiles a GPU's
varlen kernel does not: such records are not used.
"""

from __future__ import annotations

import json
import statistics

from cpbench import results
from cpbench.config import AttentionConfig
from cpbench.errors import UsageError
from cpbench.mask import mask_of
from cpbench.metrics import gib


def _key(record: dict) -> str:
    cfg, topo = record["config"], record["topology"]
    return json.dumps([cfg["strategy"], cfg["options"], cfg["attention"],
                       topo["world_size"], topo["ranks_per_node"]], sort_keys=True)


def load(path: str) -> dict[str, int]:
    """Case key → the peak bytes of the dry run's worst rank, from a dry run's records."""
    peaks = {}
    for r in results.read(path):
        if not r.get("dryrun") or r["status"] != results.OK or not r.get("memory_bytes"):
            continue
        attn = AttentionConfig(**r["config"]["attention"])
        if r["dryrun"]["device"] == "cpu" and not mask_of(attn).plain:
            continue
        peaks[_key(r)] = max(b for b in r["memory_bytes"] if b is not None)
    if not peaks:
        raise UsageError(f"{path}: no dry-run record that ran (write one with cpbench dryrun "
                         f"--out FILE.jsonl)")
    return peaks


def apply(records: list[dict], peaks: dict[str, int]) -> None:
    """Each simulated record with a dry run of its case takes its memory from it (the
    model's estimate and its error kept under ``simulation``), in place."""
    for r in records:
        peak = peaks.get(_key(r))
        sim = r["simulation"]
        sim["memory_source"] = "model"
        if peak is None:
            continue
        model_bytes = r["memory_bytes"][0]
        sim.update(memory_source="dryrun", memory_model_bytes=model_bytes,
                   memory_model_error=model_bytes / peak - 1)
        r["memory_bytes"] = [peak]
        over = peak > sim["capacity_bytes"]
        if over and r["status"] == results.OK:
            r.update(status=results.OOM, memory_status=results.OOM, samples_ms=None,
                     error=f"the dry run measured {gib(peak)} per GPU, above "
                           f"{gib(sim['capacity_bytes'])}")


def summary(records: list[dict], path: str) -> str:
    """A line on where the memory column came from and the model's error where measured."""
    errors = [r["simulation"]["memory_model_error"] for r in records
              if r["simulation"].get("memory_source") == "dryrun"]
    rest = len(records) - len(errors)
    if not errors:
        return (f"memory: no row has a dry run in {path}; the column is the model's "
                "estimate\n")
    worst = max(errors, key=abs)
    return (f"memory: {len(errors)} row(s) from the dry run in {path} (the model's estimate "
            f"against it: median {statistics.median(abs(e) for e in errors) * 100:.1f} %, "
            f"worst {worst * 100:+.1f} %); {rest} row(s) from the model alone\n")
