"""``cpbench report --compare upstream``: each of cpbench's strategies beside its upstream twin
on the same problem and topology (zigzag / rfa-zigzag, ring / rfa-ring, usp / yunchang-usp
with the same mesh and placement, megatron-cp / te-p2p, megatron-cp-a2a+p2p / te-a2a+p2p,
ulysses / te-a2a, zigzag / torch-ring), with the time ratio.

An adapter's record names its twin and the twin's resolved options that make the rows the
same problem (``upstream.twin`` / ``twin_options``), so this view needs no registry.
"""

from __future__ import annotations

from cpbench.metrics import slowest_per_iter
from cpbench.report import cells, tables
from cpbench.report.dataframe import PROBLEM
from cpbench.report.labels import rank_unit, ranks_text, row_label
from cpbench.report.render import Fit
from cpbench.report.sweep import latest_frame, ratio_cell
from cpbench.results import OK, derive

_SAME = [c for c in PROBLEM if c != "kernel"] + ["fwd_only"]  # kernels: sdpa-cpu vs flash-attn-cpu


def _matches(own: dict, wanted: dict) -> bool:
    """Whether ``own`` (a record) is the row an adapter's ``twin_options`` asks for."""
    resolved = {**own["config"]["options"], **(own.get("resolved") or {})}
    return all(resolved.get(k) == v for k, v in wanted.items())


def pairs(records: list[dict]) -> list[tuple[dict, dict]]:
    """(cpbench's row, the upstream row) for every adapter row that has a twin row."""
    df = latest_frame(records)
    if df.empty:
        return []
    latest = [records[i] for i in df.index]
    key = {id(r): tuple(row) for r, row in zip(latest, df[_SAME].itertuples(index=False))}
    out = []
    for up in latest:
        twin = (up.get("upstream") or {}).get("twin")
        if not twin:
            continue
        for own in latest:
            if (own["config"]["strategy"] == twin and key[id(own)] == key[id(up)]
                    and _matches(own, up["upstream"].get("twin_options") or {})):
                out.append((own, up))
    return out


def _ms(record: dict, phase: str) -> float | None:
    return record["derived"].get(phase) if record["status"] == OK else None


def _row(own: dict, up: dict, phase: str) -> dict:
    a, b = _ms(own, phase), _ms(up, phase)
    key = phase.removesuffix("_ms")
    def side(r: dict) -> dict:  # its flags: a withheld row gives no ratio (ratio_cell)
        d = derive(r)
        return {"status": OK, "flags": "; ".join(d["flags"]),
                "not_measured": d["not_measured"], f"iters_{key}": _iterations(r, key)}

    ratio = ratio_cell(side(up), side(own), key) if a and b else "-"
    return {"Seq Len": str(own["config"]["attention"]["seqlen"]),
            "cpbench": row_label(own), f"{_TITLE[phase]} (ms)": cells.cell_ms(a, own),
            "upstream": row_label(up), f"upstream {_TITLE[phase]} (ms)": cells.cell_ms(b, up),
            "upstream / cpbench": ratio}


def _iterations(record: dict, phase: str) -> list[float] | None:
    samples = (record.get("samples_ms") or {}).get(phase)
    return slowest_per_iter(samples) if samples else None


_TITLE = {"fwd_bwd_ms": "FWD+BWD", "fwd_ms": "FWD"}
_FIT = Fit(lift=("Seq Len",), wrap=("cpbench", "upstream"),
           short={f"{t} (ms)": "cpbench (ms)" for t in _TITLE.values()}
           | {f"upstream {t} (ms)": "upstream (ms)" for t in _TITLE.values()})


def _phase(record: dict) -> str:
    return "fwd_ms" if record["config"]["run"]["fwd_only"] else "fwd_bwd_ms"


def compare_upstream(records: list[dict], fmt: str = "table") -> str:
    """A table per topology and problem: each pair's times and their ratio (> 1: upstream is
    slower than cpbench's own), with its bootstrap 95 % interval."""
    found = pairs(records)
    if not found:
        return ("no strategy ran beside its upstream twin on the same problem and topology "
                "(e.g. --strategy zigzag,rfa-zigzag)\n")
    groups: dict[str, list] = {}
    for own, up in found:
        a, topo = own["config"]["attention"], own["topology"]
        title = (f"cpbench vs upstream ({_TITLE[_phase(own)]}) on {topo['num_nodes']}×"
                 f"{topo['ranks_per_node']} {ranks_text(rank_unit([own, up]))} "
                 f"({a['dtype']}, B={a['batch']}, H={a['heads']}, D={a['head_dim']}, "
                 f"{'causal' if a['causal'] else 'full'})")
        groups.setdefault(title, []).append((own, up))
    lines: list[str] = []
    for title, rows in groups.items():
        phase = _phase(rows[0][0])
        rows.sort(key=lambda p: (p[0]["config"]["attention"]["seqlen"], row_label(p[0])))
        if lines:
            lines.append("")
        lines += tables.render(title, [_row(own, up, phase) for own, up in rows], fmt, _FIT)
    return "\n".join(lines) + "\n"
