#!/usr/bin/env python3
"""What one GPU can show of cpbench, in 6 minutes, offline, with the machine's own torch
(`make gpu-check`; docs/gpu-check.md). Each step runs as subprocesses under its own timeout,
in priority order, and the run goes on after a failure; the results folder holds one log per
step, every record (records.jsonl) and summary.md / summary.json, rewritten after each step.
Without a GPU the CUDA steps say "skipped: no CUDA" and the rest run; with only a CUDA build
of torch (the fake-GPU venv) its fake-CUDA steps run too.

    python3 scripts/gpu_check.py --compact --out DIR  # a lent GPU machine: DIR is $OUT
    python3 scripts/gpu_check.py [--out DIR] [--budget S] [--steps a,b | --only STEP]
    python3 scripts/gpu_check.py --report DIR         # print a results folder's summary

Standard library only (any Python >= 3.10): cpbench and torch run in the subprocesses, with
this checkout's src/ first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_report as report  # noqa: E402
import gpu_check_runner as runner  # noqa: E402
import gpu_check_steps as steps  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# A lent GPU machine gives 15 minutes in all, 10 a command, and its own start takes a few:
# a whole run (6 minutes) and the start fit in 10, and the 5 left hold a fresh start and one
# step again (--only, 3 minutes). The steps' caps on a GPU add up to the whole run's budget.
DEFAULT_BUDGET_S = 360
ONLY_BUDGET_S = 180
MIN_STEP_S = 15  # a step is not started with less left than this


class Context:
    """What the steps see: the interpreter, the folders, and the device mode ("gpu": a CUDA
    GPU; "fake": a CUDA build of torch without one; "none": neither)."""

    def __init__(self, python: str, out: Path):
        self.python, self.out, self.root = python, out, ROOT
        self.logs = out / "logs"
        self.only = False  # --only: one step, under the run's budget alone
        self.mode, self.env = "none", {}
        self.why_not = "no CUDA: the environment step has not run"

    def adopt(self, env: dict) -> None:
        self.env = env
        torch = env.get("torch")
        if env.get("cuda_available"):
            self.mode, self.why_not = "gpu", ""
        elif torch is None:
            self.why_not = f"no CUDA: torch does not import ({env.get('torch_error', '?')})"
        elif env.get("cuda"):
            self.mode = "fake"
            self.why_not = (f"no CUDA GPU: torch {torch} is a CUDA build but sees no GPU "
                            f"(fake CUDA tensors only)")
        else:
            self.why_not = f"no CUDA: torch {torch} is a build without CUDA"

    def number(self, key: str) -> int:
        """The step's place in the run (1-based): its log's and its records' prefix, so the
        records merge in step order."""
        return [s.key for s in steps.STEPS].index(key) + 1

    def has(self, program: str) -> bool:
        return shutil.which(program) is not None

    def cpbench(self, *args: str) -> list[str]:
        return [self.python, "-m", "cpbench.cli", *args]

    def torchrun(self, *args: str) -> list[str]:
        return [self.python, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "1", *args]

    def pytest(self, *args: str) -> list[str]:
        return [self.python, "-m", "pytest", "-p", "no:cacheprovider", *args]

    def preset(self) -> str:
        """The published simulator preset nearest this GPU."""
        gpu = self.env.get("gpu") or ""
        return "h200-sxm" if "H200" in gpu else "a800-sxm" if "A800" in gpu else "h100-sxm"


def write_summary(out: Path, summary: dict) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(report.render(summary))


OWN_FILES = ("summary.json", "summary.md", "records.jsonl", "logs.tar.gz", "calibrated.yaml")


def clear_results(out: Path) -> None:
    """A results folder holds one run: an earlier gpu-check run's files there are removed
    first (cpbench appends to its JSONL files); nothing else is touched, and a logs/ folder
    that is not a gpu-check run's is refused (OSError)."""
    logs = out / "logs"
    if not (out / "summary.json").exists():
        if logs.exists() and any(logs.iterdir()):
            raise OSError(f"{logs} exists and is not a gpu-check run's: give another --out")
        return
    if logs.is_dir():
        shutil.rmtree(logs)
    for name in OWN_FILES:
        (out / name).unlink(missing_ok=True)


