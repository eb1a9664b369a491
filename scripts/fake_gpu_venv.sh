#!/usr/bin/env bash
# Build a venv of a CUDA build of torch for the fake-GPU layer and the torch matrix
# (docs/testing.md, docs/torch-versions.md): cpbench editable with its test deps, flash-attn's
# Python files without their CUDA build, and a stand-in for the compiled module
# flash_attn_2_cuda. No GPU is used: fake CUDA tensors need a CUDA build, nothing more.
# The registry has torch below 2.13 only as CUDA builds (several GB with their CUDA
# libraries), and pip's own cache keeps none of them here: the first build downloads torch and
# what it needs into a wheel cache outside the checkout (CPBENCH_WHEEL_CACHE, default
# ~/.cache/cpbench/wheels), later builds on the machine (CI's fresh clone too) install from it.
# Usage: scripts/fake_gpu_venv.sh PYTHON VENV TORCH_VERSION
set -euo pipefail
PYTHON="${1:?usage: fake_gpu_venv.sh PYTHON VENV TORCH_VERSION}"
VENV="${2:?usage: fake_gpu_venv.sh PYTHON VENV TORCH_VERSION}"
TORCH="${3:?usage: fake_gpu_venv.sh PYTHON VENV TORCH_VERSION}"
PY="$VENV/bin/python"
cd "$(dirname "$0")/.."

test -x "$PY" || "$PYTHON" -m venv "$VENV"
# flash-attn's setup.py runs with --no-build-isolation below, so the venv's own setuptools
# builds it (a fresh venv's is too old for its bdist_wheel) and it needs packaging.
"$PY" -m pip install -q "setuptools>=68" packaging
# Pinned, and installed first: cpbench's torch range is then satisfied and pip never swaps it
# for the CPU build (ensure_torch.sh's) or a newer CUDA wheel.
WHEELS="${CPBENCH_WHEEL_CACHE:-$HOME/.cache/cpbench/wheels}/torch-$TORCH"
if [[ ! -f "$WHEELS/.complete" ]]; then
  echo "fake_gpu_venv: caching torch $TORCH and its CUDA libraries in $WHEELS (once)"
  "$PY" -m pip download -q -d "$WHEELS" "torch==$TORCH"
  touch "$WHEELS/.complete"
fi
"$PY" -m pip install -q --no-index --find-links "$WHEELS" "torch==$TORCH"
"$PY" -m pip install -q -e '.[test]'
"$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH' or not torch.version.cuda)" \
  || { echo "fake_gpu_venv: torch is not the $TORCH CUDA build" >&2; exit 1; }
# flash-attn's Python interface only: SKIP_CUDA_BUILD compiles nothing, FORCE_BUILD stops its
# setup.py from trying to download a prebuilt wheel from GitHub. --no-deps: its one runtime
# dependency besides torch is einops. It goes into a folder of its own ($VENV/flash-attn-stub),
# on PYTHONPATH only for tests/fake_gpu: the CPU layers the torch matrix runs in the same venv
# need a machine without flash-attn (the upstream strategies refuse CPU beside one).
"$PY" -m pip install -q einops
STUB="$VENV/flash-attn-stub"
rm -rf "$STUB"
FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
  "$PY" -m pip install -q --no-deps --no-build-isolation --target "$STUB" "flash-attn==2.8.3"
cp tests/fake_gpu/stub/flash_attn_2_cuda.py "$STUB/flash_attn_2_cuda.py"
PYTHONPATH="$STUB" "$PY" -c "import flash_attn, flash_attn_2_cuda; assert flash_attn_2_cuda.CPBENCH_FAKE_GPU_STUB"
"$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('flash_attn') is not None)" \
  || { echo "fake_gpu_venv: flash-attn is installed in $VENV itself; rm -r $VENV and rerun" >&2; exit 1; }
echo "fake_gpu_venv: $VENV ready (torch $("$PY" -c 'import torch; print(torch.__version__)'), flash-attn $(PYTHONPATH="$STUB" "$PY" -c 'import flash_attn; print(flash_attn.__version__)') in $STUB)"
