"""Which records of run A and run B are the same case, and what else changed between the runs.

A case is (strategy, options as the strategy resolved them, attention problem, topology,
kernel that ran): what the timing depends on, not how the run was launched (iterations,
warm-up, seed, output file), so a run of 20 iterations matches one of 50, and USP's automatic
degree matches the degree another run asked for by name. A file holding a case more than once
(a re-run, a resumed sweep) counts its last record, with the samples of every record of it
from the same run (the baseline a run times at both ends).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from cpbench.report.labels import head_dim_text, row_label
from cpbench.report.sweep import size_text

# what else can change between two runs, as `cpbench run` captures it in each record's env
ENV_FIELDS = (("cpbench", "cpbench"), ("git_sha", "git sha"), ("git_dirty", "git dirty"),
              ("torch", "torch"), ("cuda", "CUDA"), ("nccl", "NCCL"),
              ("flash_attn", "flash-attn"), ("python", "python"), ("device_name", "device"),
              ("threads_per_rank", "threads per rank"), ("launcher", "launcher"))


@dataclass(frozen=True)
class Case:
    """One case of both runs: its key, a readable label, and each run's last record."""
    key: str
    label: str
    a: dict
    b: dict


def case_key(record: dict) -> str:
    """The case a record measured, as canonical JSON (see the module docstring)."""
    cfg, topo = record["config"], record["topology"]
    resolved = {**cfg["options"], **(record.get("resolved") or {})}
    return json.dumps({"strategy": cfg["strategy"], "options": resolved,
                       "attention": cfg["attention"], "world_size": topo["world_size"],
                       "ranks_per_node": topo["ranks_per_node"], "kernel": record["kernel"]},
                      sort_keys=True)


def latest(records: list[dict]) -> dict[str, dict]:
    """Each case's last record, in first-seen order of the cases; where its run timed the case
    more than once (the baseline at both ends), with the samples of every such record."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(case_key(r), []).append(r)
    return {k: _pooled(rs) for k, rs in groups.items()}


def _pooled(records: list[dict]) -> dict:
    """The last record, its samples joined per rank with those of the same run's other
    records of the case (a run is its records' start time, ``env.utc``)."""
    last = records[-1]
    run = (last.get("env") or {}).get("utc")
    same = [r for r in records if (r.get("env") or {}).get("utc") == run and r.get("samples_ms")]
    if len(same) < 2 or not last.get("samples_ms"):
        return last
    merged = {}
    for phase, by_rank in last["samples_ms"].items():
        parts = [r["samples_ms"].get(phase) for r in same]
        if any(not p or len(p) != len(by_rank) for p in parts):
            return last  # not the same shape of run: the last record alone
        merged[phase] = [[t for p in parts for t in p[rank]] for rank in range(len(by_rank))]
    return {**last, "samples_ms": merged}


# (field, text) of the problem and topology: a label shows those that differ between cases
def _facets(r: dict) -> list[tuple[str, str]]:
    a, topo = r["config"]["attention"], r["topology"]
    kv = a.get("kv_heads") or a["heads"]
    return [("seqlen", f"S={size_text(a['seqlen'])}"), ("dtype", a["dtype"]),
            ("causal", "causal" if a["causal"] else "full"), ("batch", f"B={a['batch']}"),
            ("heads", f"H={a['heads']}" + (f"/{kv}" if kv != a["heads"] else "")),
            ("head_dim", f"D={head_dim_text(a)}"),
            ("topology", f"{topo['world_size'] // topo['ranks_per_node']}×"
                         f"{topo['ranks_per_node']}"),
            ("kernel", r["kernel"])]


def labels(records: list[dict]) -> list[str]:
    """A short distinct label per record: ``strategy (options)`` and, in brackets, the facets
    of the problem that vary among the records (always the sequence length)."""
    facets = [_facets(r) for r in records]
    names = [name for name, _ in facets[0]] if facets else []
    varying = {"seqlen"} | {name for i, name in enumerate(names)
                            if len({f[i][1] for f in facets}) > 1}
    out: list[str] = []
    seen: dict[str, int] = {}
    for r, f in zip(records, facets):
        text = f"{row_label(r)} [{' '.join(t for n, t in f if n in varying)}]"
        seen[text] = seen.get(text, 0) + 1
        out.append(text if seen[text] == 1 else f"{text} #{seen[text]}")
    return out


def match(a_records: list[dict], b_records: list[dict]) -> tuple[list[Case], list[str],
                                                                   list[str]]:
    """(cases in both runs, labels of those only in A, labels of those only in B)."""
    a, b = latest(a_records), latest(b_records)
    keys = [k for k in a if k in b]
    only_a, only_b = [k for k in a if k not in b], [k for k in b if k not in a]
    every = [a[k] for k in keys] + [a[k] for k in only_a] + [b[k] for k in only_b]
    text = labels(every)
    cases = [Case(k, text[i], a[k], b[k]) for i, k in enumerate(keys)]
    return cases, text[len(keys):len(keys) + len(only_a)], text[len(keys) + len(only_a):]


def _values(records: list[dict], field: str) -> list[str]:
    found = {str((r.get("env") or {}).get(field)) for r in records}
    return sorted(found)


def _hosts(records: list[dict]) -> list[str]:
    hosts = {h for r in records for h in (r.get("env") or {}).get("hostnames") or ()}
    return sorted(hosts) or ["None"]


def _topologies(records: list[dict]) -> list[str]:
    return sorted({f"{r['topology']['num_nodes']}×{r['topology']['ranks_per_node']}"
                   for r in records})


def _loads(records: list[dict]) -> list[str]:
    """The load each record timed under: the cores others kept busy (its ``load`` section,
    the load meter's reading on rank 0's host), as their range over the records."""
    read = [(r["load"]["foreign_cpu_s"] / r["load"]["wall_s"], r["load"]["cpus"])
            for r in records if (r.get("load") or {}).get("wall_s")]
    if not read:
        return ["not metered"]
    low, high = (f"{f(c for c, _ in read):.1f}" for f in (min, max))
    cpus = "/".join(map(str, sorted({n for _, n in read})))
    return [f"others kept {low if low == high else f'{low}-{high}'} of {cpus} cores busy"]


def environment(a_records: list[dict], b_records: list[dict]) -> list[tuple[str, str, str]]:
    """(what, A's value(s), B's value(s)) for every environment field of the records, and
    hosts, topologies and the load each ran under; each side's distinct values joined by
    ", "."""
    rows = [(name, _values(a_records, field), _values(b_records, field))
            for field, name in ENV_FIELDS]
    rows += [("hosts", _hosts(a_records), _hosts(b_records)),
             ("topology", _topologies(a_records), _topologies(b_records)),
             ("load", _loads(a_records), _loads(b_records))]
    return [(name, ", ".join(a), ", ".join(b)) for name, a, b in rows]
