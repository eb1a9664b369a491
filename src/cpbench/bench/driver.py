"""The benchmark driver behind ``cpbench run`` and ``torchrun benchmarks/run.py``.

1. ``plan``: everything is validated before any process group exists — strategy names,
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
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from cpbench import comm, kernels, results, strategies
from cpbench.report import console
from cpbench.bench import env as env_mod
from cpbench.bench import memory, timer
from cpbench.bench.check import global_inputs, run_local
from cpbench.config import AttentionConfig, RunConfig, default_attention
from cpbench.reference import TENSORS, Comparison, compare, reference_attention
from cpbench.topology import Topology, divisors

log = logging.getLogger("cpbench")
out_log = logging.getLogger("cpbench.out")  # results: stdout in every format (report.console)
DEFAULT_NPROC = 4
_STATUS_CODE = {results.OK: 0, results.OOM: 1, results.FAILED: 2}


@dataclass(frozen=True)
class Case:
    """One row: a strategy and one set of its options."""

    strategy: str
    options: Any

    @property
    def label(self) -> str:
        fields = dataclasses.asdict(self.options)
        return f"{self.strategy} ({', '.join(f'{k}={v}' for k, v in fields.items())})" \
            if fields else self.strategy


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A validated run: what every rank executes."""

    attn: AttentionConfig
    run: RunConfig  # resolved: concrete device, warmup, iters
    world_size: int
    ranks_per_node: int
    kernel: str  # the resolved backend's name
    cases: tuple[Case, ...]
    out: str | None
    launcher: str  # "torchrun" or "self"
    skipped: tuple[str, ...] = ()  # variants the config does not allow, and why

    @property
    def topo(self) -> Topology:
        return Topology(world_size=self.world_size, ranks_per_node=self.ranks_per_node)


# -- 1. plan: validate everything before any collective ----------------------------------------

def _device(run: RunConfig, launcher: str) -> str:
    if run.device == "auto":
        return "cuda" if launcher == "torchrun" and torch.cuda.is_available() else "cpu"
    if run.device == "cuda" and launcher == "self":
        raise ValueError("--nproc starts CPU ranks (gloo); for GPUs launch with torchrun: "
                         "torchrun --nproc-per-node N benchmarks/run.py ...")
    if run.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible here; use --device cpu")
    return run.device


