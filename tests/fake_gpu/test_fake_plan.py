"""``cpbench run --strategy all`` planned on one CUDA GPU under torchrun with neither
flash-attn nor TransformerEngine (the air-gapped one-GPU box of issue 33): what cannot run is
skipped, one line each, and the rest runs on torch's sdpa kernel."""

from __future__ import annotations

import pytest
import torch

from cpbench import strategies, torchcompat
from cpbench.bench import plan as planning
from cpbench.config import RunConfig


@pytest.fixture
def one_gpu_no_flash_attn(monkeypatch):
    from cpbench.kernels import flash_attn as fa

    def absent(module):
        raise ModuleNotFoundError(f"No module named {module!r}")

    monkeypatch.setattr(fa, "_load", absent)  # flash-attn 2 and 3 not installed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(planning.env_mod, "torchrun_world", lambda: (0, 1, 1))
    monkeypatch.setattr(planning.memory, "capacity_bytes", lambda *a: 80 * 2 ** 30)
    # the estimate probes the kernel on the device: there is none here (bench.estimate)
    monkeypatch.setattr(planning, "_estimates", lambda *a, **k: ())
    te = strategies.get("te-p2p").upstream
    real = type(te).unavailable  # torch's own CP keeps its torch-version check
    monkeypatch.setattr(type(te), "unavailable", lambda self, device: (
        f"{self.package} is not installed" if self.package == "transformer-engine"
        else real(self, device) if self.package == "torch" else None))


@pytest.mark.parametrize("kernel", ["auto", "sdpa"])
def test_all_on_one_gpu_without_flash_attn_or_te_runs_the_rest(one_gpu_no_flash_attn, kernel):
    p = planning.plan(RunConfig(out="none", strategy=("all",), kernel=kernel),
                      {"seqlen": 4096, "dtype": "bf16"}, {}, launcher="torchrun")
    assert p.run.device == "cuda" and p.kernel == "sdpa"
    ran = {c.strategy for c in p.cases}
    assert set(strategies.own_names()) <= ran
    if torchcompat.VERSION >= torchcompat.CP_SINCE:
        assert {"torch-ring", "torch-flex"} <= ran
    else:  # skipped, saying the torch they need
        for name in ("torch-ring", "torch-flex"):
            assert any(s.startswith(name) and "needs torch >= 2.10" in s for s in p.skipped)
    te = [n for n in strategies.names() if n.startswith("te-")]
    for name in te:
        assert f"{name} cannot run here: transformer-engine is not installed" in p.skipped
    for name in strategies.names():  # every other one runs or says why not
        assert name in ran or any(s.startswith(name) for s in p.skipped), name
