# Two entry points a new user needs: `make bench` (the main job) and `make test`.
# Both create .venv and install what is missing on first use. `make lint` runs ruff, the
# import-layer contracts, mypy over src/ and shellcheck (CI runs it before the tests);
# `make test-fast` the unit layer alone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.cpbench-installed

# The fake-GPU venv (make test-fake-gpu): a CUDA build of torch, needed for fake CUDA tensors
# (no GPU is used), apart from .venv so the main suite keeps the CPU build.
FG_VENV ?= .venv-fake-gpu
FG_STAMP := $(FG_VENV)/.cpbench-fake-gpu-installed

.PHONY: bench test test-fast test-gpu test-fake-gpu gpu-check lint install clean

$(STAMP): pyproject.toml scripts/ensure_torch.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	scripts/ensure_torch.sh $(PY)
	$(PY) -m pip install -q -e '.[test,lint]'
	touch $(STAMP)

install: $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/cpbench run --strategy all --nproc 4 --check

# pytest-xdist's workers: on 2 cores, 2 take about a third off the wall time (a test's ranks
# and subprocesses leave a core idle much of the time); worksteal: an idle worker takes tests
# queued on the other (the doc test's blocks, the longest, otherwise end on one); JOBS=0: one
# process
JOBS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) --dist worksteal

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) --dist worksteal -m "not multirank and not gpu and not slow"

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
	scripts/fake_gpu_venv.sh $(PYTHON) $(FG_VENV)
	touch $(FG_STAMP)

test-fake-gpu: $(FG_STAMP)
	CPBENCH_FAKE_GPU_VENV=1 $(FG_VENV)/bin/python -m pytest -q tests/fake_gpu

# What one GPU can show, in under 8 minutes, offline (docs/gpu-check.md): each step a
# subprocess under its own timeout; without a GPU the CUDA steps say "skipped: no CUDA".
# NO_VENV=1 (or VENV=): the machine's own $(PYTHON) and torch, nothing built or installed (an
# offline GPU box: `make gpu-check NO_VENV=1`; the fake-GPU venv's fake-CUDA steps: NO_VENV=1
# PYTHON=.venv-fake-gpu/bin/python); GPU_CHECK_FLAGS: more flags (e.g. --out DIR --compact).
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
	rm -rf $(VENV) $(FG_VENV) .pytest_cache
