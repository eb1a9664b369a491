#!/usr/bin/env bash
# Install torch into the given interpreter's environment if it has none.
# Without a GPU we pin the CPU build: an unpinned `torch` pulls a multi-GB CUDA wheel.
# With a GPU we pin the CUDA torch that the prebuilt wheels of the GPU extra match, not the
# latest: flash-attn 2.8.3's official wheels are built for CUDA 12 and torch up to 2.8 (there
# is none for 2.10 or 2.11: Dao-AILab/flash-attention#2299, #2425), and its installer fetches
# the one matching the torch it finds, else compiles for an hour. torch 2.8.0 on PyPI is the
# CUDA 12.8 build. transformer-engine's PyTorch part builds against the torch installed.
set -euo pipefail
PY="${1:?usage: ensure_torch.sh PYTHON}"
GPU_TORCH="2.8.0"
if "$PY" -c "import torch" 2>/dev/null; then
  have="$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda or "")')"
  if [[ "$have" == *" "?* && "$have" != "$GPU_TORCH"* ]]; then
    echo "ensure_torch: keeping torch $have; flash-attn's prebuilt wheels need torch $GPU_TORCH (CUDA 12)"
  fi
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "ensure_torch: GPU found, installing torch==$GPU_TORCH (CUDA 12.8), which flash-attn's wheels match"
  "$PY" -m pip install -q "torch==$GPU_TORCH"
else
  echo "ensure_torch: no GPU, installing the CPU build torch==2.13.0"
  "$PY" -m pip install -q "torch==2.13.0"
fi
