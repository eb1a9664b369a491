"""The grouped kernel table of ``cpbench profile summarize``, and the lines a run's detail
block prints for a record's ``profile``.

Percentages are of the device time: the sum of the kernels' times (nsys's and
torch.profiler's convention), or torch's footer total when the table was cut at a row
limit. On a CPU trace, of the busy time: each instant is charged to one op, as the step
breakdown charges it, so nested ops and gloo's spans over them are not counted twice.
"""

from __future__ import annotations

import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from cpbench.profile import breakdown as bd
from cpbench.profile.groups import OTHER, TOP_GROUPS, Rules, top
from cpbench.profile.parsers import KernelRow, KernelTable, Trace

NAME_WIDTH = 90
RANK_TRACE = re.compile(r"rank(\d+)\.trace\.json(\.gz)?$")  # cpbench run --profile's names


@dataclass(frozen=True)
class GroupRow:
    group: str
    time_ms: float
    percent: float
    calls: int
    kernels: tuple[KernelRow, ...]  # the group's kernels, longest first

    @property
    def avg_ms(self) -> float | None:
        return self.time_ms / self.calls if self.calls else None


def kernel_table(trace: Trace, rules: Rules) -> KernelTable:
    """A trace's per-kernel totals within its steps (``breakdown.windows``). GPU kernels
    count whole, concurrent ones each (nsys's convention). CPU ops nest and gloo's spans
    overlap them, so on CPU each instant goes to one op, as the breakdown attributes it:
    the innermost op of the highest-priority part; the total is then the busy time."""
    events, kind = bd.timeline(trace, rules)
    spans = bd.windows(trace, events, kind)
    inside = [e for e in events if any(e.end > w0 and e.start < w1 for w0, w1 in spans)]
    calls = Counter(e.name for e in inside)
    if kind == bd.GPU:
        times: dict[str, float] = defaultdict(float)
        for e in inside:
            times[e.name] += sum(max(0.0, min(e.end, w1) - max(e.start, w0)) for w0, w1 in spans)
    else:
        times, _, _ = bd.attribute(
            [(e.start, e.end, e.name, (bd.priority_of(bd.part(rules.group(e.name))), -e.start))
             for e in inside], spans)
    rows = tuple(KernelRow(n, times.get(n, 0.0) / 1e3, c) for n, c in calls.items())
    steps = f"{len(spans)} step{'s' if len(spans) != 1 else ''}"
    return KernelTable(f"Chrome trace ({kind}, {steps})", rows, sum(r.time_ms for r in rows))


def group_rows(table: KernelTable, rules: Rules) -> list[GroupRow]:
    """Each top-level group present (in ``TOP_GROUPS`` order), then its subgroups, longest
    first."""
    members: dict[str, list[KernelRow]] = defaultdict(list)
    for r in table.rows:
        g = rules.group(r.name)
        members[top(g)].append(r)
        if "/" in g:
            members[g].append(r)
    total = table.total_ms or 1.0

    def row(group: str) -> GroupRow:
        kernels = sorted(members[group], key=lambda r: -r.time_ms)
        time_ms = sum(r.time_ms for r in kernels)
        return GroupRow(group, time_ms, 100 * time_ms / total, sum(r.calls for r in kernels),
                        tuple(kernels))

    out = []
    for t in TOP_GROUPS:
        if t in members:
            subs = sorted((row(g) for g in members if "/" in g and top(g) == t),
                          key=lambda r: -r.time_ms)
            out += [row(t), *subs]
    return out


def short(name: str, width: int = NAME_WIDTH) -> str:
    name = " ".join(name.removeprefix("void ").split())
    return name if len(name) <= width else name[:width - 1] + "…"


def table_lines(path: str, table: KernelTable, rows: list[GroupRow], top_n: int = 3
                ) -> list[str]:
    """The grouped table, the top kernels of each group and every unmatched kernel."""
    lines = [f"{path}: {table.source}, {len(table.rows)} distinct names, "
             f"{table.total_ms:.3f} ms of device time", *(f"  note: {n}" for n in table.notes),
             f"{'group':<32}{'time (ms)':>14}{'% of device time':>18}{'calls':>10}"
             f"{'avg (ms)':>12}"]
    for r in rows:
        label = ("  " if "/" in r.group else "") + r.group
        avg = "-" if r.avg_ms is None else f"{r.avg_ms:.3f}"
        lines.append(f"{label:<32}{r.time_ms:>14.3f}{r.percent:>18.2f}{r.calls:>10}"
                     f"{avg:>12}")
    lines.append("top kernels per group (% of device time, calls):")
    for r in rows:
        if "/" in r.group:
            continue
        shown = r.kernels if r.group == OTHER else r.kernels[:top_n]
        title = "other (no rule matched; every one listed)" if r.group == OTHER else r.group
        lines.append(f"  {title}:")
        total = table.total_ms or 1.0
        lines += [f"    {100 * k.time_ms / total:6.2f} %  {k.calls:>7}  {short(k.name)}"
                  for k in shown]
    return lines