def merge_records(out: Path) -> int:
    """Every step's JSONL records, in step order, as one records.jsonl."""
    n = 0
    with open(out / "records.jsonl", "w") as merged:
        for part in sorted((out / "logs").glob("*.jsonl")):
            for line in part.read_text().splitlines():
                if line.strip():
                    merged.write(line + "\n")
                    n += 1
    return n


def pack_logs(out: Path) -> None:
    """--compact: logs/ becomes logs.tar.gz (a results folder of at most 5 files)."""
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(out / "logs", arcname="logs")
    shutil.rmtree(out / "logs")


def compare_presets(measured: str, published: str) -> int:
    """--compare-presets: the measured preset's kernel curves beside the published preset's at
    the measured sides (run as a step's subprocess, with cpbench importable)."""
    from cpbench.sim import hardware

    got, pub = hardware.load(measured), hardware.load(published)
    rows = []
    for curve, phase, causal in (("fwd", "fwd", False), ("bwd", "bwd", False),
                                 ("fwd causal", "fwd", True), ("bwd causal", "bwd", True)):
        mine = got.kernel(phase, causal)
        if causal and mine is got.kernel(phase, False):
            continue  # no causal curve measured
        theirs = pub.kernel(phase, causal)
        if causal and theirs is pub.kernel(phase, False):
            theirs = None  # the preset has no causal curve: no number beside this one
        for side, tflops in mine.points:
            rows.append({"curve": curve, "side": side, "measured": tflops,
                         "published": theirs.tflops(side) if theirs else None})
    found = {"published": published, "rows": rows,
             "overhead_us": round(got.step_overhead_us, 1),
             "published_overhead_us": pub.step_overhead_us,
             "memory_gib": got.memory_gib, "published_memory_gib": pub.memory_gib}
    for r in rows:
        theirs = "-" if r["published"] is None else f"{r['published']:.1f}"
        print(f"{r['curve']:>10} {int(r['side']):>6}: measured {r['measured']:8.1f}  "
              f"{published} {theirs:>8} TFLOP/s")
    print("GPU_CHECK_PRESETS " + json.dumps(found))
    return 0


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--out", metavar="DIR", help="results folder (default runs/gpu-check-<utc>)")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter whose torch the steps use (default this one)")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help=f"the whole run's time; steps left are 'skipped: out of time' "
                        f"(default {DEFAULT_BUDGET_S}, with --only {ONLY_BUDGET_S})")
    keys = ", ".join(s.key for s in steps.STEPS)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--steps", metavar="KEY[,KEY...]",
                       help=f"run only these, each under its cap (env always runs): {keys}")
    which.add_argument("--only", metavar="STEP",
                       help="rerun one step alone (after env), under the whole budget rather "
                            "than its cap and its commands' limits")
    p.add_argument("--compact", action="store_true",
                   help="pack the logs into logs.tar.gz: at most 5 files, none deeper than DIR")
    p.add_argument("--report", metavar="DIR", help="print DIR's summary and exit")
    p.add_argument("--compare-presets", nargs=2, metavar=("MEASURED", "PUBLISHED"),
                   help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _usage(message: str) -> int:
    print(f"gpu_check.py: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.compare_presets:
        return compare_presets(*args.compare_presets)
    if args.report:
        path = Path(args.report) / "summary.json"
        if not path.exists():
            return _usage(f"{path} does not exist: give a gpu-check results folder")
        sys.stdout.write(report.render(json.loads(path.read_text())))
        return 0
    keys = [s.key for s in steps.STEPS]
    chosen = ({args.only.strip()} if args.only else set(keys) if not args.steps
              else {k.strip() for k in args.steps.split(",")})
    if chosen - set(keys):
        return _usage(f"unknown step {sorted(chosen - set(keys))[0]!r}; choose from "
                      f"{', '.join(keys)}")
    if args.budget is None:
        args.budget = ONLY_BUDGET_S if args.only else DEFAULT_BUDGET_S
    if not args.budget > 0:
        return _usage(f"--budget must be a positive number of seconds, got {args.budget}")
    utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    # absolute: the steps' commands run in the checkout, and a relative DIR there would be
    # another folder than this process's (their records would land outside the results)
    out = Path(args.out or ROOT / "runs" / f"gpu-check-{utc.replace(':', '')}").absolute()
    try:
        clear_results(out)
        (out / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return _usage(f"cannot use {out}: {e}")
    ctx = Context(args.python, out)
    ctx.only = bool(args.only)
    return run_all(ctx, chosen | {"env"}, args, utc)


def _say(line: str) -> None:
    print(line, flush=True)


def run_all(ctx: Context, chosen: set[str], args, utc: str) -> int:
    """Every step in order; SIGTERM (a command limit above this run's) ends it as Ctrl-C does,
    with what was measured written."""
    summary = {"utc": utc, "where": "?", "command": shlex.join(["python3", *sys.argv]),
               "budget_s": args.budget, "seconds": 0.0, "logs": "logs/", "env": {},
               "steps": [{"key": s.key, "title": s.title, "status": "not run", "seconds": 0.0,
                          "reason": "the run ended before this step"} for s in steps.STEPS]}
    _say(f"gpu-check: {len(steps.STEPS)} steps, budget {args.budget:.0f} s, results in {ctx.out}")
    before = signal.signal(signal.SIGTERM, runner.interrupt)
    try:
        rc = _run_steps(ctx, chosen, args.budget, summary)
    finally:
        signal.signal(signal.SIGTERM, before)
    _finish(ctx, summary, args.compact)
    bad = [s for s in summary["steps"] if s["status"] in ("failed", "timeout")]
    return rc if rc else 1 if bad else 0


def _run_steps(ctx: Context, chosen: set[str], budget: float, summary: dict) -> int:
    t0 = time.monotonic()
    i = 0
    try:
        for i, step in enumerate(steps.STEPS):
            summary["steps"][i] = _one(step, i, ctx, chosen, t0 + budget)
            if step.key == "env":
                ctx.adopt(summary["steps"][i].get("findings") or {})
                summary["env"] = ctx.env
                summary["where"] = ctx.env.get("gpu") or ctx.why_not
            summary["seconds"] = round(time.monotonic() - t0, 1)
            write_summary(ctx.out, summary)
    except KeyboardInterrupt:
        _say("gpu-check: interrupted; writing what was measured")
        summary["steps"][i].update(status="interrupted", reason="the run was stopped")
        summary["seconds"] = round(time.monotonic() - t0, 1)
        return 130
    return 0


def _one(step: steps.Step, i: int, ctx: Context, chosen: set[str], deadline: float) -> dict:
    n = len(steps.STEPS)
    base = {"key": step.key, "title": step.title, "seconds": 0.0, "log": "", "findings": {}}
    if step.key not in chosen:
        flag = "--only" if ctx.only else "--steps"
        result = {**base, "status": "skipped", "reason": f"not chosen ({flag})"}
    elif deadline - time.monotonic() < MIN_STEP_S:
        result = {**base, "status": "skipped", "reason": "out of time"}
    else:
        _say(f"[{i + 1}/{n}] {step.title}")
        result = runner.run_step(step, i + 1, ctx, deadline, _say)
    why = f": {result['reason']}" if result.get("reason") else ""
    head = (result.get("findings") or {}).get("headline")
    _say(f"[{i + 1}/{n}] {step.key}: {result['status']}{why} ({result['seconds']:.0f} s)"
         + (f"; {head}" if head else ""))
    return result


def _finish(ctx: Context, summary: dict, compact: bool) -> None:
    n = merge_records(ctx.out)
    if compact:
        pack_logs(ctx.out)
        summary["logs"] = "logs.tar.gz"
    write_summary(ctx.out, summary)
    _say("")
    sys.stdout.write(report.render(summary))
    _say(f"\n{n} records in {ctx.out / 'records.jsonl'}; summary: {ctx.out / 'summary.md'}")


if __name__ == "__main__":
    sys.exit(main())
