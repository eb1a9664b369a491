import logging
import os
import sys

import pytest

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


def pytest_collection_modifyitems(config, items):
    """Everything under tests/multirank starts real gloo ranks: mark it, so the unit layer
    runs alone with `-m "not multirank"` (make test-fast)."""
    for item in items:
        if f"{os.sep}multirank{os.sep}" in str(item.path):
            item.add_marker(pytest.mark.multirank)
