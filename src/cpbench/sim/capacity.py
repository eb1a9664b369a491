"""``cpbench simulate --tokens-per-gpu T --nodes 1,2,4,...``: the capacity question in one
table. At each scale every strategy (and variant) runs the same tokens per GPU; per row the
time, TFLOP/s per GPU, the fraction of the ideal and memory against the GPU's; the best
strategy at each scale is marked, with its margin over the next strategy and whether that
margin is larger than the model's stated error (the preset's held-out median, where it has
held-out published rows; none stated, the margin cannot be judged)."""

from __future__ import annotations

from cpbench import results
from cpbench.errors import UsageError
from cpbench.report import cells, labels, tables
from cpbench.report.render import Fit, prose
from cpbench.sim import command
from cpbench.sim.hardware import Hardware
from cpbench.topology import Topology


def sweep(names: tuple[str, ...], options: dict, attention: dict, nodes: list[int],
          gpus_per_node: int, tokens_per_gpu: int | None, hw: Hardware
          ) -> tuple[list[dict], list[str]]:
    """Records for every strategy at every scale, each scale's sequence length the tokens
    per GPU times its GPUs (over the batch); and why cases were not simulated."""
    records, skipped = [], []
    for n in nodes:
        topo = Topology(world_size=n * gpus_per_node, ranks_per_node=gpus_per_node)
        seqlen = attention["seqlen"] if tokens_per_gpu is None else \
            tokens_per_gpu * topo.world_size // attention.get("batch", 1)
        for name in names:  # one that cannot run at this scale leaves the others
            try:
                got, why = command.simulate((name,), options, attention, [seqlen], topo, hw)
            except UsageError as e:
                skipped.append(f"{n} node(s): {e}")
                continue
            records += got
            skipped += [f"{n} node(s): {w}" for w in why]
    if not records:
        raise UsageError("no strategy runs at any of these scales; " + "; ".join(skipped[:3]))
    return records, skipped


def _best(rows: list[dict], error: float | None) -> dict[int, str]:
    """Per row index: the mark of the fastest strategy at its scale, with its margin."""
    ok = sorted((r["derived"]["fwd_bwd_ms"], i) for i, r in enumerate(rows)
                if r["status"] == results.OK)
    if not ok:
        return {}
    best_ms, best = ok[0]
    name = rows[best]["config"]["strategy"]
    nxt = next(((ms, i) for ms, i in ok if rows[i]["config"]["strategy"] != name), None)
    if nxt is None:
        return {best: "best (no other strategy)"}
    margin = nxt[0] / best_ms - 1
    other = rows[nxt[1]]["config"]["strategy"]
    if margin < 5e-4:
        return {best: f"best, tied with {other}"}
    judged = "" if error is None else ", beyond error" if margin > error else ", within error"
    return {best: f"best +{cells.sig(100 * margin)} % vs {other}{judged}"}


def render(records: list[dict], hw: Hardware, skipped: list[str]) -> str:
    error = hw.stated_error
    by_scale: dict[int, list[dict]] = {}
    for r in records:
        by_scale.setdefault(r["topology"]["world_size"], []).append(r)
    table = []
    for world, rows in sorted(by_scale.items()):
        marks = _best(rows, error)
        for i, (r, shown) in enumerate(zip(rows, tables.rows(rows))):
            d, a = r["derived"], r["config"]["attention"]
            ok = r["status"] == results.OK
            table.append({
                "GPUs": f"{world // r['topology']['ranks_per_node']}x"
                        f"{r['topology']['ranks_per_node']}",
                "Seq Len": str(a["seqlen"]), "Strategy": labels.row_label(r),
                "FWD+BWD (ms)": shown["FWD+BWD (ms)"], "TFLOPs/s": shown["TFLOPs/s"],
                "Ideal (%)": cells.pct(d.get("fraction_of_ideal")) if ok else "-",
                "Memory / GPU (GiB)": f"{cells.sig(r['memory_bytes'][0] / 2 ** 30)} / "
                                      f"{cells.sig(r['simulation']['capacity_bytes'] / 2 ** 30)}",
                "Best": marks.get(i, "")})
    per_gpu = {r["config"]["attention"]["batch"] * r["config"]["attention"]["seqlen"]
               // r["ranks_per_problem"] for r in records if r["ranks_per_problem"] > 1}
    tokens = f", {per_gpu.pop()} tokens per GPU" if len(per_gpu) == 1 else ""
    stated = "none (no held-out published CP rows on this preset): a margin cannot be judged" \
        if error is None else f"{100 * error:.1f} % (the held-out median)"
    lines = [*prose([f"Capacity: {hw.name}, kernel {hw.kernel_name}{tokens} (simulated, "
                     f"not measured)"]),
             *tables.render(None, table, "table", Fit(wrap=("Strategy", "Best"))),
             *prose([f"Best: the fastest FWD+BWD at each scale, its margin over the next "
                     f"strategy; the model's stated error: {stated}."])]
    if skipped:
        lines += ["not simulated:", *prose([f"  {w}" for w in skipped])]
    lines += prose(command.evidence_lines(records, hw))
    return "\n".join(lines) + "\n"
