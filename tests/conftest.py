import logging
import os
import sys

import pytest

# Each pytest-xdist worker gets its share of the cores, as launch gives each rank its share:
# two workers at two threads each put 4 OpenMP threads on 2 cores, and an OpenMP barrier
# waiting on a descheduled thread made float64 work 5-9x slower once anything else ran
# (make test-fast: 188 s and a timeout failure, against 95 s at one thread a worker, under
# the same load). Set before torch loads, so the commands the tests start inherit it.
# Only in a worker: the controller's environment is the workers' (a value set there would
# win over their own share), and a run without workers keeps torch's default.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _WORKERS = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

# Rank bodies live in plain modules beside the tests so spawned ranks can import them; the
# unit tests share helpers the same way.
for _dir in ("multirank", "unit", "gpu"):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), _dir))


@pytest.fixture()
def own_modules():
    """The adapters install cpbench's CPU flash-attn interface as ``flash_attn`` in this
    process: removed after, so later tests see this machine as it is."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("flash_attn", "flash_attn_interface", "ring_flash_attn",
                                  "yunchang"):
            del sys.modules[name]


@pytest.fixture(autouse=True)
def _cpbench_loggers():
    """A command run in this process configures cpbench's loggers once (report.console),
    with handlers on the streams of that moment (a test's captured stdout, closed after
    it): restored after each test, so a later one logs where logging would."""
    loggers = [logging.getLogger(name) for name in ("cpbench", "cpbench.out")]
    saved = [(lg.handlers[:], lg.propagate, lg.level, lg.filters[:]) for lg in loggers]
    yield
    for lg, (handlers, propagate, level, filters) in zip(loggers, saved):
        lg.handlers, lg.propagate, lg.level, lg.filters = handlers, propagate, level, filters


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Everything under tests/multirank starts real gloo ranks: mark it, so the unit layer
    runs alone with `-m "not multirank"` (make test-fast). The tests marked ``command`` (the
    long cpbench commands with ranks of their own: doc blocks, sweeps, CLI runs) form one
    xdist group: under `--dist loadgroup` one worker runs them in turn, never two at once.
    Two such commands on 2 cores beside others' load made each 10-100x slower than alone (a
    busy-host run of the suite: doc blocks past their 600-s guard at a load of 30-56), where
    one alone was 1.7x. (Under pytest 9.2 xdist grouped nothing: pyproject.toml pins below it,
    tests/unit/test_test_groups.py holds the grouping.)"""
    for item in items:
        if f"{os.sep}multirank{os.sep}" in str(item.path):
            item.add_marker(pytest.mark.multirank)
        if item.get_closest_marker("command"):
            item.add_marker(pytest.mark.xdist_group("command"))


def pytest_configure(config):
    """The share above, also where torch was loaded before this file (a plugin)."""
    if "OMP_NUM_THREADS" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
