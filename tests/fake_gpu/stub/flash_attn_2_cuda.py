"""Stand-in for flash-attn's compiled module ``flash_attn_2_cuda`` (the fake-GPU venv only).

scripts/fake_gpu_venv.sh copies this file beside flash-attn's Python files in
VENV/flash-attn-stub (on PYTHONPATH for tests/fake_gpu only), so that flash-attn's interface
imports without its CUDA build. flash-attn >= 2.7 registers fake implementations of its custom
ops: under FakeTensorMode those answer and this module is never reached. Anything else that
reaches it (a real tensor, or a function without a fake implementation) raises: a real call
can never silently pass.
"""

from __future__ import annotations

MESSAGE = "flash_attn_2_cuda stand-in: no CUDA build here; only fake tensors may reach it"
CPBENCH_FAKE_GPU_STUB = True


def _is_fake(x) -> bool:
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:
        return False
    return isinstance(x, FakeTensor)


def _stand_in(name: str):
    def call(*args, **kwargs):
        values = list(args) + list(kwargs.values())
        if values and all(_is_fake(v) for v in values if hasattr(v, "shape")) and \
                any(hasattr(v, "shape") for v in values):
            raise RuntimeError(f"flash_attn_2_cuda stand-in: {name} has no fake "
                               "implementation in flash-attn; fake tensors cannot run it")
        raise RuntimeError(f"{MESSAGE} (called flash_attn_2_cuda.{name})")

    call.__name__ = call.__qualname__ = name
    return call


def __getattr__(name: str):
    # Dunder and private names stay missing so that import machinery, hasattr probes and
    # pickling see an ordinary module; every public name is a function that raises.
    if name.startswith("_"):
        raise AttributeError(name)
    return _stand_in(name)
