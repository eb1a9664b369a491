"""``cpbench kernels``' grid: every kernel × shape measured in this process (one device), each
measured case a result record (``env.kernel_bench``: the no-CP problem on one rank, so
``cpbench report`` and the data frame read it like any row; a case that failed is a "failed"
record with its error and traceback); skipped cases come back with their reason."""

from __future__ import annotations

import itertools
import logging
import socket
from dataclasses import dataclass

import torch

from cpbench import results, strategies
from cpbench.bench import env as env_mod
from cpbench.bench import kernelbench
from cpbench.config import AttentionConfig, RunConfig
from cpbench.errors import UsageError, unknown
from cpbench.kernels.base import dtype_name

log = logging.getLogger("cpbench")


@dataclass(frozen=True, kw_only=True)
class Grid:
    """What to measure: kernel names × every combination of the shape lists."""

    kernels: tuple[str, ...]
    seqlens: tuple[int, ...]
    heads: tuple[int, ...]
    head_dims: tuple[int, ...]
    dtypes: tuple[str, ...]
    causal: tuple[bool, ...]
    batch: int = 1

    def cases(self) -> list[kernelbench.Case]:
        out = []
        for s, h, d, dt, c in itertools.product(self.seqlens, self.heads, self.head_dims,
                                                self.dtypes, self.causal):
            attn = AttentionConfig(batch=self.batch, seqlen=s, heads=h, head_dim=d,
                                   dtype=dt, causal=c)  # UsageError on a bad shape
            out.append(kernelbench.Case(seqlen=s, heads=h, head_dim=d, causal=c,
                                        dtype=attn.torch_dtype, batch=self.batch))
        return out

    def check(self) -> None:
        """UsageError for an unknown kernel or a bad shape, before anything runs."""
        known = kernelbench.names()
        for name in self.kernels:
            if name not in known:
                raise UsageError(unknown("kernel", name, known, "docs/run.md (cpbench kernels)"))
        self.cases()


def _attention(case: kernelbench.Case) -> AttentionConfig:
    return AttentionConfig(batch=case.batch, seqlen=case.seqlen, heads=case.heads,
                           head_dim=case.head_dim, dtype=dtype_name(case.dtype),
                           causal=case.causal)


def _record(name: str, case: kernelbench.Case, m: kernelbench.Measured, run: RunConfig,
            env: dict) -> dict:
    local = strategies.get("local")
    samples = {k: [v] for k, v in (("fwd", m.fwd_ms), ("bwd", m.bwd_ms),
                                   ("fwd_bwd", m.fwd_bwd_ms)) if v}
    return results.make_record(
        strategy="local", options=local.Options(), attention=_attention(case), run=run,
        kernel=name, world_size=1, ranks_per_node=1, ranks_per_problem=1, env=env,
        status={"OOM": results.OOM, "failed": results.FAILED}.get(m.status, results.OK),
        error=m.reason, traceback=m.traceback, samples_ms=samples or None,
        memory_bytes=None if m.peak_bytes is None else [m.peak_bytes],
        memory_status=results.OOM if m.status == "OOM" and m.peak_bytes is None else None)


def run_grid(grid: Grid, *, device: str, warmup: int, iters: int,
             capacity_bytes: int | None, out: str | None = None, seed: int = 0
             ) -> tuple[list[dict], list[dict]]:
    """(records of the measured cases, skipped cases with their reason); each record is
    appended to ``out`` as soon as it is measured."""
    run = RunConfig(strategy=("local",), kernel=",".join(grid.kernels), device=device,
                    warmup=warmup, iters=iters, seed=seed, out=out or "none")
    env = {**env_mod.capture(device=device, launcher="kernels",
                             hostnames=[socket.gethostname()], world_size=1,
                             ranks_per_node=1), "kernel_bench": True}
    records, skipped = [], []
    todo = list(itertools.product(grid.cases(), grid.kernels))
    dead = None  # a CUDA error no later call survives: the cases after it are not tried
    for i, (case, name) in enumerate(todo, start=1):
        log.info("kernel %d/%d: %s %s", i, len(todo), name, kernelbench.label(case),
                 extra={"transient": True})
        if dead:
            m = kernelbench.Measured(status="skipped", reason=f"not tried: {dead}")
        else:
            m = kernelbench.measure(name, case, device=device, warmup=warmup, iters=iters,
                                    capacity_bytes=capacity_bytes, seed=seed)
        if m.status == "failed":
            log.warning("kernel %s, %s failed (its row says so; the grid goes on): %s", name,
                        kernelbench.label(case), m.reason)
            if m.sticky:
                dead = f"{name} on {kernelbench.label(case)} left the GPU unusable"
        if m.status == "skipped":
            skipped.append({"kernel": name, "attention": _attention(case).to_dict(),
                            "reason": m.reason})
            continue
        shown = name if name != "auto" else \
            f"auto ({kernelbench.resolved_name(name, case, device)})"
        record = _record(shown, case, m, run, env)
        records.append(record)
        if out:
            results.append(out, record)
        if device == "cuda":
            torch.cuda.empty_cache()  # the next case's peak is its own
    return records, skipped
