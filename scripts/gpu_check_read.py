"""What gpu-check's steps found, read back from the commands' output and the records they
wrote: pytest's verdicts, the environment, the kernels' rows beside FA2's published figures,
a strategy's verdict, doctor's tally, the calibrated preset against the published one.
Standard library only."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gpu_check_report as report


def records(path: Path) -> list[dict]:
    """The JSONL records a command wrote (none if it wrote none; a torn line is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_env(ctx, results) -> dict:
    info: dict = {}
    for r in results:
        for line in r["text"].splitlines():
            if line.startswith("GPU_CHECK_ENV "):
                info.update(json.loads(line.split(" ", 1)[1]))
        if r["label"] == "driver" and r["rc"] == 0 and r["text"].strip():
            info["driver"] = r["text"].strip().splitlines()[0].split(",")[1].strip()
    where = info.get("gpu") or ("no CUDA" if not info.get("cuda") else "CUDA build, no GPU")
    info["headline"] = f"{where}; torch {info.get('torch', 'not importable')}"
    return info


def read_pytest(ctx, results) -> dict:
    """Verdicts per test (from -v lines), the failures' messages and pytest's last line (or,
    where pytest did not finish, the verdicts counted so far)."""
    text = "\n".join(r["text"] for r in results)
    verdicts = dict(re.findall(r"::(\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", text))
    failed = re.findall(r"^(?:FAILED|ERROR) \S+?::(\S+)(?: - (.*))?$", text, re.M)
    last = [ln.strip("= ") for ln in text.splitlines()
            if re.match(r"=* ?\d+ (passed|failed|skipped|error|deselected)", ln)]
    if last:
        tally = last[-1]
    else:
        counts = {v: list(verdicts.values()).count(v) for v in set(verdicts.values())}
        tally = ("pytest did not finish; so far " + ", ".join(
            f"{n} {v.lower()}" for v, n in sorted(counts.items())) if counts else
            "no pytest summary line (see the log)")
    return {"headline": tally, "verdicts": verdicts,
            "failed": {name: (msg or "")[:300] for name, msg in failed}}


def kernel_rows(recs: list[dict]) -> list[dict]:
    rows = []
    for r in recs:
        a, d = r["config"]["attention"], r.get("derived") or {}
        row = {"kernel": r["kernel"], "seqlen": a["seqlen"], "batch": a["batch"],
               "causal": a["causal"], "status": r["status"]}
        for phase in ("fwd", "bwd", "fwd_bwd"):
            row[f"{phase}_tflops"] = d.get(f"{phase}_tflops")
            row[f"{phase}_published"] = report.published(phase, a["causal"], a["seqlen"])
        rows.append(row)
    return sorted(rows, key=lambda x: (x["kernel"], not x["causal"], x["seqlen"]))


def verdict(r: dict) -> str:
    passed = (r.get("derived") or {}).get("check_passed")
    if r["status"] == "ok" and passed is not None:
        return "PASS" if passed else "FAIL"
    return r["status"] + (f": {str(r['error'])[:60]}" if r.get("error") else "")


def read_doctor(ctx, results) -> dict:
    text = "\n".join(r["text"] for r in results)
    levels = re.findall(r"^(ok|warn|error)\s", text, re.M)
    errors = [ln for ln in text.splitlines() if ln.startswith("error")]
    tally = ", ".join(f"{levels.count(x)} {x}" for x in ("ok", "warn", "error"))
    return {"headline": tally, "errors": errors}


def read_calibrate(ctx, results) -> dict:
    for r in results:
        for line in r["text"].splitlines():
            if line.startswith("GPU_CHECK_PRESETS "):
                found = json.loads(line.split(" ", 1)[1])
                fwd = [x for x in found["rows"] if x["curve"] == "fwd"]
                found["headline"] = (f"fwd at {report._size(int(fwd[-1]['side']))}: measured "
                                     f"{fwd[-1]['measured']:.0f} TFLOP/s, {found['published']} "
                                     f"{fwd[-1]['published']:.0f}" if fwd else "")
                return found
    return {"headline": "no preset to compare (see the log)"}


def read_fake_gpu(ctx, results) -> dict:
    found = read_pytest(ctx, results)
    text = "\n".join(r["text"] for r in results)
    reasons = re.findall(r"^SKIPPED \[(\d+)\] \S+: (.*)$", text, re.M)
    skipped: dict[str, int] = {}
    for n, why in reasons:
        skipped[why] = skipped.get(why, 0) + int(n)
    found["skipped"] = skipped
    return found
