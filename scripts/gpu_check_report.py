"""gpu-check's summary: FlashAttention-2's published H100 figures and the markdown page a
results folder's summary.json renders to (``scripts/gpu_check.py --report DIR`` prints it).
Standard library only."""

from __future__ import annotations

# FlashAttention-2 on one H100 80GB SXM5, head dim 128, 16-bit inputs, TFLOP/s by sequence
# length as the bars of the FlashAttention-3 paper (Shah et al., arXiv 2407.08608, sec. 4.1)
# are labelled: its benchmark holds 16K tokens (batch = 16K / seqlen) at hidden size 2048
# (16 heads of 128), FLOPs counted as flash-attention's benchmark does (causal: half of
# 4·b·s²·h·d; backward 2.5 × forward), which is cpbench.metrics' count.
FA2_H100 = {
    ("fwd", True): {512: 191, 1024: 260, 2048: 298, 4096: 319, 8192: 333, 16384: 335},
    ("fwd", False): {512: 309, 1024: 350, 2048: 362, 4096: 368, 8192: 370, 16384: 370},
    ("bwd", False): {512: 214, 1024: 260, 2048: 291, 4096: 310, 8192: 318, 16384: 322},
}
_FIG = "FA3 paper (arXiv 2407.08608) fig. 'Attention {} speed, head dim 128 (H100 80GB SXM5)'"
FA2_SOURCES = {
    ("fwd", True): _FIG.format("forward") + ", causal; bar labels as transcribed at "
    "subtext.edge.nugit.net/image/4ec6690918d4df7a49f27715412cc425602eb075dfe3f7821cddc4a74f058ca1",
    ("fwd", False): _FIG.format("forward") + ", not causal; as transcribed at "
    "subtext.edge.nugit.net/image/e27582d2db385c9bac87ebc92343d2452b7c01d5d934e596c90172b346d00d42",
    ("bwd", False): _FIG.format("backward") + ", not causal; as transcribed at "
    "subtext.edge.nugit.net/image/f60142e2221e7ea9f80b7017987fabedaaa04df4adeb1a9e7b0a3defac28a701",
}
FA2_MISSING = (
    "Not published as text, so not shown: FA2's causal backward on H100 (the FA3 paper's "
    "backward figures are not causal), FA2's forward + backward on H100 (the FA2 paper, arXiv "
    "2307.08691, fig. 7, is an image whose per-length values no text source we found gives; "
    "its text says 'up to 335 TFLOPs/s'), and any length above 16K (the published grid ends "
    "there).")


def published(phase: str, causal: bool, seqlen: int) -> float | None:
    """FA2's published H100 SXM5 rate for this phase, mask and length; None where none is."""
    return FA2_H100.get((phase, causal), {}).get(seqlen)


def _fmt(x, digits: int = 0) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _size(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_fmt(c) if not isinstance(c, str) else c for c in r)
                    + " |" for r in rows]


def _env_lines(env: dict) -> list[str]:
    if not env:
        return ["Environment: not read (the env step did not finish)."]
    keys = [("GPU", "gpu"), ("driver", "driver"), ("GPU memory (GiB)", "memory_gib"),
            ("python", "python"), ("torch", "torch"), ("CUDA", "cuda"), ("cuDNN", "cudnn"),
            ("NCCL", "nccl"), ("triton", "triton"), ("flash-attn", "flash-attn"),
            ("transformer-engine", "transformer-engine"), ("ring-flash-attn", "ring-flash-attn"),
            ("yunchang", "yunchang")]
    parts = [f"{label} {env[key]}" for label, key in keys if env.get(key) not in (None, "")]
    return ["Environment: " + ", ".join(parts) + "."]


def render(summary: dict) -> str:
    """The whole page (summary.md) of one results folder's summary.json."""
    steps = summary["steps"]
    counts: dict[str, int] = {}
    for s in steps:
        counts[s["status"]] = counts.get(s["status"], 0) + 1
    tally = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    lines = [f"# gpu-check {summary['utc']}: {summary['where']}", "",
             f"{tally}; {summary['seconds']:.0f} s of a {summary['budget_s']:.0f} s budget. "
             f"Command: `{summary['command']}`", ""]
    lines += _env_lines(summary.get("env") or {}) + [""]
    rows = [[str(i + 1), s["key"], s["status"], f"{s['seconds']:.0f}",
             "; ".join(x for x in (s.get("reason"), (s.get("findings") or {}).get("headline"))
                       if x)]
            for i, s in enumerate(steps)]
    lines += _table(["#", "step", "status", "s", "result (or why not)"], rows) + [""]
    by_key = {s["key"]: s.get("findings") or {} for s in steps}
    for key, section in (("kernels", kernels_section), ("memory", memory_section),
                         ("threads", threads_section), ("calibrate", calibrate_section)):
        if by_key.get(key):
            lines += section(by_key[key]) + [""]
    lines.append(f"Logs: {summary['logs']} (one per step); records: records.jsonl "
                 f"(`cpbench report records.jsonl`).")
    return "\n".join(lines) + "\n"


