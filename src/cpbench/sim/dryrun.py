"""``cpbench dryrun``: every case's real code on every distinct rank, on fake tensors
(``bench.dryrun``), held against the device's memory and against the simulator's memory model.

Cases expand as for ``run`` (``--strategy all``, variants, options, masks: the same checks);
for each, the ranks whose roles differ run (``bench.dryrun.distinct_ranks``; the others are
alike to one of them) or the ``--ranks`` given. A row per (case, rank): peak memory of FWD
and FWD+BWD, bytes sent per phase and what the schedule declares, the verdict against the
device's memory (OOM says by how much), the error with its file and line; beside each case
the simulator's memory estimate and its error against the dry run's worst rank.
"""

from __future__ import annotations

import logging
import textwrap
from dataclasses import dataclass

from cpbench import results
from cpbench.bench import dryrun
from cpbench.bench.env import utc_now
from cpbench.bench.plan import Case, expand_cases, runnable
from cpbench.config import AttentionConfig, RunConfig
from cpbench.errors import UsageError
from cpbench.mask import mask_of
from cpbench.metrics import gib
from cpbench.sim import model
from cpbench.sim.hardware import Hardware
from cpbench.topology import Topology

log = logging.getLogger("cpbench")
GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Request:
    """A validated dry run: the problem, the cases, where they run, what a rank holds."""

    attn: AttentionConfig
    topo: Topology
    cases: tuple[Case, ...]
    kernel: str
    device: str
    capacity_bytes: int | None
    hardware: Hardware | None  # for the simulator's estimate (None: no estimate)
    ranks: tuple[int, ...] | None = None  # None: every distinct rank
    fwd_only: bool = False
    skipped: tuple[str, ...] = ()


def cases_for(names: tuple[str, ...], options: dict, attn: AttentionConfig, topo: Topology,
              backend, device: str, *, auto: bool) -> tuple[list[Case], list[str]]:
    """The runnable cases and why the others are skipped (``run``'s own rules; ``auto``: the
    kernel was auto's pick, which a library's strategy may trade for its own)."""
    built, skipped = runnable(expand_cases(names, options, topo), names, attn, topo, backend,
                              device, None, auto=auto)
    return [case for case, _ in built], skipped


def _verdict(peak: int | None, capacity: int | None) -> tuple[str, str | None]:
    if peak is None or capacity is None or peak <= capacity:
        return results.OK, None
    return results.OOM, (f"needs {gib(peak)}, the device has {gib(capacity)} "
                         f"({gib(peak - capacity)} over)")


def _simulated(req: Request, case: Case) -> float | None:
    try:
        return model.memory_estimate(case.strategy, case.options, req.attn, req.topo,
                                     kernel_buffers=req.device == "cuda")
    except UsageError:  # an adapter: no schedule to model
        return None


def run_case(req: Request, case: Case, say=None) -> list[dict]:
    """One row per rank run, each naming the ranks alike to it. ``say``: what is under way
    (a progress line; default the status line alone)."""
    kernel = case.kernel or req.kernel
    alike = dryrun.distinct_ranks(case.strategy, case.options, req.attn, req.topo,
                                  kernel_name=kernel)
    if req.ranks is not None:
        alike = {r: [r] for r in req.ranks}
    rows = []
    for i, (rank, same) in enumerate(alike.items(), 1):
        if say is not None:
            say(f"rank {rank} ({i} of {len(alike)})")
        else:
            log.info("%s: rank %d (%d of %d)", case.label, rank, i, len(alike),
                     extra={"transient": True})
        r = dryrun.dry_rank(case.strategy, case.options, req.attn, req.topo, rank,
                            kernel_name=kernel, device=req.device, fwd_only=req.fwd_only)
        declared = dryrun.schedule_bytes(case.strategy, case.options, req.attn, req.topo,
                                         rank, kernel_name=kernel)
        status, why = _verdict(r.peak_fwd_bwd_bytes, req.capacity_bytes)
        rows.append({"case": case.label, "strategy": case.strategy, "kernel": kernel,
                     "rank": rank,
                     "alike": same, "status": r.status if r.status != results.OK else status,
                     "error": r.error or why, "where": r.where,
                     "peak_fwd_bytes": r.peak_fwd_bytes,
                     "peak_fwd_bwd_bytes": r.peak_fwd_bwd_bytes,
                     "sent_bytes": {p: r.sent_bytes(p) for p in r.events},
                     "schedule_bytes": declared,
                     "collectives": _collectives(r)})
    return rows


def _collectives(r: dryrun.RankResult) -> list[dict]:
    """Calls and bytes per (phase, op, dtype, group)."""
    cells: dict[tuple, list[int]] = {}
    for phase, events in r.events.items():
        for e in events:
            cell = cells.setdefault((phase, e.op, e.dtype, e.group), [0, 0])
            cell[0] += 1
            cell[1] += e.nbytes
    return [{"phase": p, "op": op, "dtype": dt, "group": list(g), "calls": n, "bytes": b}
            for (p, op, dt, g), (n, b) in cells.items()]


def summarize(req: Request, case: Case, rows: list[dict]) -> dict:
    """A case's worst rank, the simulator's estimate and its error against it."""
    peaks = [r["peak_fwd_bwd_bytes"] for r in rows if r["peak_fwd_bwd_bytes"] is not None]
    worst = max(rows, key=lambda r: r["peak_fwd_bwd_bytes"] or -1)
    sim = _simulated(req, case)
    peak = max(peaks) if peaks else None
    matches = [r["schedule_bytes"] is None or r["schedule_bytes"] == r["sent_bytes"]
               for r in rows if r["status"] != results.FAILED]
    # under a mask the model is the GPU's varlen path; the CPU's masked kernels hold
    # score tiles instead, and at V's own width sdpa-cpu zero-pads to the wider one (aten's
    # one-width op): no error against a CPU dry run there
    comparable = req.device != "cpu" or (mask_of(req.attn).plain and req.attn.v_head_dim is None)
    return {"case": case.label, "worst": worst, "peak": peak, "simulated": sim,
            "sim_error": (sim - peak) / peak if sim is not None and peak and comparable
            else None,
            "schedule_match": all(matches) if any(r["schedule_bytes"] is not None
                                                  for r in rows) else None,
            "ranks_run": len(rows)}


