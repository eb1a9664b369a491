"""What the adapter strategies share: the flash-attn beneath a library (on CPU, cpbench's CPU
implementation of flash-attn's interface, installed only where no flash-attn exists), the
kernel check that keeps "same kernels" true, and the schedule an adapter does not declare.

An adapter runs a library's own code; it declares no communication schedule (its traffic is
what ``cpbench comm`` measures from its torch.distributed calls), so the simulator, which
prices declared schedules, leaves it out with that reason.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys

from cpbench.errors import Skipped, UsageError

# the kernels beneath flash-attn's interface, per device: on CPU the interface runs the aten
# CPU flash kernel that `sdpa-cpu` is, so an adapter and cpbench's own strategies share it
FLASH_KERNELS = {"cpu": ("sdpa-cpu", "flash-attn-cpu"), "cuda": ("flash-attn",)}


def device_of(kernel) -> str:
    return "cuda" if "cuda" in kernel.devices and "cpu" not in kernel.devices else "cpu"


def check_flash_kernel(strat) -> None:
    """The library calls flash-attn's interface: the run's kernel must be what is beneath it,
    so its rows compare with cpbench's own on the same kernel."""
    device = device_of(strat.kernel)
    allowed = FLASH_KERNELS[device]
    if strat.kernel.name not in allowed:
        raise UsageError(f"{strat.name} runs {strat.upstream.package}'s code, which calls "
                         f"flash-attn's interface (on {device}: the {allowed[0]} kernel); "
                         f"use --kernel {' or '.join(allowed)} (or auto), not "
                         f"{strat.kernel.name}")


def flash_attn_beneath(device: str) -> str:
    """Make ``import flash_attn`` work in this process for the library, before it is
    imported, and say what it is: a real flash-attn, or cpbench's CPU interface."""
    if device == "cpu":
        from cpbench.kernels import flash_attn_cpu

        if flash_attn_cpu.install():
            return (f"cpbench CPU interface of flash-attn {flash_attn_cpu.__version__} "
                    f"(aten CPU flash kernel)")
        raise UsageError("a flash-attn is installed here, and it does not run on CPU: the "
                         "upstream strategies cannot use cpbench's CPU interface beside it; "
                         "run them on GPUs, or in an environment without flash-attn")
    import flash_attn

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
    shell = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(
        package, None, is_package=True))
    shell.__path__ = list(spec.submodule_search_locations)
    sys.modules[package] = shell
    return importlib.import_module(f"{package}.{module}")


def no_schedule(strat):
    raise UsageError(f"{strat.name} runs {strat.upstream.package}'s own code and declares no "
                     f"schedule (cpbench comm measures what it sends); the simulator models "
                     f"its twin, {strat.upstream.twin or 'none'}")
