"""Where torch differs across the range cpbench supports: every call whose name or behaviour
changed between ``FLOOR`` and ``CEILING`` is looked up here, each entry naming the versions it
covers (read from torch's release sources; CI runs the floor, 2.11 and the main venv's torch:
docs/torch-versions.md).

A feature that needs a newer torch than the one installed says so through ``needs`` (one line,
naming the torch it needs); nothing here raises ``AttributeError`` for a name a torch lacks.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import torch

FLOOR = (2, 5)  # NVIDIA's PyTorch containers of late 2024 (24.09/24.10); docs/torch-versions.md
CEILING = (2, 15)  # the newest torch on the registry; pyproject.toml: torch>=2.5,<2.16


def _parse(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


VERSION = _parse(torch.__version__)


def _name(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def supported() -> str:
    return f"torch {_name(FLOOR)} to {_name(CEILING)}"


def out_of_range() -> str | None:
    """Why this torch is outside the supported range (None: inside)."""
    if VERSION < FLOOR:
        return (f"torch {torch.__version__} is older than cpbench's floor, torch {_name(FLOOR)}: "
                f"pip install 'torch>={_name(FLOOR)},<{CEILING[0]}.{CEILING[1] + 1}'")
    if VERSION > CEILING:
        return (f"torch {torch.__version__} is newer than the newest tested, {_name(CEILING)}: "
                f"results may differ (docs/torch-versions.md)")
    return None


def needs(version: tuple[int, int], what: str) -> str | None:
    """One line when ``what`` needs a newer torch than this one, else None."""
    if VERSION >= version:
        return None
    return f"{what} needs torch >= {_name(version)} (this is torch {torch.__version__})"


# --- functional collectives -------------------------------------------------------------
# torch's FlexAttention CP (tensor/experimental/_context_parallel/_cp_custom_ops.py) gathers
# K/V and reduce-scatters dK/dV through these functional collectives: by the first names from
# 2.13 on, by the older ones in 2.10-2.12 (read from _cp_custom_ops.py of each; it does not
# exist before 2.10). Only the names it calls are traced, never both.
_FLEX_CP_FUNCOL = {(2, 13): {"all_gather_single": "all_gather_into_tensor",
                             "reduce_scatter_single": "reduce_scatter_tensor"},
                   FLOOR: {"all_gather_tensor": "all_gather_into_tensor",
                           "reduce_scatter_tensor": "reduce_scatter_tensor"}}


def flex_cp_collectives() -> dict[str, str]:
    """The functional collectives torch's FlexAttention CP calls, by name in
    ``torch.distributed._functional_collectives``, with the collective each one issues."""
    for since, names in sorted(_FLEX_CP_FUNCOL.items(), reverse=True):
        if VERSION >= since:
            return names
    return {}


# --- process-group methods ----------------------------------------------------------------
# What c10d's all_to_all_single calls on a group: ``alltoall_base`` up to 2.12,
# ``all_to_all_single`` from 2.13 (all_gather_into_tensor / reduce_scatter_tensor go through
# ``_allgather_base`` / ``_reduce_scatter_base`` up to 2.12 and ``all_gather_single`` /
# ``reduce_scatter_single`` from 2.13; torch's threaded group sends each to its ``allgather`` /
# ``reduce_scatter`` on every torch here). A group that handles all-to-all defines them all.
ALL_TO_ALL_SINGLE_METHODS = ("alltoall_base", "all_to_all_single")

# batch_isend_irecv asks a plain group (2.5-2.13) or its device backend (2.14 on, through
# ``_get_backend``) whether it coalesces: the threaded group answers both ways
# (``threadpg.ThreadedGroup._get_backend``), on every torch of the range.


def complete_threaded_world(mt: Any) -> None:
    """torch 2.11's ``destroy_process_group`` reads ``_world.comms``, which its own threaded
    world (``multi_threaded_pg.ThreadLocalWorld``) lacks until 2.12: a threaded group could not
    be torn down or formed again there. Each thread's world gets the list it expects."""
    if not hasattr(mt.ThreadLocalWorld, "comms"):
        mt.ThreadLocalWorld.comms = property(
            lambda self: self._get_world().__dict__.setdefault("comms", []))


def set_thread_isolation(on: bool) -> None:
    """torch's per-thread distributed world switch (every torch in the range: 2.5 on)."""
    torch._C._distributed_c10d._set_thread_isolation_mode(on)  # type: ignore[attr-defined]


# --- tensors ------------------------------------------------------------------------------

def use_count(t: torch.Tensor) -> int | None:
    """References to ``t`` (``Tensor._use_count``: 2.4 on; None where a torch lacks it)."""
    count = getattr(t, "_use_count", None)
    return None if count is None else int(count())


