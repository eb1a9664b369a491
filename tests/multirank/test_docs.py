"""The doc test: every ``console runnable`` block of README.md and docs/*.md runs as shown.

Each block runs in its own temporary directory, its commands in order through bash, with
``cpbench`` the cpbench of this checkout under this interpreter; each must exit as the block
declares and print the excerpt lines shown under it (docs/testing.md states the convention)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import REPO, Block, all_blocks, missing_lines

BLOCKS = all_blocks()
# the commands that start no ranks (one process, as a unit test): the blocks made of these
# alone run beside the others; a block with any other starts ranks of its own, and is marked
# ``command``: one at a time across xdist workers (tests/conftest.py)
IN_PROCESS = {"simulate", "report", "compare", "strategies", "kernels", "models", "dryrun"}


def _starts_ranks(block: Block) -> bool:
    return any((c.text.split() + ["", ""])[:2] not in [["cpbench", n] for n in IN_PROCESS]
               for c in block.commands)


def _param(block: Block):
    marks = [pytest.mark.command] if _starts_ranks(block) else []
    return pytest.param(block, id=block.id, marks=marks)


TIMEOUT = 600  # seconds one command may take: a guard against a hang; blocks take seconds
# repository folders the commands name by relative path (configs/cpu_smoke.yaml, ...)
LINKED = ("configs", "scripts")


def _bin_dir(tmp_path: Path) -> Path:
    """Where ``cpbench`` is found: the venv's own bin, as ``. .venv/bin/activate`` puts it on
    PATH (README's set-up), when this interpreter is a venv's with cpbench installed; else a
    shim running this interpreter's ``cpbench.cli``."""
    venv_bin = Path(sys.prefix) / "bin"
    if sys.prefix != sys.base_prefix and (venv_bin / "cpbench").exists():
        return venv_bin
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    shim = bin_dir / "cpbench"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m cpbench.cli "$@"\n')
    shim.chmod(0o755)
    return bin_dir


def _workdir(tmp_path: Path) -> dict[str, str]:
    """Link the repository folders in, put a ``cpbench`` for this checkout first on PATH."""
    for name in LINKED:
        (tmp_path / name).symlink_to(REPO / name)
    bin_dir = _bin_dir(tmp_path)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH"))
                                        if p)
    return env


def _run(text: str, cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """One command through bash in its own session: on timeout the whole group (the ranks it
    started included) is killed, not only bash."""
    proc = subprocess.Popen(["bash", "-c", text], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {TIMEOUT} s: {text}\n{out[-4000:]}")
    return proc.returncode, out


def test_the_pages_have_runnable_blocks():
    """The parametrized test below would pass vacuously if the convention stopped matching."""
    assert len(BLOCKS) >= 10
    assert any(b.page == "README.md" for b in BLOCKS)
    apart = [b for b in BLOCKS if not _starts_ranks(b)]
    assert apart and len(apart) < len(BLOCKS)
    assert all("cpbench run " not in c.text for b in apart for c in b.commands)


@pytest.mark.timeout(1800)  # a whole block; each command has TIMEOUT
@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_runnable_block(block: Block, tmp_path: Path):
    env = _workdir(tmp_path)
    for command in block.commands:
        where = f"{block.page}:{command.line}: {command.text}"
        code, out = _run(command.text, tmp_path, env)
        assert code == block.exit, f"{where}\nexit {code}, not {block.exit}\n{out[-4000:]}"
        missing = missing_lines(command.expect, out)
        assert not missing, f"{where}\nnot in its output: {missing}\n{out[-4000:]}"
