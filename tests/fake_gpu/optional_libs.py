"""The optional libraries the fake-GPU tests use, and the one skip reason for a missing one:
"<library> not installed". The one-GPU machine this project is lent has none of them (its
own torch, no network), so there these tests skip, one line each, instead of failing on an
import; in the fake-GPU venv (`make test-fake-gpu`) they are installed and a missing one is
a failure."""

from __future__ import annotations

import importlib.util
import os

import pytest

# pip's name: the module that provides it
MODULES = {"flash-attn": "flash_attn", "ring-flash-attn": "ring_flash_attn",
           "yunchang": "yunchang", "transformer-engine": "transformer_engine"}
# set by `make test-fake-gpu`: there every library must import (no skipping for want of one)
IN_FAKE_GPU_VENV = os.environ.get("CPBENCH_FAKE_GPU_VENV") == "1"


def installed(library: str) -> bool:
    """Whether anything provides the library's module (without importing it: ring-flash-attn
    imports flash-attn, which a test may have made absent)."""
    try:
        return importlib.util.find_spec(MODULES[library]) is not None
    except ValueError:  # in sys.modules without a spec: imported, so installed
        return True


def require(library: str) -> None:
    """Skip the test (or, called at module level, the module) where the library is not
    installed; an installed one that fails to import is left to fail or skip on its own
    error, which says more than "not installed"."""
    if not IN_FAKE_GPU_VENV and not installed(library):
        pytest.skip(f"{library} not installed", allow_module_level=True)
