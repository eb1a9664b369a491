"""What the adapter strategies share: the flash-attn beneath a library (on CPU, and on CUDA
under ``--kernel sdpa``, cpbench's implementation of flash-attn's interface, installed only
where no flash-attn exists), the kernel check that keeps "same kernels" true, and the
schedule an adapter does not declare.

An adapter runs a library's own code; it declares no communication schedule (its traffic is
what ``cpbench comm`` measures from its torch.distributed calls), so the simulator, which
prices declared schedules, leaves it out with that reason.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass

from cpbench import torchcompat
from cpbench.errors import Skipped, UsageError

# the kernels beneath flash-attn's interface, per device: on CPU the interface runs the aten
# CPU flash kernel that `sdpa-cpu` is, so an adapter and cpbench's own strategies share it; on
# CUDA flash-attn 2 itself, or where it is absent torch's FA2 ops, which `sdpa` runs.
# Not flash-attn3: the libraries call flash_attn's (FA2) interface, never FA3's.
FLASH_KERNELS: dict[str, tuple[str, ...]] = {"cpu": ("sdpa-cpu", "flash-attn-cpu"),
                                              "cuda": ("flash-attn", "sdpa")}


@dataclass(frozen=True)
class Upstream:
    """The published library an adapter strategy runs: its distribution (for the version),
    the module to import, cpbench's own strategy of the same algorithm (``twin``, for
    ``cpbench report --compare upstream``), whether it runs on CUDA only, and the oldest
    torch that has it (``torch_since``, for torch's own)."""

    package: str
    module: str
    twin: str | None = None
    cuda_only: bool = False
    torch_since: tuple[int, int] | None = None

    def version(self) -> str | None:
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return None

    def unavailable(self, device: str) -> str | None:
        """Why it cannot run on ``device`` here (None: it can)."""
        if self.torch_since and (why := torchcompat.needs(self.torch_since, "it")):
            return why
        if self.cuda_only and device != "cuda":
            return f"{self.package} runs on CUDA GPUs only (this run is on {device})"
        try:
            found = importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"{self.package} is not installed"


def device_of(kernel) -> str:
    return "cuda" if "cuda" in kernel.devices and "cpu" not in kernel.devices else "cpu"


def kernel_hint(accepted: dict[str, tuple[str, ...]], kernel) -> str:
    """``use --kernel ...`` naming only kernels that run where ``kernel`` runs: a kernel of
    both devices (the reference) gets each device's choice."""
    devices = [d for d in ("cuda", "cpu") if d in kernel.devices and d in accepted]
    if len(devices) == 1:
        return f"use --kernel {' or '.join(accepted[devices[0]])} (or auto)"
    return "use --kernel " + ", ".join(f"{' or '.join(accepted[d])} on {d.upper()}"
                                       for d in devices) + " (or auto)"


def check_kernel(strat, what: str) -> None:
    """The run's kernel must be the one ``strat``'s library runs (``accepted_kernels``), so its
    rows compare with cpbench's own on the same kernel and record what ran. ``what``: the
    library's call, for the message."""
    accepted = strat.accepted_kernels
    if strat.kernel.name not in accepted.get(device_of(strat.kernel), ()):
        raise UsageError(f"{strat.name} runs {what}; {kernel_hint(accepted, strat.kernel)}, "
                         f"not {strat.kernel.name}")


def check_flash_kernel(strat) -> None:
    """The library calls flash-attn's interface: the run's kernel must be what is beneath it."""
    check_kernel(strat, f"{strat.upstream.package}'s code, which calls flash-attn's interface "
                        f"(on CUDA flash-attn 2, or cpbench's on torch's FA2 ops under sdpa; "
                        f"on CPU cpbench's on the sdpa-cpu kernel)")


def case_kernel(cls, backend, request: dict, *, auto: bool, elsewhere: bool = False):
    """(the backend strategy ``cls`` runs on, a note or None). What ``auto`` resolved stays
    unless the strategy runs a library with its own kernel (``accepted_kernels``) that is not
    it: then, for auto only, that library's kernel where it can run (FA3 picked on a Hopper:
    the adapters keep flash-attn 2; torch-ring on CUDA: torch's flash op, ``sdpa``). A kernel
    asked for by name is never swapped (``validate`` refuses it with the hint).
    ``elsewhere``: planned off the job's nodes, where availability is the job's to decide."""
    from cpbench import kernels

    device = request["device"]
    accepted = (cls.accepted_kernels or {}).get(device)
    if not auto or accepted is None or backend.name in accepted:
        return backend, None
    for name in accepted:
        alt = kernels.get(name)
        if elsewhere or alt.unsupported_reason(**request) is None:
            return alt, (f"{backend.name} for {cls.name} (it runs {cls.upstream.package}'s "
                         f"code, on {name}): using {name}")
    return backend, None


def flash_attn_beneath(kernel) -> str:
    """Make ``import flash_attn`` work in this process for the library, before it is
    imported, and say what it is: a real flash-attn, or cpbench's interface (on CPU; on CUDA
    under ``sdpa``, on torch's FA2 ops). Never both in one process: cpbench's is installed only
    where no flash-attn exists."""
    from cpbench.kernels import flash_attn_cpu as fac

    device = device_of(kernel)
    if device == "cpu" or kernel.name == "sdpa":
        beneath = "the aten CPU flash kernel" if device == "cpu" else \
            "torch's FA2 ops, aten._flash_attention_forward/_backward"
        why = fac.cuda_import_error() if device == "cuda" else None
        if why is not None:
            raise UsageError(f"cpbench's flash-attn interface cannot run on CUDA here: {why}")
        if fac.install():
            return f"cpbench interface of flash-attn {fac.__version__} ({beneath})"
        if device == "cpu":
            raise UsageError("a flash-attn is installed here, and it does not run on CPU: the "
                             "upstream strategies cannot use cpbench's CPU interface beside "
                             "it; run them on GPUs, or in an environment without flash-attn")
        raise UsageError("a flash-attn is installed here: the upstream library would call it, "
                         "not torch's FA2 kernel; use --kernel flash-attn (sdpa runs them only "
                         "where flash-attn is absent)")
    import flash_attn

    if fac.is_cpu_interface(flash_attn):  # installed earlier in this process: no flash-attn
        raise UsageError("flash-attn is not installed here; use --kernel sdpa (torch's FA2 ops "
                         "beneath flash-attn's interface)")
    return f"flash-attn {flash_attn.__version__}"


def unsupported_dtype(strat) -> None:
    """The libraries' ring code is written for flash-attn, which has no fp32: in fp32 it
    returns wrong gradients (ring-flash-attn 0.1.8 ring_flash_attn.py:133-135 and the zigzag
    and stripe files alike: ``dq = block_dq_buffer.to(torch.float32)`` is the buffer itself
    when it is fp32, and the next block's backward overwrites it; ring_flash_attn.py:154
    returns ``dq.to(torch.bfloat16)``; yunchang 0.6.4's ring copies the same lines). Refused
    rather than timed wrong."""
    if strat.attn.dtype == "fp32":
        raise Skipped(f"{strat.upstream.package} {strat.upstream.version()} "
                         f"computes wrong gradients in fp32 (its ring is written for "
                         f"flash-attn, which has none); use --dtype bf16 or fp16")


def import_algorithms(package: str, module: str):
    """``package.module``, imported as usual; where the package's ``__init__`` fails only
    because of an optional dependency of a part cpbench does not use (ring-flash-attn 0.1.8
    imports its Hugging Face adapter, hence ``transformers``, an undeclared dependency), the
    algorithm module alone, from the installed package directory: the same code runs."""
    try:
        return importlib.import_module(f"{package}.{module}")
    except ModuleNotFoundError as e:
        if e.name != "transformers":
            raise
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations is not None, "a package"
    shell = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(
        package, None, is_package=True))
    shell.__path__ = list(spec.submodule_search_locations)
    sys.modules[package] = shell
    return importlib.import_module(f"{package}.{module}")


def no_schedule(strat):
    raise UsageError(f"{strat.name} runs {strat.upstream.package}'s own code and declares no "
                     f"schedule (cpbench comm measures what it sends); the simulator models "
                     f"its twin, {strat.upstream.twin or 'none'}")
