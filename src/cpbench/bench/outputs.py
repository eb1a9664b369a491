"""The files a command writes, made (or refused, one line with the fix) before anything runs,
so that a path it could not write is an error now rather than after the first case:
``--out`` (every command that appends records), ``--profile``'s directory, and a run's default
``--out``."""

from __future__ import annotations

from pathlib import Path

from cpbench.bench import env as env_mod
from cpbench.config import AttentionConfig, RunConfig
from cpbench.errors import UsageError


def open_out(out: str) -> None:
    """Create ``out``'s directory and open it for appending, so that a path the run could
    not write is an error now rather than after the first case."""
    path = Path(out)
    if path.is_dir():
        raise UsageError(f"--out {out} is a directory; give a file such as "
                         f"{path / 'results.jsonl'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as e:
        blocker = next((a for a in (path.parent, *path.parent.parents)
                        if a.exists() and not a.is_dir()), None)
        why = f"{blocker} is a file, not a directory" if blocker else (e.strerror or str(e))
        raise UsageError(f"--out {out}: cannot write there ({why}); give another or "
                         f"none") from None


def open_profile_dir(directory: str) -> None:
    """Create ``--profile``'s directory now, so that one the run could not write is an error
    before any rank starts rather than after the first case's timing."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".cpbench-write-test"
        probe.touch()
        probe.unlink()
    except OSError as e:
        why = f"{path} is a file" if path.is_file() else (e.strerror or str(e))
        raise UsageError(f"--profile {directory}: cannot write traces there ({why}); give "
                         f"a writable directory") from None


def default_out(run: RunConfig, attn: AttentionConfig) -> str:
    """A run's ``--out`` when none is given: ``runs/<utc>_<strategies>_<seqlen>/results.jsonl``
    (the artifacts' one naming scheme)."""
    utc = env_mod.utc_now().replace("-", "").replace(":", "")
    names = "+".join(run.strategy).replace("/", "_")
    return str(Path("runs") / f"{utc}_{names}_{attn.seqlen}" / "results.jsonl")
