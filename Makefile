# Two entry points a new user needs: `make bench` (the main job) and `make test`.
# Both create .venv and install what is missing on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.cpbench-installed

.PHONY: bench test install clean

$(STAMP): pyproject.toml scripts/ensure_torch.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	scripts/ensure_torch.sh $(PY)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/cpbench run --strategy all --nproc 4 --check

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
