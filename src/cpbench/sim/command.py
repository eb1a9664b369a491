"""``cpbench simulate``: the tables ``cpbench run`` prints, predicted for a cluster.

Cases expand exactly as for ``run`` (``--strategy all`` and each strategy's variants, options
checked by the same code); each case becomes a result record (schema v1, ``env.simulated``
set, one "sample" per phase: the prediction) so the run, sweep and plot views print it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import textwrap
import typing

from cpbench import ideal, results, strategies
from cpbench.bench.env import utc_now
from cpbench.bench.plan import Case, expand_cases
from cpbench.config import AttentionConfig, RunConfig, packed_problems
from cpbench.errors import Skipped, UsageError
from cpbench.mask import mask_of
from cpbench.metrics import gib
from cpbench.report import labels, tables
from cpbench.report.render import Fit, prose
from cpbench.sim import model
from cpbench.sim.hardware import Hardware
from cpbench.topology import Topology, divisors

log = logging.getLogger("cpbench")


def _record(case: Case, attn: AttentionConfig, topo: Topology, hw: Hardware,
            p: model.Prediction, utc: str, packing: dict | None = None) -> dict:
    run = RunConfig(strategy=(case.strategy,), device="cuda", kernel="simulated",
                    ranks_per_node=topo.ranks_per_node, out="none").resolved("cuda")
    oom = p.oom
    # under a mask, the area each rank computes (a plain causal layout's is known) and,
    # under documents, the padding its layout needs
    strat = None if mask_of(attn).plain else model.build(case.strategy, case.options, attn,
                                                         topo, 0)
    return results.make_record(
        strategy=case.strategy, options=case.options, attention=attn, run=run,
        kernel=f"simulated: {hw.name}", world_size=topo.world_size,
        ranks_per_node=topo.ranks_per_node, ranks_per_problem=p.ranks_per_problem,
        env={"simulated": True, "hardware": hw.name, "utc": utc, "git_sha": None},
        status=results.OOM if oom else results.OK, resolved=p.resolved,
        error=(f"needs {gib(p.memory_bytes)} per GPU, {hw.name} has "
               f"{gib(p.capacity_bytes)}" if oom else None),
        # a predicted OOM has no time: nothing would have run to completion
        samples_ms=None if oom else {"fwd": [[p.fwd_s * 1e3]], "bwd": [[p.bwd_s * 1e3]],
                                     "fwd_bwd": [[p.fwd_bwd_s * 1e3]]},
        memory_bytes=[int(p.memory_bytes)], memory_status=results.OOM if oom else None,
        balance=strat and strat.balance(), padding=strat and strat.padding(),
        packing=packing, ideal=_ideal(attn, p.ranks_per_problem, hw),
        simulation={"fwd_compute_ms": p.fwd_compute_s * 1e3,
                    "bwd_compute_ms": p.bwd_compute_s * 1e3,
                    "capacity_bytes": p.capacity_bytes})


def _ideal(attn: AttentionConfig, ranks: int, hw: Hardware) -> dict:
    """The record's ``ideal`` section (``results.derive`` divides it by the step): the one
    definition (``bench.ideal``), its block priced on the preset's curve, or why none."""
    if not mask_of(attn).plain:
        return {"none": "a masked problem: a block's work is its mask's, not its shape's"}
    fwd, bwd = model.ideal(attn, ranks, hw)
    return ideal.section(attn, ranks, fwd * 1e3, bwd * 1e3, priced="the preset's curve")


