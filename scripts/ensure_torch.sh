#!/usr/bin/env bash
# Install torch into the given interpreter's environment if it has none.
# Without a GPU we pin the CPU build: an unpinned `torch` pulls a multi-GB CUDA wheel.
set -euo pipefail
PY="${1:?usage: ensure_torch.sh PYTHON}"
if "$PY" -c "import torch" 2>/dev/null; then
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "ensure_torch: GPU found, installing a CUDA build of torch"
  "$PY" -m pip install -q "torch>=2.3"
else
  echo "ensure_torch: no GPU, installing the CPU build torch==2.13.0"
  "$PY" -m pip install -q "torch==2.13.0"
fi
