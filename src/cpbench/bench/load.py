"""How busy the machine was with work not ours, while we measured.

A self-check scores the model against times measured on this machine, and ``cpbench run``
times CP on it; another process taking a core in the meantime moves the times, not the model
or the strategy. The meter samples ``/proc`` in a thread: the CPU time of every process outside
our own tree (the root process and what it starts, ranks of a forkserver included; the run's
rank 0 takes its launcher, torchrun's agent or the forkserver, as root) and the time the
hypervisor stole, as a share of the machine's cores over the wall time. Linux only; elsewhere
it reports nothing and the caller says so.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PROC = "/proc"


@dataclass(frozen=True)
class Load:
    foreign_cpu_s: float  # CPU seconds of processes outside our tree, and stolen time
    wall_s: float
    cpus: int

    @property
    def share(self) -> float:
        """Of all the cores over the wall time, the share others used."""
        return self.foreign_cpu_s / max(self.wall_s * self.cpus, 1e-9)

    @property
    def cores(self) -> float:
        """How many cores others kept busy on average."""
        return self.foreign_cpu_s / max(self.wall_s, 1e-9)

    def to_dict(self) -> dict:
        """The record's ``load`` section."""
        return {"foreign_cpu_s": round(self.foreign_cpu_s, 3), "wall_s": round(self.wall_s, 3),
                "cpus": self.cpus, "share": round(self.share, 4)}


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a process, None if it is gone."""
    try:
        with open(f"{_PROC}/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name may hold spaces and brackets
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def _steal_s() -> float:
    with open(f"{_PROC}/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) / _TICK if len(fields) > 8 else 0.0


def _snapshot(root: int) -> dict[int, tuple[bool, float]]:
    """pid → (outside our tree?, CPU seconds) of every process now."""
    procs = {}
    for name in os.listdir(_PROC):
        if name.isdigit():
            st = _stat(name)
            if st is not None:
                procs[int(name)] = st
    ours: dict[int, bool] = {root: True}

    def is_ours(pid: int) -> bool:
        seen = []
        while pid not in ours:
            seen.append(pid)
            parent = procs.get(pid, (0, 0.0))[0]
            if parent <= 1:
                ours[pid] = False
                break
            pid = parent
        for p in seen:
            ours[p] = ours[pid]
        return ours[pid]

    return {pid: (not is_ours(pid), cpu) for pid, (_, cpu) in procs.items()}


class Meter:
    """``with Meter() as m: ...`` then ``m.load``: others' CPU while the block ran, sampled
    every ``period`` seconds (a process that starts and ends between two samples is missed).
    ``root``: the process whose tree is ours (default: this one)."""

    def __init__(self, period: float = 0.5, root: int | None = None):
        self.period = period
        self.root = root
        self.load: Load | None = None
        self._stop = threading.Event()

    @staticmethod
    def available() -> bool:
        return os.path.exists(f"{_PROC}/stat") and os.path.exists(f"{_PROC}/self/stat")

    def __enter__(self) -> Meter:
        if not self.available():
            return self
        self._root = os.getpid() if self.root is None else self.root
        self._t0, self._steal0 = time.monotonic(), _steal_s()
        self._last = _snapshot(self._root)
        self._foreign = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        now = _snapshot(self._root)
        for pid, (foreign, cpu) in now.items():
            if foreign:
                before = self._last.get(pid)
                self._foreign += cpu - (before[1] if before else 0.0)
        self._last = now

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def __exit__(self, *exc) -> None:
        if not self.available():
            return
        self._stop.set()
        self._thread.join()
        self._sample()
        stolen = _steal_s() - self._steal0
        self.load = Load(self._foreign + stolen, time.monotonic() - self._t0,
                         os.cpu_count() or 1)
