#!/usr/bin/env python3
"""Gather the wheels of the upstream libraries for a GPU machine without network.

Run where PyPI is reachable, from the repository:

    python3 scripts/gather_wheels.py [DIR] [--python-version 3.12]      # DIR: wheels/

It downloads the pinned pure-Python dependencies of pyproject.toml that a machine with only
Python, torch, numpy, pandas, scipy, pyyaml, matplotlib and pytest lacks (ring-flash-attn
and yunchang), as wheels for that Python without their dependencies (pip download --no-deps
--only-binary=:all:), checks that each is pure Python and requires nothing that machine
lacks, writes DIR/SHA256SUMS, and prints the offline install line. flash-attn is not
gathered (yunchang's optional extra; it has no wheel on PyPI and builds for hours): without
it cpbench runs both libraries on torch's own FlashAttention-2, `--kernel sdpa`. Exit 1 when
a download or a check fails; exit 2 on bad usage. docs/gpus-and-slurm.md has the steps.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shlex
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# what the offline machine has (issue 33's: Python 3.12 with torch 2.11 and these), by
# normalized distribution name; cpbench itself runs from its checkout (PYTHONPATH=src)
PREINSTALLED = frozenset({"torch", "triton", "numpy", "pandas", "scipy", "pyyaml",
                          "matplotlib", "pytest", "pytest-timeout", "cpbench"})


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _name(requirement: str) -> str:
    return normalize(re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0])


def pins(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """The ``name==version`` dependencies of cpbench that the offline machine lacks."""
    import tomllib

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if "==" in d and _name(d) not in PREINSTALLED]


def download_command(python: str, dest: Path, wanted: list[str], python_version: str) -> list:
    return [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", python_version, "--implementation", "py", "--abi", "none",
            "--platform", "any", "--dest", str(dest), *wanted]


def wheel_problems(path: Path, have: frozenset[str] = PREINSTALLED) -> list[str]:
    """Why ``path`` would not install and import offline next to ``have`` (empty: fine)."""
    tags = path.name[:-len(".whl")].split("-")[-3:]
    problems = []
    if len(tags) != 3 or tags[1:] != ["none", "any"] or not tags[0].startswith("py"):
        problems.append(f"{path.name} is not a pure-Python wheel")
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(z.read(meta).decode())
    for req in message.get_all("Requires-Dist") or []:
        marker = req.split(";", 1)[1] if ";" in req else ""
        if re.search(r"\bextra\s*==", marker):
            continue  # an optional extra (yunchang's flash-attn): not installed by default
        if _name(req) not in have:
            problems.append(f"{path.name} requires {req.strip()}, which the offline machine "
                            f"lacks: add it to the gathered wheels")
    return problems


def shown(dest: Path) -> str:
    """``dest`` as the offline machine's commands name it: relative to the repository when
    inside it (the repository is copied, its absolute path may differ), else as it is."""
    return str(dest.relative_to(REPO)) if dest.is_relative_to(REPO) else str(dest)


def install_line(dest: Path) -> str:
    """The offline install, into DEST/site (nothing else on the machine changes), run from
    the repository."""
    d = shlex.quote(shown(dest))
    site = f"{d}/site" if Path(shown(dest)).is_absolute() else f"$PWD/{d}/site"
    return (f"python3 -m pip install --no-index --no-deps --target {d}/site {d}/*.whl && "
            f"export PYTHONPATH={site}:$PWD/src")


def gather(dest: Path, python_version: str, python: str = sys.executable, run=subprocess.run):
    """Download, check, write SHA256SUMS; returns the wheels (raises SystemExit(1) on a
    failure, with what failed on stderr)."""
    wanted = pins()
    dest.mkdir(parents=True, exist_ok=True)
    if run(download_command(python, dest, wanted, python_version)).returncode != 0:
        raise SystemExit(f"gather_wheels: pip download of {' '.join(wanted)} failed (above)")
    wheels = sorted(p for p in dest.glob("*.whl")
                    if any(p.name.startswith(normalize(w.split("==")[0]).replace("-", "_")
                                             + "-" + w.split("==")[1] + "-") for w in wanted))
    problems = [p for w in wheels for p in wheel_problems(w)]
    if len(wheels) != len(wanted):
        problems.append(f"expected {len(wanted)} wheels ({', '.join(wanted)}), found "
                        f"{', '.join(w.name for w in wheels) or 'none'} in {dest}")
    if problems:
        raise SystemExit("gather_wheels: " + "\ngather_wheels: ".join(problems))
    sums = "".join(f"{hashlib.sha256(w.read_bytes()).hexdigest()}  {w.name}\n" for w in wheels)
    (dest / "SHA256SUMS").write_text(sums)
    return wheels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("dest", nargs="?", default=str(REPO / "wheels"),
                        help="folder for the wheels (default: wheels/ in the repository)")
    parser.add_argument("--python-version", default="3.12",
                        help="the offline machine's Python, as pip's --python-version")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        print(f"gather_wheels: --python-version {args.python_version}: give 3.N", file=sys.stderr)
        return 2
    dest = Path(args.dest).resolve()
    try:
        wheels = gather(dest, args.python_version)
    except SystemExit as e:
        print(e.code, file=sys.stderr)
        return 1
    print(f"gathered {len(wheels)} wheels in {dest} (SHA256SUMS beside them): "
          + ", ".join(w.name for w in wheels))
    print("copy the folder with the repository; on the offline machine, from the repository:")
    print(f"  (cd {shlex.quote(shown(dest))} && sha256sum -c SHA256SUMS)")
    print(f"  {install_line(dest)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