def record(req: Request, case: Case, rows: list[dict], env: dict) -> dict:
    """The case as a result record (status ok / OOM / failed; per-rank memory filled from
    each rank's representative; the rows in ``dryrun``)."""
    per_rank: list[int | None] = [None] * req.topo.world_size
    for row in rows:
        for r in row["alike"]:
            per_rank[r] = row["peak_fwd_bwd_bytes"]
    bad = next((r for r in rows if r["status"] == results.FAILED), None) or \
        next((r for r in rows if r["status"] == results.OOM), None)
    run = RunConfig(strategy=(case.strategy,), device=req.device, kernel=req.kernel,
                    ranks_per_node=req.topo.ranks_per_node, out="none",
                    fwd_only=req.fwd_only).resolved(req.device)
    return results.make_record(
        strategy=case.strategy, options=case.options, attention=req.attn, run=run,
        kernel=case.kernel or req.kernel, world_size=req.topo.world_size,
        ranks_per_node=req.topo.ranks_per_node, ranks_per_problem=req.topo.world_size,
        env=env, status=bad["status"] if bad else results.OK,
        error=f"rank {bad['rank']}: {bad['error']}" + (f" at {bad['where']}" if bad and
                                                      bad["where"] else "") if bad else None,
        memory_bytes=per_rank if any(p is not None for p in per_rank) else None,
        dryrun={"device": req.device, "capacity_bytes": req.capacity_bytes, "rows": rows},
        padding=_padding(req, case))


def _padding(req: Request, case: Case) -> dict | None:
    """The record's ``padding``: the documents as the case's layout padded them."""
    if not req.attn.documents:
        return None
    try:
        return model.build(case.strategy, case.options, req.attn, req.topo).padding()
    except UsageError:  # it could not be built: the rows already say why
        return None


def env_of(req: Request) -> dict:
    import torch

    return {"dryrun": True, "device": req.device, "torch": torch.__version__,
            "hardware": req.hardware.name if req.hardware else None, "utc": utc_now()}


# -- rendering -------------------------------------------------------------------------------

def _gib(n) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _sent(row: dict) -> str:
    sent = row["sent_bytes"]
    text = "/".join(_gib(sent.get(p)) for p in ("fwd", "bwd") if p in sent) or "-"
    declared = row["schedule_bytes"]
    if declared is None:
        return f"{text} (no schedule)"
    ok = all(declared.get(p) == sent.get(p) for p in sent)
    return f"{text} {'= schedule' if ok else '!= schedule ' + _declared(declared)}"


def _declared(d: dict) -> str:
    return "/".join(_gib(d.get(p)) for p in ("fwd", "bwd"))


def table_rows(summaries: list[dict]) -> list[list[str]]:
    out = []
    for s in summaries:
        w = s["worst"]
        sim = "-" if s["simulated"] is None else f"{s['simulated'] / GIB:.2f}" + (
            "" if s["sim_error"] is None else f" ({s['sim_error']:+.0%})")
        verdict = w["status"] if w["status"] == results.OK else \
            f"{w['status']}: {w['error']}" + (f" at {w['where']}" if w["where"] else "")
        out.append([s["case"], f"{w['rank']} ({s['ranks_run']} run)",
                    f"{_gib(w['peak_fwd_bytes'])}/{_gib(w['peak_fwd_bwd_bytes'])}", sim,
                    _sent(w), verdict])
    return out


# the peaks of FWD and of FWD+BWD share a column, as the bytes sent in each phase do: the
# table fits 120 columns, the verdict (an error and its place) wrapping in what is left
HEADER = ["Strategy", "Worst rank", "Peak GiB FWD/+BWD", "Sim GiB (err)", "Sent GiB FWD/BWD",
          "Verdict"]
WIDTH = 120
MIN_VERDICT = 24


def render(summaries: list[dict], fmt: str, banner: str) -> str:
    rows = table_rows(summaries)
    if fmt == "markdown":
        lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        return banner + "\n\n" + "\n".join(lines + ["| " + " | ".join(r) + " |"
                                                    for r in rows]) + "\n"
    widths = [max(len(str(x)) for x in col) for col in zip(HEADER, *rows)]
    widths[-1] = min(widths[-1], max(MIN_VERDICT, WIDTH - sum(widths[:-1]) - 2 * len(widths[:-1])))
    fmt_row = "  ".join(f"{{:<{w}}}" for w in widths)
    body = textwrap.wrap(banner, WIDTH, subsequent_indent="  ", break_on_hyphens=False)
    body += [fmt_row.format(*HEADER).rstrip(), fmt_row.format(*("-" * w for w in widths))]
    for r in rows:
        verdict = textwrap.wrap(r[-1], widths[-1], break_on_hyphens=False) or [""]
        body += [fmt_row.format(*r[:-1], verdict[0]).rstrip()]
        body += [fmt_row.format(*([""] * (len(r) - 1)), more).rstrip() for more in verdict[1:]]
    return "\n".join(body) + "\n"


def flat_rows(all_rows: list[dict]) -> list[dict]:
    """csv / json: one row per (case, rank)."""
    return [{k: (ranges(v) if k == "alike" else v) for k, v in r.items()
             if k != "collectives"} for r in all_rows]


def ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)
