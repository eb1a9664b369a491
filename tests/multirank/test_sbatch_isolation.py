"""The sbatch script's real path on one node, with fake ``srun`` / ``scontrol`` and a
``torchrun`` that is torch's own (``python -m torch.distributed.run``) on CPU ranks: a case
whose rank 1 runs out of memory inside the ring, in a job that then ends as NCCL's watchdog
ends it (``faults.py``), is recorded OOM with rank 1's message by the launching side, and the
next strategy runs in its own launch and is recorded ok."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cpbench import results

# starts cpbench commands with ranks of their own: one at a time across xdist workers
pytestmark = pytest.mark.command

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPT = REPO / "scripts" / "slurm" / "cpbench.sbatch"

_SRUN = """#!/bin/bash
# one task on this node: drop srun's own options, run the rest
while [[ "$1" == -* ]]; do shift; done
exec "$@"
"""
_SCONTROL = """#!/bin/bash
echo 127.0.0.1
"""
_TORCHRUN = f"""#!/bin/bash
exec {sys.executable} -m torch.distributed.run "$@"
"""
_CLI = f"""#!/bin/bash
exec {sys.executable} {HERE / "faults.py"} "$@"
"""


def _fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", _SRUN), ("scontrol", _SCONTROL), ("torchrun", _TORCHRUN),
                       ("cpbench", _CLI)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.mark.timeout(1700)  # past its command's hang guard below
def test_sbatch_records_an_oom_the_job_could_not_and_runs_the_next_strategy(tmp_path):
    bin_dir, out = _fake_bin(tmp_path), tmp_path / "r.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CPBENCH_"))}
    # this checkout's sources in every process, whatever the cwd
    path = os.pathsep.join([str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHONPATH=path, SLURM_JOB_ID="77",
               SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES="1",
               CPBENCH_GPUS_PER_NODE="2", CPBENCH_ENTRY=str(HERE / "faults.py"),
               CPBENCH_TEST_WATCHDOG_S="3", CPBENCH_TEST_OOM_MARK=str(tmp_path / "oom-raised"),
               OMP_NUM_THREADS="1",
               TORCH_NCCL_ASYNC_ERROR_HANDLING="0")  # the script sets its own
    done = subprocess.run(
        ["bash", str(SCRIPT), "--strategy", "test-oom-in-ring,zigzag", "--device", "cpu",
         "--seqlen", "1k", "--heads", "2", "--head-dim", "16", "--warmup", "1", "--iters", "2",
         "--out", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=1500)  # a hang guard: under two busy loops the job passed 800 s (torchrun's
        # start-up alone ~100 s a case), and finished
    said = done.stdout + done.stderr
    assert out.exists(), said
    records = results.read(out)
    assert [(r["config"]["strategy"], r["status"]) for r in records] == [
        ("test-oom-in-ring", "OOM"), ("zigzag", "ok")], said
    oom = records[0]
    assert oom["error"].startswith("rank 1: OutOfMemoryError: CUDA out of memory (injected on "
                                   "rank 1, call 3)"), oom["error"]
    assert oom["sweep"]["returncode"] != 0 and oom["env"]["slurm_job_id"] == "77"
    assert done.returncode == 1, said  # a case did not end ok
    log = Path(oom["sweep"]["log"]).read_text()
    # rank 1 said it before waiting; the job then ended without a record from inside
    assert "cpbench: rank 1 failed (OOM) in test-oom-in-ring: " \
           "OutOfMemoryError" in log
    assert "--rdzv-id=77-1" in log.splitlines()[0]
    assert records[1]["derived"]["fwd_bwd_ms"] > 0


def _bindable(rng: random.Random, first: int, end: int) -> int:
    """A port in [first, end) that nothing holds now. Not free_port(): that hands out an
    ephemeral port, which any outgoing connection of a test beside this one may take before
    task 0 binds it (CI of 35ffcbe: task 0 exited 1 under load)."""
    for _ in range(100):
        port = rng.randrange(first, end)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError(f"no free port in [{first}, {end})")


def test_doctor_under_srun_probes_between_the_tasks(tmp_path):
    """Two `cpbench doctor` tasks as srun starts them (one per node; here both on this host,
    gloo): task 0 reports the all-reduce, p2p and all-to-all between them; task 1 does not."""
    from cpbench.cli.doctor_nodes import PORTS

    first, end = PORTS
    port = _bindable(random.Random(os.getpid()), first, end)
    job = (port - first) * pow(7, -1, end - first) % (end - first)  # the tasks derive this port
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    base.update(PYTHONPATH=os.pathsep.join([str(REPO / "src"), base.get("PYTHONPATH", "")]),
                SLURM_NTASKS="2", SLURM_JOB_ID=str(job), SLURM_STEP_ID="0",
                SLURM_JOB_NODELIST="localhost", OMP_NUM_THREADS="1")
    tasks = [subprocess.Popen([sys.executable, "-m", "cpbench.cli", "doctor", "--no-probe"],
                              env=dict(base, SLURM_PROCID=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
             for r in range(2)]
    outs = [t.communicate(timeout=300)[0] for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], "\n".join(
        f"task {r}:\n{out}" for r, out in enumerate(outs))  # whole: pytest cuts a list's repr
    assert "nodes all-reduce" in outs[0] and "2 nodes, gloo on cpu" in outs[0], outs[0]
    assert "nodes p2p" in outs[0] and "nodes a2a" in outs[0]
    assert "nodes " not in outs[1].replace("2 nodes", "")


_PRINT_HANDLING = """import os
print("value:", os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))
"""


def test_torchrun_gives_its_workers_error_handling_1(tmp_path):
    """The fact docs/failures.md and the doctor state: with the variable unset, torch's elastic
    agent gives every worker TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (not 3). No GPU needed: the
    agent sets it whatever the backend."""
    script = tmp_path / "show.py"
    script.write_text(_PRINT_HANDLING)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "1", str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "value: 1" in done.stdout, done.stdout + done.stderr