def kernels_section(f: dict) -> list[str]:
    rows = [[_size(r["seqlen"]), r["batch"], "causal" if r["causal"] else "full", r["status"],
             _fmt(r.get("fwd_tflops")), _fmt(r.get("fwd_published")), _ratio(r, "fwd"),
             _fmt(r.get("bwd_tflops")), _fmt(r.get("bwd_published")), _ratio(r, "bwd"),
             _fmt(r.get("fwd_bwd_tflops"))]
            for r in f.get("rows", [])]
    if not rows:
        return []
    head = ["S", "B", "mask", "status", "FWD TFLOP/s", "FA2 pub.", "×", "BWD TFLOP/s",
            "FA2 pub.", "×", "FWD+BWD TFLOP/s"]
    out = [f"## Kernels: {f['kernel']} on {f['device']}, H={f['heads']} D=128 bf16, beside "
           f"FlashAttention-2's published H100 SXM5 figures", ""]
    out += _table(head, rows) + [""]
    out += [f"Measured: `cpbench kernels`, median of {f['iters']} timed calls after "
            f"{f['warmup']} warm-up; B = 16K / S as the published benchmark (1 above 16K). "
            "× = measured / published." + (f" {f['device_note']}" if f.get("device_note") else ""),
            "", "Published (FA2 on H100 80GB SXM5):"]
    out += [f"- {phase} {'causal' if causal else 'full'}: {src}"
            for (phase, causal), src in FA2_SOURCES.items()]
    return out + [f"- {FA2_MISSING}"]


def _ratio(row: dict, phase: str) -> str:
    got, pub = row.get(f"{phase}_tflops"), row.get(f"{phase}_published")
    return f"{got / pub:.2f}" if got and pub else "-"


def memory_section(f: dict) -> list[str]:
    out = [f"## Memory: a 1-rank `cpbench run` of local beside its dry run ({f['case']})", ""]
    rows = [["run (measured)", _mib(f.get("run_bytes")), f.get("run_note", "")],
            ["dry run (fake tensors)", _mib(f.get("dryrun_bytes")), f.get("dryrun_note", "")]]
    out += _table(["", "peak FWD+BWD (MiB)", "note"], rows) + [""]
    if f.get("ratio") is not None:
        out += [f"Dry run / run: {f['ratio']:.3f} ({f['difference_mib']:+.1f} MiB).", ""]
    if f.get("fa2_workspace_bytes"):
        out.append(f"FA2 backward workspace by formula (dq_accum fp32 b·⌈s⌉₁₂₈·h·⌈d⌉₃₂ + "
                   f"softmax_d b·h·⌈s⌉₁₂₈): {_mib(f['fa2_workspace_bytes'])} MiB; a dry run "
                   f"short of the run by about this much does not count it.")
    return out


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2 ** 20:.1f}"


def threads_section(f: dict) -> list[str]:
    cols = f.get("columns", [])
    if not cols:
        return []
    out = [f"## Strategies under `--launcher threads` with `--check` on {f['device']}", ""]
    rows = [[name, *[cells.get(c, "-") for c in cols]] for name, cells in f["cells"].items()]
    out += _table(["strategy", *cols], rows) + [""]
    out.append("PASS / FAIL: the check against float64; other cells: the record's status and "
               "error. Times under threads are not measurements (ranks share one device).")
    return out


def calibrate_section(f: dict) -> list[str]:
    if not f.get("rows"):
        return []
    out = [f"## Calibrate: measured on this GPU beside the published preset "
           f"{f['published']}", ""]
    rows = [[r["curve"], _size(int(r["side"])), _fmt(r["measured"]), _fmt(r["published"]),
             f"{r['measured'] / r['published']:.2f}" if r["published"] else "-"]
            for r in f["rows"]]
    out += _table(["curve", "side", "measured TFLOP/s", "preset TFLOP/s", "×"], rows) + [""]
    out.append(f"The preset's curve is a CP step's kernel with its merge (fit or scaled from "
               f"published figures, see its YAML); the measured one is `cpbench calibrate` on "
               f"one GPU. Step overhead: measured {f.get('overhead_us', '-')} µs, preset "
               f"{f.get('published_overhead_us', '-')} µs.")
    return out
