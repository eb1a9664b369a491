"""The benchmark driver behind ``cpbench run`` and ``torchrun benchmarks/run.py``.

1. ``bench.plan``: everything is validated before any process group exists — strategy names,
   options, topology, kernel and dtype, each strategy's own ``validate()`` (built with
   ``create_groups=False`` for every rank), and sizes that obviously cannot fit. A bad
   request is one ValueError whose message says the fix. (Variants a strategy suggests, and
   under ``all`` whole strategies, that the config does not allow are skipped with a note.)
2. ``launch`` (``--nproc``: local gloo ranks through ``cpbench.launch.run_ranks``) or
   ``torchrun_main`` (init from torchrun's environment: nccl on CUDA, gloo on CPU).
3. ``rank_main`` on every rank, per (strategy, options) case: build the strategy (its groups),
   ``--check`` against the float64 reference, build this rank's input shard straight from
   the seed, time FWD and FWD+BWD (``bench.timer``), measure peak memory (``bench.memory``),
   gather, and on rank 0 append the record and print.

Every phase ends with all ranks agreeing on its outcome (an all-reduce of a status flag), so
an OOM or an exception in one case becomes that row's status on every rank and the run goes
on with the next case. Limit: a rank failing *inside* a strategy's communication, while its
peers wait on it, is only noticed when their wait times out (``--timeout``).

The driver never names a strategy: names, options, variants and ``ranks_per_problem`` come
from the registry and the strategy objects.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch

from cpbench import kernels, results, strategies
from cpbench.report import console
from cpbench.bench import env as env_mod
from cpbench.bench import memory, timer
from cpbench.bench.check import check_strategy
from cpbench.bench.plan import Case, Plan
from cpbench.reference import Comparison

log = logging.getLogger("cpbench")
out_log = logging.getLogger("cpbench.out")  # results: stdout in every format (report.console)
_STATUS_CODE = {results.OK: 0, results.OOM: 1, results.FAILED: 2}


# -- 2. launch -------------------------------------------------------------------------------

def launch(p: Plan) -> int:
    """Start ``p.world_size`` local gloo ranks and run the plan; the exit status."""
    from cpbench.launch import run_ranks

    return run_ranks(rank_main, p.world_size, p, timeout=p.run.timeout)[0]


def torchrun_main(p: Plan) -> int:
    """Join torchrun's job (env://) and run the plan on this rank; the exit status."""
    import torch.distributed as dist

    rank, world, _ = env_mod.torchrun_world()
    if p.run.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if p.run.device == "cuda" else "gloo",
                            timeout=timedelta(seconds=p.run.timeout))
    try:
        status = rank_main(rank, world, p)
        # leave together: a gloo rank whose peers already closed their connections can
        # abort in its teardown ("terminate called without an active exception")
        dist.barrier()
        return status
    finally:
        dist.destroy_process_group()


# -- 3. on every rank ------------------------------------------------------------------------

def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))  # the CPU allocator


class _Agreement:
    """Runs one phase of a case on this rank, then agrees with all ranks on how it went."""

    def __init__(self, device: str):
        import torch.distributed as dist

        self.dist = dist
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)  # allocated before any OOM
        self.status, self.error, self.traceback = results.OK, None, None

    def __call__(self, fn: Callable[[], Any]) -> Any:
        if self.status != results.OK:
            return None
        mine, msg, tb, value = results.OK, None, None, None
        try:
            value = fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            mine = results.OOM if _is_oom(e) else results.FAILED
            msg = " ".join(f"{type(e).__name__}: {e}".split())  # one line
            tb = traceback.format_exc()
        if mine != results.OK:
            self._cleanup()  # after the except block: its traceback no longer pins tensors
        self.flag.fill_(_STATUS_CODE[mine])
        self.dist.all_reduce(self.flag, op=self.dist.ReduceOp.MAX)
        agreed = int(self.flag.item())
        if not agreed:
            return value
        reports = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(reports, (mine, msg, tb))
        self.status = next(s for s, c in _STATUS_CODE.items() if c == agreed)
        rank, (_, msg, tb) = next((r, rep) for r, rep in enumerate(reports)
                                  if rep[0] == self.status)
        self.error, self.traceback = f"rank {rank}: {msg}", tb
        return None

    @staticmethod
    def _cleanup() -> None:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _check(strat, p: Plan, cache: dict) -> list[dict]:
    """Collective: the strategy on global inputs vs the float64 reference."""
    return [dataclasses.asdict(c) for c in
            check_strategy(strat, p.run.seed, device=p.run.device, cache=cache)]


def _inputs(strat, p: Plan, rank: int) -> dict:
    """This rank's shard, drawn straight from the seed at the shard's shape (never a global
    tensor: at S = 1M the global q alone would not fit on one rank)."""
    a, dev = p.attn, p.run.device
    gen = torch.Generator(device=dev).manual_seed(p.run.seed * 100_003 + rank)
    s = strat.local_seqlen

    def rand(heads, grad):
        t = torch.randn(a.batch, s, heads, a.head_dim, generator=gen, device=dev,
                        dtype=a.torch_dtype)
        return t.requires_grad_(grad)

    return {"q": rand(a.heads, True), "k": rand(a.num_kv_heads, True),
            "v": rand(a.num_kv_heads, True), "dout": rand(a.heads, False)}


