"""``scripts/slurm/submit_sweep.py``: submit cpbench cases to Slurm, every case checked first.

Each ``cpbench sweep`` line the job will run on its first node (``slurm.job_sweeps``: one
case, each line of a cases file, or a YAML sweep) is checked here as ``cpbench sweep
--dry-run`` checks it, with the job's own launcher (placeholders for what only the allocation
knows). Any error (a bad flag or value, a case that cannot be planned, a cases file that is
missing or empty, a sweep config planned for another size of job) is one line on stderr, and
nothing is submitted: exit 2. ``--dry-run`` prints the ``sbatch`` line, then what each case
will run: its ``cpbench sweep`` line and every launch that starts on the nodes.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cpbench import slurm
from cpbench.cli.args import USAGE_ERROR, Parser
from cpbench.errors import UsageError

if TYPE_CHECKING:  # imported where used: the parser's modules load at run time
    from cpbench.cli.sweep import Prepared

PROG = "submit_sweep.py"


def build_parser() -> Parser:
    p = Parser(prog=PROG, description="Submit cpbench cases to Slurm through "
               "scripts/slurm/cpbench.sbatch, each case checked first (as `cpbench sweep "
               "--dry-run`). Arguments after -- go to every case (e.g. -- --out results.jsonl).")
    p.add_argument("--cases", metavar="FILE", help="one case a line: cpbench run flags")
    p.add_argument("--sweep", metavar="CONFIG.yaml",
                   help="a sweep config, run by `cpbench sweep` in one allocation")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="default: CPBENCH_GPUS_PER_NODE, else an --sbatch-option="
                        "--gpus-per-node=G, else the script's #SBATCH line")
    p.add_argument("--array", action="store_true",
                   help="one array task per case (default: all cases in one allocation)")
    p.add_argument("--max-parallel", type=int, default=None, help="array tasks at once")
    p.add_argument("--time")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--job-name", default="cpbench")
    p.add_argument("--sbatch-option", action="append", default=[], metavar="OPT",
                   help="passed to sbatch as is (repeatable), e.g. --sbatch-option=--qos=high")
    p.add_argument("--dry-run", action="store_true",
                   help="check, print the sbatch line and what each case runs; submit nothing")
    p.add_argument("args", nargs="*", help="cpbench run flags (after --)")
    return p


def job_gpus_per_node(a) -> int | None:
    """The GPUs per node the job's ranks will count, as the sbatch script reads them:
    ``--gpus-per-node`` (sent as CPBENCH_GPUS_PER_NODE), else this shell's
    CPBENCH_GPUS_PER_NODE (sbatch exports it), else the allocation's: an ``--sbatch-option``'s
    ``--gpus-per-node``, else the script's own ``#SBATCH`` line."""
    if a.gpus_per_node:
        return a.gpus_per_node
    if os.environ.get("CPBENCH_GPUS_PER_NODE"):
        return int(os.environ["CPBENCH_GPUS_PER_NODE"])
    for opt in reversed(a.sbatch_option):
        m = re.fullmatch(r"--gpus-per-node=(\S+)", opt)
        if m:
            return slurm._gpus(m.group(1))
    return slurm.script_gpus_per_node()


def check(line: list[str]) -> tuple[list[str], list[str], Prepared | None]:
    """(what ``--dry-run`` prints, every error, the prepared sweep) of one of the job's
    ``cpbench sweep`` lines, checked as ``cpbench sweep --dry-run`` checks it."""
    from cpbench.cli import build_parser as cpbench_parser
    from cpbench.cli import sweep as cli_sweep
    from cpbench.sweep import SweepError

    said = io.StringIO()
    try:
        # argparse's line (the sweep's and its --run flags' parsers), read back below
        with contextlib.redirect_stderr(said):
            args = cpbench_parser().parse_args(["sweep", "--dry-run", *line[2:]])
            prepared = cli_sweep.prepare(args)
    except SystemExit as e:
        return [], [re.sub(r"^[\w .-]+: error: ", "", m) for m in
                    said.getvalue().splitlines() if m.strip()] or [f"exit {e.code}"], None
    except SweepError as e:
        return [], list(e.errors), None
    except UsageError as e:
        return [], [" ".join(str(e).split())], None
    return cli_sweep.dry_run_lines(prepared), [], prepared


