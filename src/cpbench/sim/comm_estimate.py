"""The simulator's model of what a CP step spends beyond its kernel, for ``cpbench run``'s
estimate on GPUs (``bench.estimate``: its probe times the kernel alone).

Where a shipped preset's family names the local GPU (``h200-sxm`` for "NVIDIA H200", the
longest family first: "GB200" is no "B200"), a case's extra per step is the preset's
prediction less its kernel time: the communication it does not hide, merges, gradient sums
and the per-step cost (``sim.model.predict``), for the forward and the backward. The
estimate says which preset it used; with no preset for the device, nothing is added.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpbench.config import AttentionConfig
from cpbench.sim import hardware, model
from cpbench.sim.hardware import Hardware
from cpbench.topology import Topology


def preset_for(device_name: str | None) -> str | None:
    """The shipped preset whose family (its name's first part) the device's name holds."""
    if not device_name:
        return None
    families = sorted(((n.split("-")[0], n) for n in hardware.names()),
                      key=lambda fn: -len(fn[0]))
    return next((name for family, name in families if family in device_name.lower()), None)


@dataclass(frozen=True)
class CommModel:
    """(FWD s, BWD s) a step spends beyond its kernel, on the preset ``name``."""

    name: str
    hw: Hardware

    def __call__(self, strategy: str, options, attn: AttentionConfig, topo: Topology
                 ) -> tuple[float, float]:
        try:
            p = model.predict(strategy, options, attn, topo, self.hw)
        except Exception:  # noqa: BLE001 - what the model cannot run adds nothing here
            return 0.0, 0.0
        return max(0.0, p.fwd_s - p.fwd_compute_s), max(0.0, p.bwd_s - p.bwd_compute_s)


def for_device(device_name: str | None) -> CommModel | None:
    """The model for a GPU of this name, or None (no preset matches)."""
    name = preset_for(device_name)
    return CommModel(name, hardware.load(name)) if name else None


def for_local_gpu() -> CommModel | None:
    """The model for this machine's GPU 0, or None (no GPU, or no preset for it)."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        name = torch.cuda.get_device_name(torch.cuda.current_device())
    except (RuntimeError, AssertionError, ValueError):  # the plan says what is wrong with it
        return None
    return for_device(name)