def fake_store() -> Any:
    """The store of torch's ``fake`` process group (the dry run's world of one real rank):
    ``torch.testing._internal.distributed.fake_pg.FakeStore``, the same in 2.5-2.15."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def fake_tensor_mode() -> Any:
    """Fake tensors that real ones may meet (a strategy's cached masks and indices):
    ``FakeTensorMode(allow_non_fake_inputs=True)``, the same in 2.5-2.15."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


# --- aten ops -------------------------------------------------------------------------------

def aten_op_lacks(name: str, keywords: tuple[str, ...] = ()) -> str | None:
    """Why ``aten.<name>`` cannot be called with ``keywords`` on this torch (None: it can).
    Schemas, not version numbers: the FA2 ops gained their window arguments in 2.5 and a
    build may lack an op."""
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return f"torch {torch.__version__} has no aten.{name}"
    have = {a.name for a in packet.default._schema.arguments}
    missing = [k for k in keywords if k not in have]
    if missing:
        return f"torch {torch.__version__}'s aten.{name} takes no {missing[0]}"
    return None


# aten's CPU flash kernel with fewer K/V heads than query heads (GQA): its backward corrupts
# the heap up to 2.8 (2.5.1, 2.6.0, 2.7.1 and 2.8.0 abort or free an invalid pointer within
# twenty calls; 2.9.1 on match expanded heads). Below, K/V heads are expanded for the call and
# dK / dV summed back per group: the same maths, with the memory of full K/V heads.
CPU_FLASH_GQA_SINCE = (2, 9)
_CPU_FLASH = "_scaled_dot_product_flash_attention_for_cpu"


def _expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, Any, int]:
    groups = q.shape[1] // k.shape[1]  # (b, h, s, d): heads on dim 1
    return k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), groups


def cpu_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
                      **kwargs: Any) -> Any:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` on (b, h, s, d) tensors."""
    if VERSION < CPU_FLASH_GQA_SINCE and k.shape[1] != q.shape[1]:
        k, v, _ = _expanded(q, k, v)
    return getattr(torch.ops.aten, _CPU_FLASH)(q, k, v, *args, **kwargs)


def cpu_flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       *args: Any, **kwargs: Any) -> Any:
    """Its backward: (dq, dk, dv), dk and dv with k's heads."""
    op = getattr(torch.ops.aten, _CPU_FLASH + "_backward")
    if VERSION >= CPU_FLASH_GQA_SINCE or k.shape[1] == q.shape[1]:
        return op(dout, q, k, v, *args, **kwargs)
    ke, ve, groups = _expanded(q, k, v)
    dq, dk, dv = op(dout, q, ke, ve, *args, **kwargs)

    def summed(g: torch.Tensor) -> torch.Tensor:  # in fp32 at least, as the kernel sums
        wide = torch.promote_types(g.dtype, torch.float32)
        return g.unflatten(1, (k.shape[1], groups)).to(wide).sum(2).to(g.dtype)

    return dq, summed(dk), summed(dv)


# Autograd over fake CUDA tensors where no CUDA driver exists (the dry run on fake CUDA, the
# fake-GPU tests): up to 2.9 recording a node asks the driver for the current stream, and the
# process aborts ("CUDA driver version is insufficient", 2.5.1 to 2.9.1 seen); 2.10 on records
# it. With a GPU every torch in the range can.
FAKE_CUDA_AUTOGRAD_SINCE = (2, 10)


def fake_cuda_autograd() -> str | None:
    """Why this torch cannot run a backward on fake CUDA tensors here (None: it can)."""
    if VERSION >= FAKE_CUDA_AUTOGRAD_SINCE or torch.cuda.is_available():
        return None
    return needs(FAKE_CUDA_AUTOGRAD_SINCE, "fake CUDA without a GPU")


# c10d's collectives on fake tensors (the dry run: every rank's code on the fake process
# group): no fake implementation up to 2.10 (2.5.1, 2.8.0, 2.9.1 and 2.10.0 raise
# UnsupportedOperatorException for c10d.broadcast_ / send / alltoall_base); 2.11 on have one
FAKE_COLLECTIVES_SINCE = (2, 11)


def dry_run_unavailable(device: str) -> str | None:
    """Why the dry run cannot run on ``device`` with this torch (None: it can)."""
    return needs(FAKE_COLLECTIVES_SINCE, "the dry run") or (
        fake_cuda_autograd() if device == "cuda" else None)


# --- modules that moved ---------------------------------------------------------------------

# torch's own context parallel as torch-ring and torch-flex run it: this package, with its
# head-tail and PTRR load balancers and FlexAttention CP, from 2.10 (2.5-2.9 have an
# earlier ring in ``tensor/experimental/_attention.py``, without them)
CP_PACKAGE = "torch.distributed.tensor.experimental._context_parallel"
CP_SINCE = (2, 10)


def import_optional(module: str) -> Any | None:
    """``module`` if this torch has it, else None."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
