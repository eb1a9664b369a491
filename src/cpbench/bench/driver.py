"""The benchmark driver behind ``cpbench run`` and ``torchrun benchmarks/run.py``.

1. ``bench.plan``: everything is validated before any process group exists — strategy names,
   options, topology, kernel and dtype, each strategy's own ``validate()`` (built with
   ``create_groups=False`` for every rank), sizes that obviously cannot fit, the ``--out``
   file. A bad request is one ValueError whose message says the fix. (Variants a strategy
   suggests, and under ``all`` whole strategies, that the config does not allow or that
   cannot fit are skipped with a note.)
2. ``launch`` (``--nproc``: local gloo ranks through ``cpbench.launch.run_ranks``) or
   ``torchrun_main`` (init from torchrun's environment: nccl on CUDA, gloo on CPU). Every
   process group, the strategies' subgroups included, times out after
   ``--collective-timeout``.
3. ``rank_main`` on every rank, per (strategy, options) case: build the strategy (its groups),
   ``--check`` against the float64 reference, build this rank's input shard straight from
   the seed, time FWD and gather its samples, time FWD+BWD and gather its samples, then
   measure peak memory (``bench.memory``) as a separate step, so a failed or OOM memory
   measurement leaves the timings in the record; on rank 0 append the record and print.

Every phase ends with all ranks agreeing on its outcome (an all-reduce of a status flag), so
an OOM or an exception in one case becomes that row's status on every rank and the run goes
on with the next case.

A rank failing *inside* a strategy's communication, while its peers wait on it, cannot be
agreed on: its peers are blocked in the collective until it times out. What happens then:

- gloo (CPU): the waiting ranks' collective fails after ``--collective-timeout`` and the
  process group is unusable from then on (gloo closes the connection). A rank that sees a
  collective fail does not enter the agreement; one waiting there for it times out as well.
  Rank 0 records the case as failed, with the failing rank's own error when it left one in
  the rendezvous store, keeps every record already written, lists the cases that did not run,
  and every rank exits 1. It takes up to about twice ``--collective-timeout``.
- NCCL (GPU): the NCCL watchdog aborts the processes when the collective times out, before
  Python sees an error; torchrun ends the job non-zero. The records already written are kept;
  the current case and the later ones are lost (re-run them).
- A rank stuck outside any collective (a kernel that never returns) is stopped only by
  ``--deadline`` (``--nproc``) or the scheduler's time limit.

The driver never names a strategy: names, options, variants, ``ranks_per_problem`` and the
resolved options (``resolved_options()``) come from the registry and the strategy objects.
"""

from __future__ import annotations

import dataclasses
import gc
import json
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

    return run_ranks(rank_main, p.world_size, p, timeout=p.run.deadline,
                     collective_timeout=p.run.collective_timeout, leave_together=False)[0]


def torchrun_main(p: Plan) -> int:
    """Join torchrun's job (env://) and run the plan on this rank; the exit status."""
    import torch.distributed as dist

    rank, world, _ = env_mod.torchrun_world()
    if p.run.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if p.run.device == "cuda" else "gloo",
                            timeout=timedelta(seconds=p.run.collective_timeout))
    try:
        return rank_main(rank, world, p)
    finally:
        dist.destroy_process_group()


