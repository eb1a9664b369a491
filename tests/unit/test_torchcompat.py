"""torchcompat's table against the torch installed: each entry names what this torch really has
(read from its own sources), and a torch outside the range is refused in one line. CI runs this
under the floor, 2.11 and the main venv's torch (make test-torch-matrix)."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from cpbench import strategies, threadpg, torchcompat


def test_this_torch_is_in_the_range_ci_tests():
    assert torchcompat.FLOOR <= torchcompat.VERSION <= torchcompat.CEILING
    assert torchcompat.out_of_range() is None
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert torchcompat.VERSION == (major, minor)


def test_pyproject_states_the_same_range():
    text = open("pyproject.toml").read()
    low, high = torchcompat.FLOOR, torchcompat.CEILING
    assert f'"torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"' in text


@pytest.mark.parametrize("version,verdict", [((2, 3), "older than cpbench's floor, torch 2.5"),
                                             ((2, 16), "newer than the newest tested, 2.15")])
def test_out_of_range_says_so_in_one_line(monkeypatch, version, verdict):
    monkeypatch.setattr(torchcompat, "VERSION", version)
    why = torchcompat.out_of_range()
    assert verdict in why and "\n" not in why and len(why) <= 120


def test_needs_names_the_torch_it_needs(monkeypatch):
    monkeypatch.setattr(torchcompat, "VERSION", (2, 9))
    assert torchcompat.needs((2, 10), "torch-flex") == \
        f"torch-flex needs torch >= 2.10 (this is torch {torch.__version__})"
    assert torchcompat.needs((2, 9), "torch-flex") is None


def test_flex_cp_collectives_are_the_ones_torch_calls():
    """The names exist here, and torch's FlexAttention CP (where this torch has it) calls
    exactly them."""
    names = torchcompat.flex_cp_collectives()
    assert set(names.values()) == {"all_gather_into_tensor", "reduce_scatter_tensor"}
    assert all(callable(getattr(funcol, n)) for n in names)
    ops = torchcompat.import_optional(f"{torchcompat.CP_PACKAGE}._cp_custom_ops")
    if ops is not None:  # 2.10 on
        called = set(re.findall(r"funcol\.(\w+)\(", inspect.getsource(ops)))
        assert called == set(names), called


def test_the_threaded_group_takes_every_all_to_all_name_c10d_calls():
    called = set(re.findall(r"group\.(\w+)\(", inspect.getsource(dist.all_to_all_single)))
    assert called & set(torchcompat.ALL_TO_ALL_SINGLE_METHODS) == called - {"rank", "size"}
    for name in torchcompat.ALL_TO_ALL_SINGLE_METHODS:
        assert getattr(threadpg.ThreadedGroup, name) is threadpg.ThreadedGroup.all_to_all_single


def test_torchs_context_parallel_is_there_from_its_version_on():
    has = torchcompat.import_optional(torchcompat.CP_PACKAGE) is not None
    assert has == (torchcompat.VERSION >= torchcompat.CP_SINCE)
    for name in ("torch-ring", "torch-flex"):
        why = strategies.get(name).unavailable("cuda")
        assert (why is not None and "needs torch >= 2.10" in why) == (not has), why


def test_use_count_counts_holders_of_the_tensor():
    t = torch.ones(1, requires_grad=True)
    before = torchcompat.use_count(t)
    z = t * t  # its backward saves t (twice)
    assert before is not None and torchcompat.use_count(t) > before
    del z
    assert torchcompat.use_count(t) == before


def test_aten_op_lacks_names_the_op_or_the_argument():
    assert torchcompat.aten_op_lacks("_flash_attention_forward", ("window_size_left",)) is None
    assert "has no aten.no_such_op" in torchcompat.aten_op_lacks("no_such_op")
    why = torchcompat.aten_op_lacks("_flash_attention_forward", ("no_such_arg",))
    assert why.endswith("takes no no_such_arg")


def test_a_run_below_the_floor_is_refused_before_anything_starts(monkeypatch, capsys):
    from cpbench.cli import main

    monkeypatch.setattr(torchcompat, "VERSION", (2, 3))
    assert main(["run", "--strategy", "zigzag", "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and len(err[0]) <= 120 and "floor, torch 2.5" in err[0], err


def test_importlib_finds_nothing_for_a_module_torch_lacks():
    assert torchcompat.import_optional("torch.no_such_module") is None
    assert torchcompat.import_optional("torch.distributed") is importlib.import_module(
        "torch.distributed")


@pytest.mark.parametrize("name", ["torch-ring", "torch-flex"])
def test_a_strategy_an_older_torch_lacks_is_refused_in_one_line(monkeypatch, capsys, name):
    monkeypatch.setattr(torchcompat, "VERSION", (2, 9))
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")  # the longest such version
    from cpbench.cli import main

    assert main(["run", "--strategy", name, "--nproc", "2", "--seqlen", "1k"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and len(err[0]) <= 120, err
    assert err[0].endswith("needs torch >= 2.10 (this is torch 2.9.1+cu128)"), err


def test_the_dry_run_below_its_torch_is_refused_in_one_line(monkeypatch, capsys):
    """Below 2.11 c10d's collectives have no fake implementation (and below 2.10 autograd on
    fake CUDA aborts the process): the dry run says so before it starts."""
    monkeypatch.setattr(torchcompat, "VERSION", (2, 10))
    from cpbench.cli import main

    assert main(["dryrun", "--device", "cpu", "--strategy", "zigzag", "--nodes", "1",
                 "--gpus-per-node", "2", "--seqlen", "1k"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and len(err[0]) <= 120, err
    assert "the dry run needs torch >= 2.11" in err[0], err


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
def test_the_gqa_shim_of_older_torch_is_the_same_maths(monkeypatch, dtype, tol):
    """Below 2.9 the CPU flash op gets K/V heads expanded and dK / dV summed back: against
    the op's own GQA on this torch (right from 2.9), on fresh random inputs."""
    if torchcompat.VERSION < torchcompat.CPU_FLASH_GQA_SINCE:
        pytest.skip("this torch's own GQA is the one that corrupts the heap")
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    q, k, v = (torch.randn(1, h, 32, 16, generator=g, dtype=dtype) for h in (8, 2, 2))
    dout = torch.randn(1, 8, 32, 16, generator=g, dtype=dtype)

    def run():
        out, lse = torchcompat.cpu_flash_forward(q, k, v, 0.0, True, scale=0.25)
        grads = torchcompat.cpu_flash_backward(dout, q, k, v, out, lse, 0.0, True, scale=0.25)
        return (out, *grads)

    native = run()
    monkeypatch.setattr(torchcompat, "VERSION", (2, 8))
    shimmed = run()
    assert [t.shape for t in shimmed] == [t.shape for t in native]
    for a, b in zip(shimmed, native):
        assert (a.double() - b.double()).abs().max() <= tol * b.double().abs().max()