def tokens_per_gpu(records: list[dict]) -> str:
    """"8192 tokens per GPU" (batch x sequence over the GPUs of a problem), one figure per
    sequence length."""
    cp: dict[int, int] = {}
    for r in records:
        a = r["config"]["attention"]
        if r["ranks_per_problem"] > 1:  # a no-CP baseline holds the whole sequence
            cp.setdefault(a["seqlen"], a["batch"] * a["seqlen"] // r["ranks_per_problem"])
    if len(cp) <= 1:
        return "".join(f"{n} tokens per GPU" for n in cp.values())
    return "tokens per GPU: " + ", ".join(f"{n} at {s}" for s, n in sorted(cp.items()))


def simulate(names: tuple[str, ...], options: dict, attention: dict, seqlens: list[int],
             topo: Topology, hw: Hardware, *, cases: list[Case] | None = None,
             seed: int = 0, packings: int = 1) -> tuple[list[dict], list[str]]:
    """Records for every case × seqlen (× packing: ``packings`` of the documents
    distribution, seeds ``seed``, ``seed + 1``, ...), and why the cases that cannot run were
    skipped. ValueError when a strategy asked for by name runs at none of them."""
    cases = cases if cases is not None else expand_cases(names, options, topo)
    records, skipped, ran = [], [], set()
    first_error: dict[str, UsageError] = {}
    todo = [(seqlen, i, attn, case) for seqlen in seqlens
            for i, attn in enumerate(packed_problems({**attention, "seqlen": seqlen}, seed,
                                                     packings))
            for case in cases]
    utc = utc_now()  # one invocation, one time: `cpbench report` reads it as one launch
    for n, (seqlen, i, attn, case) in enumerate(todo, start=1):
        # a new (strategy, topology) builds every rank's schedule: seconds at 128 GPUs
        log.info("simulating %d/%d: %s at seqlen %d", n, len(todo), case.label, seqlen,
                 extra={"transient": True})
        packing = None if packings == 1 else {
            "index": i, "count": packings, "seed": seed + i,
            "documents": attention.get("documents")}
        try:
            p = model.predict(case.strategy, case.options, attn, topo, hw)
        except Skipped as e:  # cannot take this mask or dtype: the others still answer
            skipped.append(f"{case.label} at seqlen {seqlen}: {e}")
            continue
        except UsageError as e:
            skipped.append(f"{case.label} at seqlen {seqlen}: {e}")
            first_error.setdefault(case.strategy, e)
            continue
        ran.add(case.strategy)
        records.append(_record(case, attn, topo, hw, p, utc, packing))
    for name in names:
        if name != "all" and name not in ran and name in first_error:
            raise first_error[name]
    if not any(r["ranks_per_problem"] > 1 for r in records):
        if first_error:
            raise next(iter(first_error.values()))
        raise UsageError("local is the no-CP baseline of the CP strategies' efficiency; add "
                         "one, e.g. --strategy local,zigzag")
    # baselines after the CP rows they are compared with, as `cpbench run` orders them
    records.sort(key=lambda r: r["ranks_per_problem"] == 1)
    return records, skipped


def option_grid(cls, topo: Topology) -> list:
    """Every option set worth comparing on ``topo``: each field's choices, both values of a
    flag, 0 (automatic) and every divisor of the world size for a size; plus the variants.
    Sets the strategy rejects are dropped by the caller."""
    hints = typing.get_type_hints(cls.Options)
    axes = []
    for f in dataclasses.fields(cls.Options):
        choices = f.metadata.get("choices")
        typ = hints[f.name]
        if choices:
            axes.append([(f.name, c) for c in choices])
        elif typ is bool:
            axes.append([(f.name, True), (f.name, False)])
        elif typ is int:
            axes.append([(f.name, d) for d in (0, *divisors(topo.world_size))])
        else:
            axes.append([(f.name, f.default)])
    grid = [cls.Options(**dict(combo)) for combo in itertools.product(*axes)]
    return list(dict.fromkeys([*cls.variants(topo), *grid]))


def placement_cases(names: tuple[str, ...], topo: Topology) -> list[Case]:
    if "all" in names:
        names = tuple(strategies.names())
    return [Case(n, o) for n in dict.fromkeys(names) for o in option_grid(strategies.get(n), topo)]


def compare_placements(records: list[dict]) -> list[list[dict]]:
    """Per seqlen, the distinct placements, fastest FWD+BWD first, OOM last. Options that
    resolve alike, or that give a strategy the very same predictions (USP with u = 1 under
    either placement; a window of 1 or of the whole ring), count once: the first."""
    by_seqlen: dict[int, list[dict]] = {}
    seen: set[tuple] = set()
    for r in records:
        seqlen, name, d = r["config"]["attention"]["seqlen"], r["config"]["strategy"], r["derived"]
        keys: set[tuple] = {(seqlen, name, labels.options_label(r))}
        if r["status"] == results.OK:
            keys.add((seqlen, name, d["fwd_ms"], d["fwd_bwd_ms"], tuple(r["memory_bytes"])))
        if keys & seen:
            continue
        seen |= keys
        by_seqlen.setdefault(seqlen, []).append(r)
    out = []
    for seqlen in sorted(by_seqlen):
        rows = by_seqlen[seqlen]
        rows.sort(key=lambda r: (r["status"] != results.OK,
                                 r["derived"].get("fwd_bwd_ms") or float("inf")))
        out.append(rows)
    return out


def _banner(hw: Hardware, topo: Topology, records: list[dict] | None = None) -> str:
    return "\n".join(prose([_banner_text(hw, topo, records)]))


def _banner_text(hw: Hardware, topo: Topology, records: list[dict] | None = None) -> str:
    tokens = tokens_per_gpu(records or [])
    tokens = f", {tokens}" if tokens else ""
    return (f"Simulated, not measured: {hw.name}, {topo.num_nodes} node(s) x "
            f"{topo.ranks_per_node} GPUs{tokens} (cpbench simulate; model: "
            f"cpbench.sim.model)")


def breakdown(records: list[dict]) -> str:
    """Where each row's predicted time goes: the slowest rank's kernels, and the rest
    (communication nothing hides, stragglers), per phase."""
    rows = []
    for r in records:
        d, sim = r["derived"], r["simulation"]
        row = {"Strategy": labels.row_label(r), "Seq Len": str(r["config"]["attention"]["seqlen"])}
        if r["status"] != results.OK:
            rows.append({**row, **dict.fromkeys(_BREAKDOWN, r["status"]), "Notes": r["error"]})
            continue
        fwd, bwd = d["fwd_ms"], d["bwd_ms"]
        values = (sim["fwd_compute_ms"], fwd - sim["fwd_compute_ms"], sim["bwd_compute_ms"],
                  bwd - sim["bwd_compute_ms"])
        rows.append({**row, **{k: f"{v:.2f}" for k, v in zip(_BREAKDOWN, values)},
                     "Notes": "-"})
    if all(r["Notes"] == "-" for r in rows):
        rows = [{k: v for k, v in r.items() if k != "Notes"} for r in rows]
    return "\n".join(["Where the time goes (the kernel time of the slowest rank per step, and "
                      "the rest: communication nothing hides):",
                      *tables.render(None, rows, "table", _BREAKDOWN_FIT)]) + "\n"


_BREAKDOWN = ("FWD kernels (ms)", "FWD rest (ms)", "BWD kernels (ms)", "BWD rest (ms)")
_BREAKDOWN_FIT = Fit(lift=("Seq Len",), wrap=("Strategy",), notes=("Notes",))


def render(records: list[dict], hw: Hardware, topo: Topology, fmt: str) -> str:
    from cpbench.report import sweep

    if fmt in ("csv", "json"):
        return tables.summary(records, fmt)
    several = len({r["config"]["attention"]["seqlen"] for r in records}) > 1
    # the banner says they are simulated: the sweep view's own note would say it again
    body = (sweep.grouped(records, fmt) + "\n" + sweep.pivot(records, fmt) if several
            else tables.summary(records, fmt))
    return f"{_banner(hw, topo, records)}\n\n{body}\n{breakdown(records)}{_ideal_note(records)}"


def _ideal_note(records: list[dict]) -> str:
    if not any((r.get("ideal") or {}).get("what") for r in records):
        return ""
    text = f"Fraction of Ideal: {ideal.IDEAL}; its block on the preset's curve."
    return "\n".join(textwrap.wrap(text, 100)) + "\n"



_COMPARISON_FIT = Fit(wrap=("Placement",), short={"Memory (MB)": "Mem (MB)"})


def render_comparison(groups: list[list[dict]], hw: Hardware, topo: Topology, fmt: str) -> str:
    if fmt in ("csv", "json"):  # the rows in ranked order, every column
        return tables.summary([r for rows in groups for r in rows], fmt)
    out = [_banner(hw, topo, [r for rows in groups for r in rows]), ""]
    for rows in groups:
        a = rows[0]["config"]["attention"]
        best = next((r["derived"]["fwd_bwd_ms"] for r in rows if r["status"] == results.OK),
                    None)
        table = []
        for i, (r, cells) in enumerate(zip(rows, tables.rows(rows)), start=1):
            d = r["derived"]
            table.append({
                "#": str(i), "Strategy": cells["Strategy"], "Placement": cells["Placement"],
                "FWD (ms)": cells["FWD (ms)"], "FWD+BWD (ms)": cells["FWD+BWD (ms)"],
                "Memory (MB)": cells["Memory (MB)"], "TFLOPs/s": cells["TFLOPs/s"],
                "vs best": (f"{best / d['fwd_bwd_ms']:.2f}x" if r["status"] == results.OK
                            and best else "-")})
        title = (f"Placements at Seq Len {a['seqlen']} ({a['dtype']}, B={a['batch']}, "
                 f"H={a['heads']}, D={a['head_dim']}, "
                 + (f"DV={a['v_head_dim']}, " if a.get("v_head_dim") else "")
                 + ("sinks, " if a.get("sinks") else "") +
                 f"{'causal' if a['causal'] else 'full'}), fastest first")
        out += [*tables.render(title, table, fmt, _COMPARISON_FIT), ""]
    return "\n".join(out)
