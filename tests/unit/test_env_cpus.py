"""The cores a rank may really use: its affinity, in every record; a warning when the ranks
of a host have less than one core each (an srun step bound to one core)."""

from __future__ import annotations

import os

from cpbench.bench import env


def test_cpus_usable_is_the_affinity_not_the_machine(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert env.cpus_usable() == 1
    assert env.capture(device="cpu", launcher="self", hostnames=["a"], world_size=1,
                       ranks_per_node=1)["cpus_usable"] == 1
    assert env.capture(device="cpu", launcher="self", hostnames=["a", "a"], world_size=2,
                       ranks_per_node=2, cpus=[4, 2])["cpus_usable"] == 2


def test_warning_when_a_host_has_less_than_a_core_per_rank():
    hosts = ["n1"] * 8 + ["n2"] * 8
    assert env.cpu_warnings(hosts, [96] * 16) == []
    (line,) = env.cpu_warnings(hosts, [96] * 8 + [1] * 8)
    assert line.startswith("warning: n2: 8 ranks share 1 usable core(s)")
    assert "--cpus-per-task" in line