def _world(run: RunConfig, launcher: str) -> tuple[int, int]:
    """(world size, default ranks per node)."""
    if launcher == "torchrun":
        if run.nproc is not None:
            raise ValueError("--nproc starts local ranks itself; under torchrun the world is "
                             "torchrun's (--nnodes × --nproc-per-node): drop --nproc")
        _, world, local = env_mod.torchrun_world()
        return world, local
    nproc = run.nproc or DEFAULT_NPROC
    limit = env_mod.max_local_ranks()
    if nproc > limit:
        raise ValueError(f"--nproc {nproc} is more ranks than this machine can run "
                         f"({os.cpu_count()} cores; at most {limit}); use --nproc {limit} or "
                         f"fewer, or torchrun across machines")
    # >= 2 emulated nodes wherever possible, so inter-node placements really differ
    return nproc, max([d for d in divisors(nproc) if nproc // d >= 2] or [nproc])


def _cases(names: tuple[str, ...], given: dict, topo: Topology) -> list[Case]:
    if "all" in names:
        names = tuple(sorted(strategies.names()))
    classes = [strategies.get(n) for n in dict.fromkeys(names)]  # unknown → lists the names
    takes = {cls.name: {f.name for f in dataclasses.fields(cls.Options)} for cls in classes}
    for opt in given:
        if not any(opt in t for t in takes.values()):
            if len(classes) == 1:
                strategies.make_options(classes[0], given)  # raises, naming what it takes
            owners = [n for n in strategies.names()
                      if opt in {f.name for f in dataclasses.fields(strategies.get(n).Options)}]
            flag = "--" + opt.replace("_", "-")
            raise ValueError(f"no selected strategy takes {flag} (it is an option of "
                             f"{', '.join(owners) or 'no strategy'}); drop it or add one "
                             f"of those to --strategy")
    cases = []
    for cls in classes:
        mine = {k: v for k, v in given.items() if k in takes[cls.name]}
        strategies.make_options(cls, mine)  # checks choices
        variants = [dataclasses.replace(v, **mine) for v in cls.variants(topo)]
        cases += [Case(cls.name, v) for v in dict.fromkeys(variants)]
    return cases


def _validate_case(case: Case, attn: AttentionConfig, topo: Topology, backend) -> Any:
    """Build the strategy on every rank without groups (pure); returns rank 0's instance."""
    cls = strategies.get(case.strategy)
    if cls.causal_only and not attn.causal:
        raise ValueError(f"{case.strategy} only runs causal attention; drop --no-causal")
    try:
        built = [cls(attn, topo, r, kernel=backend, options=case.options, create_groups=False)
                 for r in range(topo.world_size)]
    except ValueError as e:
        raise ValueError(f"{case.label}: {e}") from None
    return built[0]


def _runnable(cases: list[Case], names: tuple[str, ...], attn: AttentionConfig,
              topo: Topology, backend) -> tuple[list, list[str]]:
    """The cases the config allows, each with rank 0's strategy, and why the others are left
    out. Variants a strategy merely suggests (and, under ``all``, whole strategies) that
    cannot run this config are skipped; a strategy asked for by name with no runnable
    variant is an error, and so is nothing runnable but a no-CP baseline."""
    built, skipped, first_error = [], [], {}
    for case in cases:
        try:
            built.append((case, _validate_case(case, attn, topo, backend)))
        except ValueError as e:
            skipped.append(str(e))
            first_error.setdefault(case.strategy, e)
    ran = {case.strategy for case, _ in built}
    for name in names:
        if name != "all" and name not in ran and name in first_error:
            raise first_error[name]
    if first_error and not any(strat.ranks_per_problem > 1 for _, strat in built):
        raise next(iter(first_error.values()))  # a baseline alone compares with nothing
    return built, skipped


def _check_fits(plan_cases, attn: AttentionConfig, topo: Topology, device: str,
                local_ranks: int, check: bool) -> None:
    cap = memory.available_bytes(device, local_ranks)
    if cap is None:
        return
    shape = dict(batch=attn.batch, heads=attn.heads, kv_heads=attn.num_kv_heads,
                 head_dim=attn.head_dim, element_size=attn.element_size)
    for case, strat in plan_cases:
        need = memory.step_lower_bound(local_seqlen=strat.local_seqlen, **shape)
        if need > cap:
            raise ValueError(
                f"{case.label}: seqlen {attn.seqlen} needs at least {memory.gib(need)} per "
                f"rank for q, k, v, out and their gradients alone (an estimate), more than "
                f"the {memory.gib(cap)} a rank has here; use a smaller --seqlen or --batch, "
                f"or more ranks")
    if check:
        per_rank, reference = memory.check_bytes(seqlen=attn.seqlen, **shape)
        sharing = local_ranks if device == "cpu" else 1  # ranks sharing rank 0's memory
        if per_rank * sharing + reference > cap * sharing:
            raise ValueError(
                f"--check builds the global tensors on every rank and a float64 reference "
                f"on rank 0: at seqlen {attn.seqlen} that is about "
                f"{memory.gib(per_rank * sharing + reference)} (an estimate), more than the "
                f"{memory.gib(cap * sharing)} available here; check at a small --seqlen "
                f"(e.g. 8k) and time this size without --check")


def _default_out(run: RunConfig, attn: AttentionConfig) -> str:
    utc = env_mod.utc_now().replace("-", "").replace(":", "")
    names = "+".join(run.strategy).replace("/", "_")
    return str(Path("runs") / f"{utc}_{names}_{attn.seqlen}" / "results.jsonl")


def plan(run: RunConfig, attention: dict, options: dict, *, launcher: str) -> Plan:
    """Validate a request and resolve its defaults. ``attention``: the AttentionConfig fields
    given on the command line; ``options``: the strategy options given. Pure apart from
    reading the machine; raises ValueError with the fix for anything it cannot run."""
    device = _device(run, launcher)
    run = run.resolved(device)
    attn = AttentionConfig(**{**default_attention(device), **attention})
    world, default_rpn = _world(run, launcher)
    topo = Topology(world_size=world, ranks_per_node=run.ranks_per_node or default_rpn)
    run = dataclasses.replace(run, ranks_per_node=topo.ranks_per_node,
                              nproc=world if launcher == "self" else None)
    backend = kernels.resolve(run.kernel, device=device, dtype=attn.torch_dtype,
                              head_dim=attn.head_dim, heads=attn.heads,
                              kv_heads=attn.num_kv_heads)
    built, skipped = _runnable(_cases(run.strategy, options, topo), run.strategy, attn, topo,
                               backend)
    if "all" in run.strategy:  # baselines after the CP rows they are compared with
        built.sort(key=lambda cb: cb[1].ranks_per_problem == 1)
    cases = [case for case, _ in built]
    local_ranks = topo.ranks_per_node if launcher == "torchrun" else world
    _check_fits(built, attn, topo, device, local_ranks, run.check)
    out = None if (run.out or "").lower() == "none" else (run.out or _default_out(run, attn))
    if out is not None and Path(out).is_dir():
        raise ValueError(f"--out {out} is a directory; give a file such as {out}/results.jsonl")
    return Plan(attn=attn, run=run, world_size=world, ranks_per_node=topo.ranks_per_node,
                kernel=backend.name, cases=tuple(cases), out=out, launcher=launcher,
                skipped=tuple(skipped))


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


def reference_by_head(inputs: dict, attn: AttentionConfig) -> dict:
    """The float64 reference one query head at a time (heads are independent), so its S×S
    matrices exist for one head only; dK/dV of a shared KV head sum over its query heads."""
    group = attn.heads // attn.num_kv_heads
    parts: dict[str, list] = {"out": [], "lse": [], "dq": []}
    b, s, _, d = inputs["k"].shape
    dk = torch.zeros(b, s, attn.num_kv_heads, d, dtype=torch.float64,
                     device=inputs["k"].device)
    dv = torch.zeros_like(dk)
    for h in range(attn.heads):
        j = h // group
        ref = reference_attention(inputs["q"][:, :, h:h + 1], inputs["k"][:, :, j:j + 1],
                                  inputs["v"][:, :, j:j + 1], inputs["dout"][:, :, h:h + 1],
                                  causal=attn.causal, softmax_scale=attn.softmax_scale)
        for name in parts:
            parts[name].append(ref[name])
        dk[:, :, j:j + 1] += ref["dk"]
        dv[:, :, j:j + 1] += ref["dv"]
    return {"out": torch.cat(parts["out"], 2), "lse": torch.cat(parts["lse"], 1),
            "dq": torch.cat(parts["dq"], 2), "dk": dk, "dv": dv}


def _check(strat, p: Plan, rank: int, cache: dict) -> list[dict]:
    """Collective: the strategy on global inputs vs the float64 reference (rank 0 computes
    the reference, once per problem); every rank gets the comparisons."""
    import torch.distributed as dist

    attn = strat.attn
    inputs = global_inputs(attn, p.run.seed, p.run.device)
    got = run_local(strat, inputs)
    full = {name: strat.unshard(comm.all_gather(got[name]), seq_dim=2 if name == "lse" else 1)
            for name in TENSORS}
    found = [None]
    if rank == 0:
        if attn not in cache:
            cache.clear()  # one problem per run; never hold two references
            threads = torch.get_num_threads()
            torch.set_num_threads(os.cpu_count() or 1)  # the other ranks only wait meanwhile
            try:
                cache[attn] = reference_by_head(inputs, attn)
            finally:
                torch.set_num_threads(threads)
        ref = cache[attn]
        found = [[dataclasses.asdict(compare(n, full[n], ref[n], attn.dtype)) for n in TENSORS]]
    dist.broadcast_object_list(found, src=0)
    return found[0]


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
        checks = phase(lambda: _check(strat, p, rank, ref_cache))
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
