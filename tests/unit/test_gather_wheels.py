"""scripts/gather_wheels.py without network: which pins it gathers, its checks of a wheel, its
flow with pip's download played by a copy, and its offline install line run for real with pip
(--no-index) on a wheel built here. The download itself needs PyPI (docs/gpus-and-slurm.md
says how it was checked)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gather_wheels", REPO / "scripts" /
                                               "gather_wheels.py")
gw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gw)


def _wheel(folder: Path, name: str, version: str, requires=(), tag="py3-none-any",
           module: str | None = None) -> Path:
    """A minimal wheel: one module and its dist-info, as pip installs it."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-{tag}.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    files = {f"{dist}.dist-info/METADATA": meta,
             f"{dist}.dist-info/WHEEL": f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tag}\n",
             f"{module or name.replace('-', '_')}/__init__.py": f"VERSION = {version!r}\n"}
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{n},,\n" for n in files) + \
        f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, text in files.items():
            z.writestr(n, text)
    return path


def test_it_gathers_the_pinned_libraries_the_offline_machine_lacks():
    # torch, numpy, pandas, pyyaml, scipy are there; flash-attn is no dependency at all
    assert gw.pins() == ["ring-flash-attn==0.1.8", "yunchang==0.6.4"]


def test_a_wheel_is_checked_for_purity_and_what_it_requires(tmp_path):
    ok = _wheel(tmp_path, "yunchang", "0.6.4",
                ["torch>=2.3.0", 'flash-attn>=2.6.0; extra == "flash"'])
    assert gw.wheel_problems(ok) == []
    native = _wheel(tmp_path, "fast", "1.0", tag="cp312-cp312-manylinux_2_28_x86_64")
    assert gw.wheel_problems(native) == [f"{native.name} is not a pure-Python wheel"]
    needy = _wheel(tmp_path, "needy", "1.0", ["einops", "numpy>=1"])
    assert [p.split(",")[0] for p in gw.wheel_problems(needy)] == \
        [f"{needy.name} requires einops"]


def _pip_plays_pypi(made: list, requires=()):
    """pip download, played: records the command, writes the pinned wheels into --dest."""
    def run(cmd):
        made.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        for pin in cmd[-2:]:
            name, version = pin.split("==")
            _wheel(dest, name, version, requires)
        return SimpleNamespace(returncode=0)
    return run


def test_gather_downloads_pure_wheels_for_the_offline_python(tmp_path):
    made: list = []
    wheels = gw.gather(tmp_path, "3.12", python="py", run=_pip_plays_pypi(made, ["torch"]))
    (cmd,) = made
    assert cmd[:4] == ["py", "-m", "pip", "download"]
    for flag in ("--no-deps", "--only-binary=:all:"):
        assert flag in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert cmd[-2:] == ["ring-flash-attn==0.1.8", "yunchang==0.6.4"]
    assert [w.name for w in wheels] == ["ring_flash_attn-0.1.8-py3-none-any.whl",
                                        "yunchang-0.6.4-py3-none-any.whl"]
    sums = (tmp_path / "SHA256SUMS").read_text().splitlines()
    assert [s.split("  ")[1] for s in sums] == [w.name for w in wheels]
    # a wheel that needs what the machine lacks stops it, naming the requirement
    with pytest.raises(SystemExit, match="requires einops"):
        gw.gather(tmp_path / "b", "3.12", run=_pip_plays_pypi([], ["einops"]))
    failed = SimpleNamespace(returncode=1)
    with pytest.raises(SystemExit, match="pip download of ring-flash-attn==0.1.8 yunchang"):
        gw.gather(tmp_path / "c", "3.12", run=lambda cmd: failed)


def test_bad_usage_exits_2(capsys):
    assert gw.main(["--python-version", "twelve"]) == 2
    assert "give 3.N" in capsys.readouterr().err


@pytest.mark.slow  # pip in a subprocess
def test_the_offline_install_line_installs_with_no_index(tmp_path):
    dest = tmp_path / "wheels"
    dest.mkdir()
    _wheel(dest, "cpbench-probe-lib", "0.1.8", module="cpbench_probe_lib")
    line = gw.install_line(dest).replace("python3 ", f"{sys.executable} ", 1)
    probe = f"{sys.executable} -c 'import cpbench_probe_lib as m; print(m.__file__, m.VERSION)'"
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}
    done = subprocess.run(["bash", "-c", f"{line} && {probe}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    where, version = done.stdout.splitlines()[-1].split()
    assert where.startswith(str(dest / "site")) and version == "0.1.8"


def test_the_install_line_names_the_folder_as_the_offline_machine_sees_it():
    # inside the repository: relative (the copy's absolute path differs), PYTHONPATH absolute
    assert gw.install_line(REPO / "wheels") == (
        "python3 -m pip install --no-index --no-deps --target wheels/site wheels/*.whl && "
        "export PYTHONPATH=$PWD/wheels/site:$PWD/src")
    assert gw.install_line(Path("/data/w")).endswith("PYTHONPATH=/data/w/site:$PWD/src")