def _store():
    """The rendezvous store (a TCP key-value store beside the process group): it still works
    when a collective has failed, so a failing rank can leave its error there for rank 0."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # best effort: without it, rank 0 reports its own error
        return None


# -- 3. on every rank ------------------------------------------------------------------------

def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))  # the CPU allocator


# What gloo and NCCL errors say when a collective failed or timed out (gloo raises plain
# RuntimeErrors; newer torch raises DistError subclasses for some).
_COLLECTIVE_ERRORS = ("Timed out waiting", "pair closure", "Connection closed by peer",
                      "Connection reset by peer", "gloo/transport", "NCCL error",
                      "ProcessGroupNCCL", "ProcessGroupGloo")


def _is_collective_error(e: BaseException) -> bool:
    """Whether ``e`` says a collective failed, leaving the process group unusable."""
    dist_error = getattr(torch.distributed, "DistError", None)
    return (dist_error is not None and isinstance(e, dist_error)) or \
        any(marker in str(e) for marker in _COLLECTIVE_ERRORS)


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


class _Agreement:
    """Runs phases of one case on this rank; after each, all ranks agree on how it went, so a
    failure on any rank becomes the phase's status on every rank. Once a collective has
    failed, the process group is unusable: the phase's status is the failing rank's own (as
    it left it in the store; else "failed" with this rank's collective error), ``broken`` is
    set, and no further collective is attempted (see the module docstring)."""

    def __init__(self, device: str, store=None, key: str = ""):
        import torch.distributed as dist

        self.dist, self.store, self.key = dist, store, key
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)  # allocated before any OOM
        self.status, self.error, self.traceback = results.OK, None, None
        self.broken = False

    def __call__(self, fn: Callable[[], Any]) -> Any:
        if self.status != results.OK or self.broken:
            return None
        mine, msg, tb, value, collective = results.OK, None, None, None, False
        try:
            value = fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            mine = results.OOM if _is_oom(e) else results.FAILED
            msg, tb, collective = _one_line(e), traceback.format_exc(), _is_collective_error(e)
        if mine != results.OK:
            self._cleanup()  # after the except block: its traceback no longer pins tensors
            self._publish(mine, msg, tb, collective)
        if collective:  # a collective failed here: the group is unusable, agree on nothing
            self._break(None, msg)
            return None
        try:
            self.flag.fill_(_STATUS_CODE[mine])
            self.dist.all_reduce(self.flag, op=self.dist.ReduceOp.MAX)
            agreed = int(self.flag.item())
            if not agreed:
                return value
            reports = [None] * self.dist.get_world_size()
            self.dist.all_gather_object(reports, (mine, msg, tb))
        except Exception as e:  # the agreement is a collective too
            self._break((mine, msg, tb) if mine != results.OK else None, _one_line(e))
            return None
        self.status = next(s for s, c in _STATUS_CODE.items() if c == agreed)
        rank, (_, msg, tb) = next((r, rep) for r, rep in enumerate(reports)
                                  if rep[0] == self.status)
        self.error, self.traceback = f"rank {rank}: {msg}", tb
        return None

    def _publish(self, status: str, msg: str, tb: str, collective: bool) -> None:
        """Leave this rank's failure in the store, where rank 0 can read it if the group
        breaks before the agreement."""
        if self.store is None:
            return
        try:
            self.store.set(f"cpbench/{self.key}/{self.dist.get_rank()}",
                           json.dumps([status, msg, tb, collective]))
        except Exception:  # best effort
            pass

    def _peer_failure(self) -> tuple[int, str, str, str] | None:
        """The first rank's own (non-collective) failure left in the store: the likely cause
        of the collective failing. None when no rank left one."""
        if self.store is None:
            return None
        for rank in range(self.dist.get_world_size()):
            key = f"cpbench/{self.key}/{rank}"
            try:
                if not self.store.check([key]):
                    continue
                status, msg, tb, collective = json.loads(self.store.get(key))
            except Exception:  # best effort
                return None
            if not collective:
                return rank, status, msg, tb
        return None

    def _break(self, own: tuple | None, collective_msg: str) -> None:
        """The group broke (``collective_msg`` on this rank); ``own``: this rank's own
        (status, message, traceback) failure in the phase, if it had one."""
        self.broken = True
        me = self.dist.get_rank()
        cause = (me, *own) if own else self._peer_failure()
        broke = f"rank {me}: {collective_msg}"
        if cause is None:
            self.status, self.error, self.traceback = results.FAILED, broke, None
            return
        rank, status, msg, tb = cause
        self.status, self.traceback = status, tb
        self.error = f"rank {rank}: {msg}; then a collective failed, so the run stopped " \
                     f"({broke})"

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


def _resolved(strat) -> dict:
    """The options as the strategy resolved them on this topology (a Ulysses × ring split,
    a window taken from the node size, …): ``strat.resolved_options()`` where the strategy
    has it, else its options as given. JSON-safe."""
    hook = getattr(strat, "resolved_options", None)
    found = hook() if callable(hook) else dataclasses.asdict(strat.opts)
    return json.loads(json.dumps(found, default=str))


def _barrier(device: str) -> Callable[[], None]:
    import torch.distributed as dist

    if device == "cuda":
        return lambda: dist.barrier(device_ids=[torch.cuda.current_device()])
    return dist.barrier


def run_case(p: Plan, case: Case, rank: int, env: dict, ref_cache: dict, *, store=None,
             key: str = "", prefix: str = "") -> tuple[dict, bool]:
    """Every phase of one case on this rank (collective): (the record, complete on rank 0;
    whether the process group broke)."""

    def status(text):
        log.info("%s: %s", prefix or case.label, text, extra={"transient": True})

    dev, run = p.run.device, p.run
    cls = strategies.get(case.strategy)
    phase = _Agreement(dev, store, key)
    tm = timer.Timer(dev, _barrier(dev))

    status("building groups")

    def build():
        built = cls(p.attn, p.topo, rank, kernel=kernels.get(p.kernel), options=case.options)
        return built, _resolved(built)

    strat, resolved = phase(build) or (None, None)
    checks = None
    if run.check:
        status("checking against the float64 reference")
        checks = phase(lambda: _check(strat, p, ref_cache))
        gc.collect()
    x = phase(lambda: _inputs(strat, p, rank))
    fwd, fwd_bwd = _closures(strat, x) if x is not None else (None, None)
    # each phase's samples are gathered as soon as it is timed: a later failure keeps them
    samples = {"fwd": None, "fwd_bwd": None}
    status("timing FWD")
    s_fwd = phase(lambda: tm.measure(fwd, warmup=run.warmup, iters=run.iters))
    samples["fwd"] = phase(lambda: timer.gather_samples(s_fwd, dev))
    if not run.fwd_only:
        status("timing FWD+BWD")
        s_both = phase(lambda: tm.measure(fwd_bwd, warmup=run.warmup, iters=run.iters))
        samples["fwd_bwd"] = phase(lambda: timer.gather_samples(s_both, dev))
    memory_bytes = mem = None
    if phase.status == results.OK and not phase.broken:
        status("measuring memory")
        mem = _Agreement(dev, store, f"{key}/memory")  # its own status: timings stay
        peak = mem(lambda: memory.peak_bytes(fwd if run.fwd_only else fwd_bwd, device=dev,
                                             inputs=x.values()))
        memory_bytes = mem(lambda: [int(v[0]) for v in timer.gather_samples([peak], dev)])
    ranks_per_problem = strat.ranks_per_problem if strat is not None else p.world_size
    strat = x = fwd = fwd_bwd = None  # free the shards and graphs before the next case
    _Agreement._cleanup()
    tb = phase.traceback if phase.status == results.FAILED else \
        mem.traceback if mem is not None and mem.status == results.FAILED else None
    record = {
        "schema_version": results.SCHEMA_VERSION,
        "config": {"strategy": case.strategy, "options": dataclasses.asdict(case.options),
                   "option_defaults": dataclasses.asdict(cls.Options()),
                   "attention": p.attn.to_dict(), "run": run.to_dict()},
        "kernel": p.kernel,
        "topology": {"world_size": p.world_size, "ranks_per_node": p.ranks_per_node,
                     "num_nodes": p.topo.num_nodes},
        "ranks_per_problem": ranks_per_problem, "resolved": resolved,
        "env": env, "status": phase.status, "error": phase.error, "traceback": tb,
        "samples_ms": samples if any(samples.values()) else None,
        "memory_bytes": memory_bytes,
        "memory_status": mem.status if mem is not None else None,
        "memory_error": mem.error if mem is not None else None,
        "check": checks,
    }
    record["derived"] = results.derive(record)
    return record, phase.broken or (mem is not None and mem.broken)


def _not_run_note(broke_in: Case, rest: tuple[Case, ...]) -> str:
    names = ",".join(dict.fromkeys(c.strategy for c in rest))
    return (f"not run: {', '.join(c.label for c in rest)} — a collective failed in "
            f"{broke_in.label} and the process group is unusable; re-run them with "
            f"--strategy {names}")


def rank_main(rank: int, world: int, p: Plan) -> int:
    """Run every case of the plan on this rank (process group initialised); exit status.
    Leaves together with the other ranks (a barrier) unless the process group broke."""
    import torch.distributed as dist

    from cpbench import report

    console.setup(rank, p.run.format)
    store = _store()
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
    records, ref_cache, failed, broken = [], {}, False, False
    for i, case in enumerate(p.cases, 1):
        prefix = f"[{i}/{len(p.cases)}] {case.label}"
        log.info("%s", prefix, extra={"transient": "plain"})
        t0 = time.perf_counter()
        record, broken = run_case(p, case, rank, env, ref_cache, store=store, key=str(i),
                                  prefix=prefix)
        # what a reader of the file sees is exactly what is printed: render from the JSON
        record = json.loads(json.dumps(record))
        failed |= results.FAILED in (record["status"], record["memory_status"])
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
        if broken:
            if p.cases[i:]:
                log.info("%s", _not_run_note(case, p.cases[i:]))
            break
    if rank == 0:
        out_log.info(report.summary(records, p.run.format).rstrip("\n"))
        if p.out:
            log.info("records: %s  (re-render: cpbench report %s)", p.out, p.out)
        if broken:
            log.info("FAILED: a collective failed and the run stopped there (see above)")
        elif failed:
            log.info("FAILED: a strategy raised or a check failed (see above)")
    if not broken:
        try:
            _barrier(p.run.device)()  # leave together: gloo can abort when peers close first
        except Exception:  # a peer is gone; nothing left to agree on
            broken = True
    return 1 if failed or broken else 0
