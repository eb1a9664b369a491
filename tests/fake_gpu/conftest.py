"""The fake-GPU layer (`make test-fake-gpu`): cpbench's CUDA code paths on fake CUDA tensors
(torch's FakeTensorMode: shapes, dtypes and devices, no data, no GPU) and torch's fake
process group (collectives return at once, nothing is sent).

It needs a CUDA build of torch (fake CUDA tensors do) and, for flash-attn's paths, flash-attn's
Python files with scripts/fake_gpu_venv.sh's stand-in for its compiled module. Under the CPU
build (the main venv, `make test`) nothing here is collected.
"""

from __future__ import annotations

import pytest
import torch
from optional_libs import IN_FAKE_GPU_VENV, require

CUDA_BUILD = torch.version.cuda is not None

if not CUDA_BUILD:
    collect_ignore_glob = ["*"]  # fake CUDA tensors need a CUDA build of torch

# what an older torch cannot do here, and the modules that need it (torchcompat): autograd on
# fake CUDA tensors without a GPU (below 2.10 the process aborts), c10d's collectives on fake
# tensors (below 2.11 they raise); each such module skips, naming why
AUTOGRAD = ("test_fa2_buffers.py", "test_fake_dryrun.py", "test_fake_flash_attn.py",
            "test_fake_strategies.py", "test_fake_upstream_sdpa.py", "test_masked_cuda.py",
            "test_sim_memory_gpu.py", "test_torch_ring_cuda.py")
COLLECTIVES = ("test_collective_devices.py", "test_fake_dryrun.py", "test_fake_strategies.py",
               "test_sim_memory_gpu.py", "test_fake_upstream_sdpa.py")


def pytest_collection_modifyitems(config, items):
    from cpbench import torchcompat

    autograd = torchcompat.fake_cuda_autograd()
    collectives = torchcompat.needs(torchcompat.FAKE_COLLECTIVES_SINCE, "c10d on fake tensors")
    for item in items:
        why = (autograd if item.path.name in AUTOGRAD else None) or (
            collectives if item.path.name in COLLECTIVES else None)
        if why:
            item.add_marker(pytest.mark.skip(reason=why))

def pytest_configure(config):
    # cpbench's flash-attn wrapper checks base alignment with data_ptr(); a fake tensor's is 0
    # (aligned: no copy, as on a GPU) and torch warns that reading it is deprecated
    config.addinivalue_line(
        "filterwarnings", "ignore:Accessing the data pointer of FakeTensor:UserWarning")


@pytest.fixture
def fake_cuda():
    """A FakeTensorMode context: tensors made inside are fake; device="cuda" works without a
    GPU. Yields the mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        yield mode


@pytest.fixture
def fake_pg():
    """``fake_pg(rank, world)`` initializes torch's "fake" process group as that rank (every
    collective returns at once); destroyed after the test. ``backend="cuda:fake"`` gives it
    CUDA tensors only: a CPU tensor raises, as on NCCL."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cpbench.topology import forget_groups

    def destroy():
        if dist.is_initialized():
            forget_groups()  # cpbench's cache of groups by role and members
            dist.destroy_process_group()

    def init(rank: int, world: int, backend: str = "fake"):
        destroy()
        dist.init_process_group(backend, rank=rank, world_size=world, store=FakeStore())

    yield init
    destroy()


@pytest.fixture
def flash_attn():
    """flash-attn's interface module; required in the fake-GPU venv, else skipped without it
    ("flash-attn not installed"; an installed one that does not import says why)."""
    if IN_FAKE_GPU_VENV:
        import flash_attn.flash_attn_interface as fi
        return fi
    require("flash-attn")
    return pytest.importorskip("flash_attn.flash_attn_interface")


@pytest.fixture
def stand_in(flash_attn):
    """The stand-in compiled module (skipped where a real flash-attn build is installed)."""
    import flash_attn_2_cuda

    if not getattr(flash_attn_2_cuda, "CPBENCH_FAKE_GPU_STUB", False):
        pytest.skip("a real flash_attn_2_cuda is installed, not the stand-in")
    return flash_attn_2_cuda



@pytest.fixture
def fake_streams():
    """torch.cuda's streams and events as recording stand-ins (``cpbench.bench.fakecuda``);
    yields the list of streams made current, in order."""
    from cpbench.bench import fakecuda

    with fakecuda.streams() as made_current:
        yield made_current
