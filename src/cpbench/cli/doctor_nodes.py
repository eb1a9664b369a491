"""``cpbench doctor`` between nodes: run under srun with one task per node
(``srun --ntasks-per-node=1 cpbench doctor``), the tasks form one group across the nodes
(NCCL on each node's GPU 0, gloo without GPUs) and time an all-reduce, a ring exchange and an
all-to-all between them. Task 0 prints the result; a group that cannot form or a collective
that fails gets the settings a first multi-node run most often lacks."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue

from cpbench.launch import STATIC_PORTS
from cpbench.slurm import expand_nodelist

# the first run's likeliest failure: NCCL picking an interface or HCA the nodes cannot use
ADVICE = ("the likeliest cause on a first run: NCCL's network. Set NCCL_SOCKET_IFNAME to the "
          "interface the nodes reach each other on (`ip -br addr`; e.g. ib0, eth0, or ^lo,docker "
          "to exclude), on InfiniBand NCCL_IB_HCA to the HCAs `ibv_devinfo` lists (on RoCE also "
          "NCCL_IB_GID_INDEX, often 3); where there is no InfiniBand, NCCL_IB_DISABLE=1. Re-run "
          "with NCCL_DEBUG=INFO to see what NCCL chose")
TIMEOUT_S = 180.0
# the ports the tasks derive theirs in: below the ephemeral range, so that no outgoing
# connection on the node (NCCL's, gloo's) takes it before task 0 binds it
PORTS = STATIC_PORTS


def srun_world(environ=os.environ) -> tuple[int, int, str, int] | None:
    """(this task, tasks, the first host, a port) when run as one of several srun tasks,
    else None. The port comes from the job and step ids: the same on every task."""
    tasks = int(environ.get("SLURM_NTASKS") or environ.get("SLURM_NPROCS") or 1)
    if tasks < 2 or not environ.get("SLURM_JOB_NODELIST"):
        return None
    ids = int(environ.get("SLURM_JOB_ID") or 0) * 7 + int(environ.get("SLURM_STEP_ID") or 0)
    first, end = PORTS
    return (int(environ.get("SLURM_PROCID") or 0), tasks,
            expand_nodelist(environ["SLURM_JOB_NODELIST"])[0], first + ids % (end - first))


def _child(results, rank, world, master, port, device):
    from cpbench.bench.agreement import one_line
    from cpbench.bench.preflight import node_probe

    try:
        results.put(("ok", node_probe(rank, world, master, port, device, TIMEOUT_S / 2)))
    except Exception as e:  # what the group or a collective said
        results.put(("error", one_line(e)))


def probe(where: tuple[int, int, str, int], device: str) -> tuple[str, dict | str]:
    """("ok", figures) or ("error", why): the probe in a child process, killed past
    TIMEOUT_S (a NCCL group that cannot connect may hang rather than fail)."""
    rank, world, master, port = where
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_child, args=(results, rank, world, master, port, device),
                        daemon=True)
    child.start()
    try:
        return results.get(timeout=TIMEOUT_S)
    except queue.Empty:
        return "error", f"no answer within {TIMEOUT_S:.0f} s"
    finally:
        child.join(timeout=5)
        if child.is_alive():
            child.kill()