def json_rows(path: str, rows: list[GroupRow], top_n: int = 5) -> list[dict[str, Any]]:
    """One object per group row; ``kernels``: the top ``top_n`` (every one for other)."""
    return [{"file": path, "group": r.group, "level": 2 if "/" in r.group else 1,
             "time_ms": round(r.time_ms, 6), "percent": round(r.percent, 4), "calls": r.calls,
             "avg_ms": None if r.avg_ms is None else round(r.avg_ms, 6),
             "kernels": [{"name": k.name, "time_ms": round(k.time_ms, 6), "calls": k.calls}
                         for k in (r.kernels if r.group == OTHER else r.kernels[:top_n])]}
            for r in rows]


def breakdown_lines(d: dict[str, Any]) -> list[str]:
    """A breakdown (``Breakdown.to_dict()`` or a record's ``profile``): each part as % of
    the step's wall time and of busy time, then the exposed communication."""
    lines = [f"  {'part':<34}{'% of step wall time':>21}{'% of busy time':>17}"]
    for name in bd.ordered(d["wall_pct"]):
        pct, busy = d["wall_pct"][name], d["busy_pct"].get(name)
        lines.append(f"  {name:<34}{pct:>21.2f}{'-' if busy is None else f'{busy:.2f}':>17}")
    lines.append(f"  - Exposed Communication: {d['exposed_comm_ms']:.3f} ms per step "
                 f"({d['exposed_comm_pct']:.2f} % of the step's wall time; communication "
                 f"active, no compute)")
    return lines


def detail_lines(profile: dict[str, Any]) -> list[str]:
    """The lines a run's detail block prints for a record's ``profile`` section."""
    if profile.get("error"):
        return [f"Where the time goes: not profiled ({profile['error']})"]
    traces = profile.get("traces") or []
    where = f"{os.path.dirname(traces[0])}/rank*.trace.json.gz ({len(traces)} ranks)" \
        if traces else "none"
    return [f"Where the time goes (rank {profile['rank']}, the slowest; "
            f"{profile['steps']} profiled steps of {profile['step_ms']:.3f} ms; "
            f"{profile['timeline']}):", *breakdown_lines(profile), f"  - Traces: {where}"]


def slowest_ranks(profiles: dict[str, KernelTable | Trace], rules: Rules
                  ) -> dict[str, tuple[KernelTable | Trace, str | None]]:
    """Of the rank traces of one case (``rank{r}.trace.json.gz`` of one directory, as
    ``cpbench run --profile`` writes them), the slowest rank's alone, with a line saying
    which and every rank's step: a step ends when its last rank finishes, so the slowest is
    what the step's time is (``bench.profiling`` puts the same one in the record). Any other
    input is kept, with no line."""
    cases: dict[str, dict[int, tuple[str, Trace]]] = defaultdict(dict)
    for path, prof in profiles.items():
        if isinstance(prof, Trace) and (m := RANK_TRACE.search(os.path.basename(path))):
            cases[os.path.dirname(path)][int(m.group(1))] = (path, prof)
    out: dict[str, tuple[KernelTable | Trace, str | None]] = {}
    for path, prof in profiles.items():
        ranks = cases.get(os.path.dirname(path), {})
        if len(ranks) < 2 or path not in {p for p, _ in ranks.values()}:
            out[path] = (prof, None)
            continue
        if path != next(iter(ranks.values()))[0]:
            continue  # the case is summarized once, where its first rank's trace was given
        step = {r: float(bd.breakdown(ranks[r][1], rules).to_dict()["step_ms"])
                for r in sorted(ranks)}
        rank = max(step, key=lambda r: (step[r], -r))
        each = ", ".join(f"{r}: {ms:.3f}" for r, ms in step.items())
        chosen, trace = ranks[rank]
        out[chosen] = (trace, f"rank {rank} of {len(step)}, the slowest (ms a step, by rank: "
                              f"{each}); --every-rank for each")
    return out


def summarize(path: str, profile: KernelTable | Trace, rules: Rules, note: str | None = None
              ) -> tuple[str, list[dict[str, Any]]]:
    """(the text, the JSON objects) of one input: its grouped table and, for a trace, its
    step breakdown; ``note``: which rank it is (``slowest_ranks``), said first."""
    trace = profile if isinstance(profile, Trace) else None
    table = kernel_table(profile, rules) if isinstance(profile, Trace) else profile
    rows = group_rows(table, rules)
    lines, objects = table_lines(path, table, rows), json_rows(path, rows)
    if note:
        lines[1:1] = [f"  {note}"]
    if trace is not None:
        b = bd.breakdown(trace, rules).to_dict()
        lines += [f"step breakdown ({b['steps']} steps of {b['step_ms']:.3f} ms; "
                  f"{b['timeline']}):", *breakdown_lines(b)]
        objects.append({"file": path, "breakdown": b})
    return "\n".join(lines) + "\n", objects
