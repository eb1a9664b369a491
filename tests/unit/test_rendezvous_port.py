"""The port a sweep gives each launch's torchrun: outside the host's ephemeral range, so no
connection or free_port() on the host takes it before torchrun binds it, and free now."""

from __future__ import annotations

import random
import socket

from cpbench import launch
from cpbench.sweep import runner


def test_the_port_is_outside_the_ephemeral_range_and_free():
    lo, hi = launch._ephemeral_range()
    rng = random.Random(7)
    ports = [launch.rendezvous_port(rng) for _ in range(50)]
    assert all(not lo <= p <= hi for p in ports), (lo, hi, ports)
    assert all(launch.STATIC_PORTS[0] <= p < launch.STATIC_PORTS[1] or p > hi for p in ports)
    assert len(set(ports)) > 40  # drawn, not one port for every launch on the host
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("", p))  # raises if it were held


class _Drawing(random.Random):
    """Draws the given ports first, then as a Random does."""

    def __init__(self, first: list[int]):
        super().__init__(3)
        self.first = list(first)

    def randrange(self, *args, **kwargs):
        return self.first.pop(0) if self.first else super().randrange(*args, **kwargs)


def test_a_port_something_listens_on_is_never_given():
    held = launch.rendezvous_port(random.Random(11))
    with socket.socket() as s:
        s.bind(("", held))
        s.listen()
        given = launch.rendezvous_port(_Drawing([held, held]))
    assert given != held and launch._bindable(given)


def test_a_host_whose_ephemeral_range_is_everything_falls_back_to_free_port(tmp_path,
                                                                           monkeypatch):
    (tmp_path / "range").write_text("1024\t65535\n")
    monkeypatch.setattr(launch, "EPHEMERAL", str(tmp_path / "range"))
    assert launch._ephemeral_range() == (1024, 65535)
    monkeypatch.setattr(launch, "free_port", lambda: 4242)
    assert launch.rendezvous_port() == 4242


def test_the_sweep_draws_its_launch_ports_here():
    assert runner.rendezvous_port is launch.rendezvous_port
    assert not hasattr(runner, "free_port")  # no other source of a launch's port
