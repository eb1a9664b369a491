# Two entry points a new user needs: `make bench` (the main job) and `make test`.
# Both create .venv and install what is missing on first use. `make lint` runs ruff, the
# import-layer contracts and shellcheck (CI runs it before the tests); `make test-fast` the
# unit layer alone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.cpbench-installed

.PHONY: bench test test-fast test-gpu lint install clean

$(STAMP): pyproject.toml scripts/ensure_torch.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	scripts/ensure_torch.sh $(PY)
	$(PY) -m pip install -q -e '.[test,lint]'
	touch $(STAMP)

install: $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/cpbench run --strategy all --nproc 4 --check

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not multirank and not gpu"

# the GPU-marked tests (tests/gpu and a few unit ones): on a machine with 2 or more GPUs,
# flash-attn installed (pip install -e '.[gpu]')
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/lint-imports
	$(VENV)/bin/shellcheck src/cpbench/slurm/cpbench.sbatch scripts/ensure_torch.sh .ci/run

clean:
	rm -rf $(VENV) .pytest_cache
