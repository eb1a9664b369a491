"""Slurm: the command lines ``scripts/slurm/cpbench.sbatch`` runs, the ``SLURM_*``
environment read as a torchrun world, and the ``sbatch`` lines that submit a sweep.

The sbatch script is plain bash (it must run before any Python environment is known); the
functions here build the same lines, so a test can hold the script to them, and
``submit_sweep`` (``scripts/slurm/submit_sweep.py``) uses them to submit cases. Every path of
the script runs ``cpbench sweep`` on the first node with ``--launcher`` set to the srun +
torchrun prefix (``sweep_launcher``), so each strategy is its own launch (on NCCL a rank
failing inside a strategy's communication ends its launch, not the job) and the sweep records
a case its launch left unwritten from what its failing rank left:

- one case: ``cpbench sweep --run FLAGS`` (``run_command``), one launch per strategy;
- a cases file as a job array (one array task per case, each its own allocation) or in one
  allocation (the cases in turn): each line as one case;
- a YAML sweep in one allocation: ``cpbench sweep CONFIG``.

Cases are lines of ``cpbench run`` flags, whitespace-separated. ``job_sweeps`` lists the
``cpbench sweep`` lines a job will run, from a ``preview_world`` (placeholders for what only the
allocation knows): ``scripts/slurm/submit_sweep.py`` (``cli.submit_sweep``) checks each of them
as ``cpbench sweep --dry-run`` before it calls ``sbatch``.
Nothing here has been run on a real Slurm cluster (see docs/gpus-and-slurm.md, "Slurm").
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

from cpbench.errors import UsageError

# shipped with the package (scripts/slurm/cpbench.sbatch in a checkout links here)
SBATCH_SCRIPT = Path(__file__).resolve().parent / "cpbench.sbatch"
DEFAULT_PORT = 29500
# torchrun's --nproc-per-node value that counts the node's GPUs itself
DETECT_GPUS = "gpu"
# what cpbench sweep replaces in a --launcher per case (sweep_launcher)
CASE_FIELD, PORT_FIELD = "{case}", "{port}"
# what a preview (preview_world) shows for what only the allocation knows
PREVIEW_JOB_ID, PREVIEW_HEAD_NODE, PREVIEW_CPUS = ("$SLURM_JOB_ID", "$HEAD_NODE",
                                                    "$SLURM_CPUS_ON_NODE")
PREVIEW_NOTE = (f"filled in by the job: {PREVIEW_JOB_ID}, {PREVIEW_HEAD_NODE} (its first "
                f"node), {PREVIEW_CPUS}, {PORT_FIELD} (a free port per launch)")


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compact host list, expanded like ``scontrol show hostnames``:
    ``g[045-046,072],h1`` → ``g045 g046 g072 h1`` (zero padding kept, several bracket
    groups in one name multiply out)."""
    hosts: list[str] = []
    for name in _split_top(nodelist):
        hosts += _expand_name(name)
    return hosts


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_name(name: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", name)
    if not m:
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    out = []
    for item in m.group(1).split(","):
        lo, _, hi = item.partition("-")
        if not hi:
            values = [lo]
        else:
            width = len(lo)
            values = [str(v).zfill(width) for v in range(int(lo), int(hi) + 1)]
        for v in values:
            out += _expand_name(head + v + tail)
    return out


def _gpus(value: str) -> int:
    """``8``, ``h100:8``, ``gpu:h100:8`` or ``gpu:h100:8(S:0-1)`` → 8 (SLURM_GPUS_PER_NODE's
    forms)."""
    return int(value.split("(")[0].split(":")[-1])


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlurmWorld:
    """Where this task sits in a Slurm job, as torchrun needs it (one task per node)."""

    job_id: str
    num_nodes: int
    node_rank: int
    gpus_per_node: int | None  # None: torchrun counts the node's GPUs (DETECT_GPUS)
    master_addr: str  # the first node: the c10d rendezvous host
    array_task_id: int | None = None
    # SLURM_CPUS_ON_NODE: every step gets them all (a preview: its placeholder)
    cpus_per_node: int | str | None = None

    @property
    def world_size(self) -> int | None:
        return None if self.gpus_per_node is None else self.num_nodes * self.gpus_per_node

    @property
    def cpu_binding(self) -> str:
        """Each srun step's CPU option: the node's cores for the one task (srun >= 22.05 no
        longer inherits --cpus-per-task from sbatch: the step would get one core), or no
        binding where Slurm did not say how many there are."""
        return f"--cpus-per-task={self.cpus_per_node}" if self.cpus_per_node else \
            "--cpu-bind=none"


def slurm_world(environ: Mapping[str, str] | None = None) -> SlurmWorld:
    """Read ``SLURM_*``: job id, nodes, this node's rank, GPUs per node, the first host, the
    node's cores. GPUs per node: ``CPBENCH_GPUS_PER_NODE``, else ``SLURM_GPUS_ON_NODE``, else
    ``SLURM_GPUS_PER_NODE``, else None (torchrun counts them) — the same variables in the
    same order as the sbatch script."""
    env = os.environ if environ is None else environ
    missing = [v for v in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST") if v not in env]
    if missing:
        raise UsageError(f"{', '.join(missing)} not set: not inside a Slurm job; submit with "
                         f"sbatch (or srun) first")
    hosts = expand_nodelist(env["SLURM_JOB_NODELIST"])
    num_nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or len(hosts))
    gpus = env.get("CPBENCH_GPUS_PER_NODE") or env.get("SLURM_GPUS_ON_NODE")
    gpus_per_node = (int(gpus) if gpus else _gpus(env["SLURM_GPUS_PER_NODE"])
                     if env.get("SLURM_GPUS_PER_NODE") else None)
    cpus = env.get("SLURM_CPUS_ON_NODE")
    node_rank = int(env.get("SLURM_NODEID") or env.get("SLURM_PROCID") or 0)
    array = env.get("SLURM_ARRAY_TASK_ID")
    return SlurmWorld(job_id=env["SLURM_JOB_ID"], num_nodes=num_nodes, node_rank=node_rank,
                      gpus_per_node=gpus_per_node, master_addr=hosts[0],
                      array_task_id=int(array) if array else None,
                      cpus_per_node=int(cpus) if cpus else None)


def preview_world(nodes: int, gpus_per_node: int | None) -> SlurmWorld:
    """A job of ``nodes`` nodes before it exists: its id, first node and cores as the
    placeholders a preview prints (``PREVIEW_NOTE`` says so)."""
    return SlurmWorld(job_id=PREVIEW_JOB_ID, num_nodes=nodes, node_rank=0,
                      gpus_per_node=gpus_per_node, master_addr=PREVIEW_HEAD_NODE,
                      cpus_per_node=PREVIEW_CPUS)


def script_gpus_per_node(script: str | os.PathLike = SBATCH_SCRIPT) -> int | None:
    """The GPUs per node the sbatch script asks for itself (its ``#SBATCH --gpus-per-node``
    line): what a job gets unless sbatch is told otherwise."""
    m = re.search(r"^#SBATCH\s+--gpus-per-node[=\s](\S+)", Path(script).read_text(), re.M)
    return _gpus(m.group(1)) if m else None


def torchrun_command(world: SlurmWorld, args: Sequence[str] = (), *, rdzv_id: str | None = None,
                     port: int | str = DEFAULT_PORT, torchrun: str = "torchrun",
                     entry: Sequence[str] = ("-m", "cpbench.run")) -> list[str]:
    """One node's torchrun: c10d rendezvous on the first node, the job id as rendezvous id."""
    nproc = world.gpus_per_node or DETECT_GPUS
    return [torchrun, f"--nnodes={world.num_nodes}", f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={world.master_addr}:{port}",
            f"--rdzv-id={rdzv_id or world.job_id}", *entry, *args]


def srun_command(world: SlurmWorld, args: Sequence[str] = (), **torchrun_kw) -> list[str]:
    """The job step the sbatch script runs: one task per node with all its cores, each a
    torchrun; one failed node ends the step."""
    return ["srun", f"--nodes={world.num_nodes}", "--ntasks-per-node=1", world.cpu_binding,
            "--kill-on-bad-exit=1", *torchrun_command(world, args, **torchrun_kw)]


def sweep_launcher(world: SlurmWorld, rdzv_prefix: str | None = None, **torchrun_kw) -> str:
    """``cpbench sweep --launcher``'s value inside an allocation: the srun + torchrun prefix
    each launch's ``-m cpbench.run`` follows (what the sbatch script passes). Its rendezvous
    id (``rdzv_prefix``, default the job id, then ``-{case}``) and port hold ``{case}`` and
    ``{port}``, which the sweep replaces per launch: a stopped launch's agent may still hold
    the last ones."""
    torchrun_kw = {"rdzv_id": f"{rdzv_prefix or world.job_id}-{CASE_FIELD}",
                   "port": PORT_FIELD, **torchrun_kw}
    return shlex.join(srun_command(world, entry=(), **torchrun_kw))


def _sweep_prefix(world: SlurmWorld, rdzv_prefix: str | None, cli: str, entry: str | None,
                  **torchrun_kw) -> list[str]:
    """``cpbench sweep --launcher <srun torchrun> [--entry SCRIPT]``: the script's ``sweep``."""
    launcher = sweep_launcher(world, rdzv_prefix, **torchrun_kw)
    return [cli, "sweep", "--launcher", launcher, *(["--entry", entry] if entry else [])]


def run_command(world: SlurmWorld, args: Sequence[str] = (), *, rdzv_prefix: str | None = None,
                cli: str = "cpbench", entry: str | None = None, **torchrun_kw) -> list[str]:
    """What the sbatch script runs for one case (``cpbench run`` flags ``args``): ``cpbench
    sweep --run``, one launch per strategy through ``sweep_launcher``."""
    topology = ["--nodes", str(world.num_nodes)]
    if world.gpus_per_node:
        topology += ["--gpus-per-node", str(world.gpus_per_node)]
    return [*_sweep_prefix(world, rdzv_prefix, cli, entry, **torchrun_kw), *topology, "--run",
            *args]


def job_sweeps(world: SlurmWorld, *, cases: Sequence[Sequence[str]] | None = None,
               sweep: str | None = None, array: bool = False, args: Sequence[str] = (),
               cli: str = "cpbench", entry: str | None = None, **torchrun_kw
               ) -> list[list[str]]:
    """Every ``cpbench sweep`` line the sbatch script runs on the first node, in its order:
    a YAML ``sweep``'s one; each of ``cases`` (an array task runs one of them, rendezvous ids
    from its job id; one allocation runs them in turn, ``<job>-<i>``); else one case
    (``args`` alone). ``args`` follow each case, or go to ``cpbench sweep CONFIG``."""
    if sweep:
        return [[*_sweep_prefix(world, None, cli, entry, **torchrun_kw), sweep, *args]]
    if cases is None:
        return [run_command(world, args, cli=cli, entry=entry, **torchrun_kw)]
    return [run_command(world, [*case, *args], cli=cli, entry=entry,
                        rdzv_prefix=None if array else f"{world.job_id}-{i}", **torchrun_kw)
            for i, case in enumerate(cases)]


def read_cases(path: str | os.PathLike) -> list[list[str]]:
    """A cases file as the sbatch script reads it: one case a line, whitespace-separated
    flags (no quoting), ``#`` comments and blank lines skipped."""
    cases = []
    for line in Path(path).read_text().splitlines():
        args = line.split("#", 1)[0].split()
        if args:
            cases.append(args)
    return cases


def sbatch_command(*, nodes: int, cases_file: str | None = None, sweep: str | None = None,
                   num_cases: int | None = None,
                   array: bool = False, max_parallel: int | None = None,
                   gpus_per_node: int | None = None, time: str | None = None,
                   partition: str | None = None, account: str | None = None,
                   job_name: str = "cpbench", sbatch_options: Sequence[str] = (),
                   args: Sequence[str] = (), script: str | os.PathLike = SBATCH_SCRIPT
                   ) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment additions)`` submitting one case (``args``), or a cases file as a
    job array (``array``, one task per case, at most ``max_parallel`` at once) or as one
    allocation, or a YAML sweep (``sweep``: ``cpbench sweep`` in one allocation). ``args`` go
    after the script: to the one case, appended to every case, or to ``cpbench sweep``."""
    if nodes < 1:
        raise UsageError(f"--nodes must be 1 or more, got {nodes}")
    if array and not cases_file:
        raise UsageError("a job array needs a cases file (--cases)")
    if sweep and cases_file:
        raise UsageError("give a cases file (--cases) or a sweep config (--sweep), not both")
    argv = ["sbatch", f"--job-name={job_name}", f"--nodes={nodes}", "--ntasks-per-node=1"]
    env = {}
    if gpus_per_node:
        argv.append(f"--gpus-per-node={gpus_per_node}")
        env["CPBENCH_GPUS_PER_NODE"] = str(gpus_per_node)
    for flag, value in (("time", time), ("partition", partition), ("account", account)):
        if value:
            argv.append(f"--{flag}={value}")
    if sweep:
        env["CPBENCH_SWEEP"] = str(Path(sweep).resolve())
    if cases_file:
        env["CPBENCH_CASES"] = str(Path(cases_file).resolve())
        if array:
            n = num_cases if num_cases is not None else len(read_cases(cases_file))
            if n < 1:
                raise UsageError(f"{cases_file} has no cases")
            throttle = f"%{max_parallel}" if max_parallel else ""
            argv += [f"--array=0-{n - 1}{throttle}", "--output=%x-%A_%a.out"]
    argv += [*sbatch_options, str(script), *args]
    return argv, env


def submit(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """Run ``sbatch`` (``--export=ALL`` is its default: the additions reach the job); the
    job id it printed."""
    done = subprocess.run(list(argv), env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"sbatch failed ({done.returncode}): {done.stderr.strip()}")
    m = re.search(r"Submitted batch job (\d+)", done.stdout)
    return m.group(1) if m else done.stdout.strip()