def _closures(strat, x: dict) -> tuple[Callable[[], None], Callable[[], None]]:
    """(FWD, FWD+BWD) as zero-argument closures. The timed forward builds the autograd graph
    exactly as in FWD+BWD (then drops it), so BWD = FWD+BWD − FWD is the backward alone."""
    q, k, v, dout = x["q"], x["k"], x["v"], x["dout"]

    def fwd():
        strat.attention(q, k, v)

    def fwd_bwd():
        out, _ = strat.attention(q, k, v)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    return fwd, fwd_bwd


def run_case(p: Plan, case: Case, rank: int, env: dict, ref_cache: dict,
             prefix: str = "") -> dict:
    """Every phase of one case on this rank (collective); the record (complete on rank 0)."""
    import torch.distributed as dist

    def status(text):
        log.info("%s: %s", prefix or case.label, text, extra={"transient": True})

    dev, run = p.run.device, p.run
    cls = strategies.get(case.strategy)
    phase = _Agreement(dev)
    t_barrier = (lambda: dist.barrier(device_ids=[torch.cuda.current_device()])) \
        if dev == "cuda" else dist.barrier
    tm = timer.Timer(dev, t_barrier)

    status("building groups")
    strat = phase(lambda: cls(p.attn, p.topo, rank, kernel=kernels.get(p.kernel),
                              options=case.options))
    checks = None
    if run.check:
        status("checking against the float64 reference")
        checks = phase(lambda: _check(strat, p, ref_cache))
        gc.collect()
    x = phase(lambda: _inputs(strat, p, rank))
    fwd, fwd_bwd = _closures(strat, x) if x is not None else (None, None)
    status("timing FWD")
    s_fwd = phase(lambda: tm.measure(fwd, warmup=run.warmup, iters=run.iters))
    s_both = None
    if not run.fwd_only:
        status("timing FWD+BWD")
        s_both = phase(lambda: tm.measure(fwd_bwd, warmup=run.warmup, iters=run.iters))
    status("measuring memory")
    peak = phase(lambda: memory.peak_bytes(fwd if run.fwd_only else fwd_bwd, device=dev,
                                           inputs=x.values()))
    samples = memory_bytes = None
    if phase.status == results.OK:
        samples = {"fwd": timer.gather_samples(s_fwd, dev),
                   "fwd_bwd": timer.gather_samples(s_both, dev) if s_both else None}
        memory_bytes = [int(v[0]) for v in timer.gather_samples([peak], dev)]
    ranks_per_problem = strat.ranks_per_problem if strat is not None else p.world_size
    strat = x = fwd = fwd_bwd = None  # free the shards and graphs before the next case
    _Agreement._cleanup()
    record = {
        "schema_version": results.SCHEMA_VERSION,
        "config": {"strategy": case.strategy, "options": dataclasses.asdict(case.options),
                   "option_defaults": dataclasses.asdict(cls.Options()),
                   "attention": p.attn.to_dict(), "run": run.to_dict()},
        "kernel": p.kernel,
        "topology": {"world_size": p.world_size, "ranks_per_node": p.ranks_per_node,
                     "num_nodes": p.topo.num_nodes},
        "ranks_per_problem": ranks_per_problem,
        "env": env, "status": phase.status, "error": phase.error,
        "traceback": phase.traceback if phase.status == results.FAILED else None,
        "samples_ms": samples, "memory_bytes": memory_bytes, "check": checks,
    }
    record["derived"] = results.derive(record)
    return record


def rank_main(rank: int, world: int, p: Plan) -> int:
    """Run every case of the plan on this rank (process group initialised); exit status."""
    import json

    import torch.distributed as dist

    from cpbench import report

    console.setup(rank, p.run.format)
    hostnames = [None] * world
    dist.all_gather_object(hostnames, socket.gethostname())
    env = env_mod.capture(device=p.run.device, launcher=p.launcher, hostnames=hostnames,
                          world_size=world, ranks_per_node=p.ranks_per_node) if rank == 0 else {}
    topo = p.topo
    log.info("cpbench: %d case(s) on %d ranks (%d node(s) × %d), %s on %s, %s",
             len(p.cases), world, topo.num_nodes, topo.ranks_per_node, p.kernel, p.run.device,
             ", ".join(f"{k}={v}" for k, v in p.attn.to_dict().items()))
    for reason in p.skipped:
        log.info("skipped %s", reason)
    records, ref_cache, failed = [], {}, False
    for i, case in enumerate(p.cases, 1):
        prefix = f"[{i}/{len(p.cases)}] {case.label}"
        log.info("%s", prefix, extra={"transient": "plain"})
        t0 = time.perf_counter()
        record = run_case(p, case, rank, env, ref_cache, prefix)
        # what a reader of the file sees is exactly what is printed: render from the JSON
        record = json.loads(json.dumps(record))
        failed |= record["status"] == results.FAILED
        failed |= record["derived"]["check_passed"] is False
        if rank == 0:
            if p.out:
                results.append(p.out, record)
            log.info("%s: %s in %.1f s", prefix,
                     record["status"] if record["status"] != results.OK else "done",
                     time.perf_counter() - t0)
            if p.run.format == "table":
                out_log.info(report.detail(record))
            elif record.get("check"):
                for c in record["check"]:
                    log.info("  %s", Comparison(**c).line())
            records.append(record)
    if rank == 0:
        out_log.info(report.summary(records, p.run.format).rstrip("\n"))
        if p.out:
            log.info("records: %s  (re-render: cpbench report %s)", p.out, p.out)
        if failed:
            log.info("FAILED: a strategy raised or a check failed (see above)")
    return 1 if failed else 0
