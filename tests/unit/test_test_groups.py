"""make test's `--dist loadgroup` keeps the tests marked ``command`` on one worker, in turn
(tests/conftest.py). Under pytest 9.2 with pytest-xdist 3.8 it silently grouped nothing
(pytest-dev/pytest-xdist#1386): this runs the conftest's hook in a small suite of its own
under two workers and reads where each test ran."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

_SUITE = '''
import os, time
import pytest

@pytest.mark.command
@pytest.mark.parametrize("i", range(6))
def test_command(i):
    time.sleep(0.2)

@pytest.mark.parametrize("i", range(6))
def test_plain(i):
    time.sleep(0.2)
'''


def test_the_command_tests_run_on_one_worker(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    command: a command\n")
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"_spec = importlib.util.spec_from_file_location('suite_conftest', {str(CONFTEST)!r})\n"
        "_mod = importlib.util.module_from_spec(_spec)\n"
        "_spec.loader.exec_module(_mod)\n"
        "pytest_collection_modifyitems = _mod.pytest_collection_modifyitems\n")
    (tmp_path / "test_suite.py").write_text(_SUITE)
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist",
                           "loadgroup", "-p", "no:cacheprovider", "test_suite.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = re.findall(r"^\[(gw\d)\] .*PASSED test_suite\.py::(test_\w+)\[(\d)\]", done.stdout,
                     re.M)
    workers = {name: {w for w, n, _ in ran if n == name} for name in ("test_command",
                                                                      "test_plain")}
    assert len([r for r in ran if r[1] == "test_command"]) == 6, done.stdout[-3000:]
    assert len(workers["test_command"]) == 1, done.stdout[-3000:]
    # the other worker was there and took plain tests meanwhile
    assert workers["test_plain"] - workers["test_command"], done.stdout[-3000:]
