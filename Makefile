# Two entry points a new user needs: `make bench` (the main job) and `make test`.
# Both create .venv and install what is missing on first use. `make lint` runs ruff, the
# import-layer contracts, mypy over src/ and shellcheck (CI runs it before the tests);
# `make test-fast` the unit layer alone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.cpbench-installed

# The fake-GPU venv (make test-fake-gpu): a CUDA build of torch, needed for fake CUDA tensors
# (no GPU is used), apart from .venv so the main suite keeps the CPU build. Its torch is the
# one-GPU machine's (2.11), so fake CUDA rehearses it; the floor's venv is the same build of
# the oldest torch supported (docs/torch-versions.md).
FG_VENV ?= .venv-fake-gpu
FG_TORCH ?= 2.11.0
FG_STAMP := $(FG_VENV)/.cpbench-fake-gpu-installed
FLOOR_VENV ?= .venv-torch-floor
FLOOR_TORCH ?= 2.5.1
FLOOR_STAMP := $(FLOOR_VENV)/.cpbench-fake-gpu-installed
# the tests that touch version-dependent code, run under each of those torches, then
# tests/fake_gpu (make test-torch-matrix; the main venv's torch runs them in make test)
TORCH_LAYER := tests/unit/test_torchcompat.py tests/unit/test_threadpg.py \
	tests/unit/test_dryrun.py tests/unit/test_gpu_check.py tests/multirank/test_threads_run.py \
	tests/multirank/test_strategies.py tests/multirank/test_upstream.py

.PHONY: bench test test-fast test-timing test-evidence test-gpu test-fake-gpu test-torch-matrix gpu-check lint install clean

$(STAMP): pyproject.toml scripts/ensure_torch.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	scripts/ensure_torch.sh $(PY)
	$(PY) -m pip install -q -e '.[test,lint]'
	touch $(STAMP)

install: $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/cpbench run --strategy all --nproc 4 --check

# pytest-xdist's workers: on 2 cores, 2 take about a third off the wall time (a test's ranks
# and subprocesses leave a core idle much of the time). make test: --dist loadgroup, so the
# long cpbench commands (marker `command`: doc blocks, sweeps, CLI runs) run on one worker in
# turn, never two at once (tests/conftest.py); test-fast: worksteal, an idle worker takes
# tests queued on the other. JOBS=0: one process
JOBS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) --dist loadgroup -m "not timing and not evidence"

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) --dist worksteal -m "not multirank and not gpu and not slow and not timing and not evidence"

# the presets' stated evidence re-scored from their published rows: the H100 one simulates
# 300 packed-document problems at 8-64 GPUs (minutes of one core), so a CI phase of its own
test-evidence: $(STAMP)
	$(PY) -m pytest -q -p no:xdist -m evidence

# the tests that time real work against cpbench's own prediction (the estimate): a change of
# others' load between the meter's readings goes unseen, so they run alone, on a machine
# otherwise idle (CI runs them first), never beside make test's workers
test-timing: $(STAMP)
	$(PY) -m pytest -q -p no:xdist -m timing

# the GPU-marked tests (tests/gpu and a few unit ones). On one GPU: every strategy as threads
# on it (tests/gpu/test_threads_one_gpu.py); with 2 or more GPUs and flash-attn installed
# (pip install -e '.[gpu]'), the torchrun ones too (docs/testing.md). Each job runs in its own session and is
# killed as a group when it outlives its timeout, which is below the test's own
# (tests/gpu/jobs.py); -x: after a hung NCCL job, later tests would only report its GPUs busy.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -x -m gpu

# cpbench's CUDA paths (flash-attn, strategies on the fake process group) on fake CUDA
# tensors: shapes, dtypes, bytes sent; no numbers. See docs/testing.md.
$(FG_STAMP): pyproject.toml scripts/fake_gpu_venv.sh tests/fake_gpu/stub/flash_attn_2_cuda.py
	scripts/fake_gpu_venv.sh $(PYTHON) $(FG_VENV) $(FG_TORCH)
	touch $(FG_STAMP)

$(FLOOR_STAMP): pyproject.toml scripts/fake_gpu_venv.sh tests/fake_gpu/stub/flash_attn_2_cuda.py
	scripts/fake_gpu_venv.sh $(PYTHON) $(FLOOR_VENV) $(FLOOR_TORCH)
	touch $(FLOOR_STAMP)

# flash-attn's Python files and the stand-in for its compiled module lie in VENV/flash-attn-stub,
# on PYTHONPATH for tests/fake_gpu only (scripts/fake_gpu_venv.sh says why)
test-fake-gpu: $(FG_STAMP)
	CPBENCH_FAKE_GPU_VENV=1 PYTHONPATH=$(FG_VENV)/flash-attn-stub \
	  $(FG_VENV)/bin/python -m pytest -q tests/fake_gpu

# the version layer under the one-GPU machine's torch and under the floor (each says which)
test-torch-matrix: $(FG_STAMP) $(FLOOR_STAMP)
	@for venv in $(FG_VENV) $(FLOOR_VENV); do py=$$venv/bin/python; \
	  echo "torch matrix: $$($$py -c 'import torch; print("torch", torch.__version__)')"; \
	  $$py -m pytest -q $(TORCH_LAYER) || exit 1; \
	  CPBENCH_FAKE_GPU_VENV=1 PYTHONPATH=$$venv/flash-attn-stub $$py -m pytest -q tests/fake_gpu \
	    || exit 1; done

# What one GPU can show, in 6 minutes, offline (docs/gpu-check.md): each step a subprocess
# under its cap; without a GPU the CUDA steps say "skipped: no CUDA". On a GPU machine, no make
# needed: `python3 scripts/gpu_check.py --compact --out DIR` (its own torch, no venv).
# NO_VENV=1 (or VENV=): the machine's own $(PYTHON) and torch, nothing built or installed (the
# fake-GPU venv's fake-CUDA steps: NO_VENV=1 PYTHON=.venv-fake-gpu/bin/python);
# GPU_CHECK_FLAGS: more flags (e.g. --out DIR --compact, --only STEP).
GPU_CHECK_FLAGS ?=
ifeq ($(strip $(VENV)),)
NO_VENV := 1
endif
ifdef NO_VENV
gpu-check:
	$(PYTHON) scripts/gpu_check.py $(GPU_CHECK_FLAGS)
else
gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py $(GPU_CHECK_FLAGS)
endif

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(VENV)/bin/shellcheck src/cpbench/slurm/cpbench.sbatch scripts/ensure_torch.sh \
		scripts/fake_gpu_venv.sh .ci/run

clean:
	rm -rf $(VENV) $(FG_VENV) $(FLOOR_VENV) .pytest_cache
