"""How a rank's own failure reaches the process that launched it, when the ranks cannot record
the case themselves (on NCCL a rank failing inside a strategy's communication ends the whole
launch: its peers block until the watchdog's timeout, which ends the processes).

The failing rank, before it waits for its peers:

- prints one line to stderr (``line``), so the launch's log says what failed, not only
  "Watchdog caught collective operation timeout";
- leaves the same (status, message) in the launcher's store when the launcher hosts one (a
  ``cpbench sweep``: ``STORE_ENV`` names it), keyed by the case's record key, so the launcher
  records the case with the rank's own status and message (``OOM`` or ``failed``).

The launcher reads the store first, then the log's lines (``from_log``); a log's last lines
(torchrun's summary) never decide a status.
"""

from __future__ import annotations

import json
import os
import re
import sys
from datetime import timedelta

# host:port of the launcher's TCPStore, in every rank's environment
STORE_ENV = "CPBENCH_FAILURE_STORE"
# the name other nodes reach the launcher's host by (the sbatch script: the rendezvous host)
HOST_ENV = "CPBENCH_FAILURE_HOST"
_PREFIX = "cpbench/failure"
# "cpbench: rank 1 failed (OOM) in zigzag: OutOfMemoryError: ..." (one line)
_LINE = re.compile(r"cpbench: rank (\d+) failed \((\w+)\) in (.+?): (.*)$")


def line(rank: int, status: str, label: str, msg: str) -> str:
    return f"cpbench: rank {rank} failed ({status}) in {label}: {msg}"


def _client():
    """The launcher's store, or None (no launcher store, or it cannot be reached)."""
    address = os.environ.get(STORE_ENV)
    if not address:
        return None
    host, _, port = address.rpartition(":")
    try:
        from torch.distributed import TCPStore

        return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10),
                        wait_for_workers=False)
    except Exception:  # best effort: the log line still says it
        return None


def leave(rank: int, record_key: str | None, label: str, status: str, msg: str) -> None:
    """This rank failed by itself (not a collective): say so on stderr now, and in the
    launcher's store when there is one."""
    sys.stderr.write(line(rank, status, label, msg) + "\n")
    sys.stderr.flush()
    store = _client() if record_key else None
    if store is None:
        return
    try:
        store.set(f"{_PREFIX}/{record_key}/{rank}", json.dumps([status, msg]))
    except Exception:  # best effort
        pass


def host_store(local: bool = False):
    """(the launcher's store, its address for ``STORE_ENV``): a TCPStore on a free port of
    this host, reached from the other nodes by ``HOST_ENV`` or else this host's name
    (``local``: all ranks on this host, 127.0.0.1)."""
    import socket

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1" if local else "0.0.0.0", 0, is_master=True,
                     timeout=timedelta(seconds=10), wait_for_workers=False)
    host = "127.0.0.1" if local else os.environ.get(HOST_ENV) or socket.gethostname()
    return store, f"{host}:{store.port}"


def from_store(store, record_key: str, world_size: int) -> tuple[str, str] | None:
    """(status, "rank r: message") of the first rank that left its failure for this case."""
    for rank in range(world_size):
        key = f"{_PREFIX}/{record_key}/{rank}"
        try:
            if store.check([key]):
                status, msg = json.loads(store.get(key))
                return status, f"rank {rank}: {msg}"
        except Exception:  # best effort
            return None
    return None


def from_log(text: str, label: str) -> tuple[str, str] | None:
    """(status, "rank r: message") from the first failure line a rank printed for the case
    labelled ``label``, anywhere in a launch's log."""
    for raw in text.splitlines():
        m = _LINE.search(raw)
        if m and m.group(3) == label:
            return m.group(2), f"rank {m.group(1)}: {m.group(4)}"
    return None