def _topology_errors(a, gpus: int | None, prepared) -> list[str]:
    """A sweep config is planned for its topology: the job must be that size."""
    nodes, per_node = prepared.config.nodes, prepared.config.gpus_per_node
    if nodes is None:
        return ["it has no topology (it plans local CPU ranks): give it topology: {nodes: "
                f"{a.nodes}, gpus_per_node: {gpus or 'G'}}} for this job"]
    if (nodes, per_node) != (a.nodes, gpus):
        return [f"its topology is {nodes} nodes x {per_node} GPUs, the job {a.nodes} nodes x "
                f"{gpus or 'unknown'} GPUs: make them agree (--nodes, --gpus-per-node)"]
    return []


def _readable(line: list[str]) -> str:
    """A ``cpbench sweep`` line with its launcher (shown in full in each launch's line below
    it) as a name: its quoting inside quotes is unreadable."""
    at = line.index("--launcher") + 1
    return shlex.join(line[:at]) + " '<srun ... torchrun ..., as each launch below>' " + \
        shlex.join(line[at + 1:])


def _plan_job(a) -> tuple[list[list[str]], list[str], list[str], int]:
    """(the job's ``cpbench sweep`` lines, the dry run's lines, every error, each with the
    case it came from, the cases checked: a YAML sweep's line holds all of its cases)."""
    cases = None
    if a.cases:
        try:
            cases = slurm.read_cases(a.cases)
        except OSError as e:
            return [], [], [f"cannot read the cases file: {e}"], 0
        if not cases:
            return [], [], [f"{a.cases} has no cases (one a line: cpbench run flags)"], 0
    gpus = job_gpus_per_node(a)
    sweep = str(Path(a.sweep).resolve()) if a.sweep else None
    lines = slurm.job_sweeps(slurm.preview_world(a.nodes, gpus), cases=cases, sweep=sweep,
                             array=a.array, args=a.args,
                             cli=os.environ.get("CPBENCH_CLI", "cpbench"),
                             entry=os.environ.get("CPBENCH_ENTRY"),
                             torchrun=os.environ.get("CPBENCH_TORCHRUN", "torchrun"))
    shown, errors, checked = [], [], 0
    for i, line in enumerate(lines):
        where = (f"case {i + 1} of {a.cases} ({' '.join(cases[i])}): " if cases else
                 f"{a.sweep}: " if a.sweep else "")
        dry, bad, prepared = check(line)
        checked += len(prepared.config.cases) if prepared is not None else 1
        if prepared is not None and a.sweep:
            bad = _topology_errors(a, gpus, prepared)
        errors += [where + e for e in bad]
        shown += [f"# {'an array task' if a.array else 'the first node'} runs: "
                  f"{_readable(line)}", *dry]
    return lines, shown, errors, checked


def main(argv: list[str] | None = None) -> int:
    """Check every case, then submit (or, with --dry-run, print) the job."""
    a = build_parser().parse_args(argv)
    try:
        cmd, env = slurm.sbatch_command(
            nodes=a.nodes, cases_file=a.cases, sweep=a.sweep, array=a.array,
            max_parallel=a.max_parallel,
            gpus_per_node=a.gpus_per_node, time=a.time, partition=a.partition,
            account=a.account, job_name=a.job_name, sbatch_options=a.sbatch_option,
            args=a.args)
    except (UsageError, OSError) as e:
        sys.stderr.write(f"{PROG}: error, nothing submitted: {e}\n")
        return USAGE_ERROR
    _, shown, errors, checked = _plan_job(a)
    if errors:
        sys.stderr.write("".join(f"{PROG}: error, nothing submitted: {e}\n" for e in errors))
        return USAGE_ERROR
    line = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd)])
    if a.dry_run:
        sys.stdout.write("".join(f"{t}\n" for t in
                                 [line, *shown, f"# {slurm.PREVIEW_NOTE}"]))
        return 0
    try:
        job = slurm.submit(cmd, env)
    except (RuntimeError, OSError) as e:
        sys.stderr.write(f"{PROG}: {e}\n")
        return 1
    sys.stdout.write(f"submitted job {job} ({checked} case(s) checked): {line}\n")
    return 0
