# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv on first use. TORCH picks the torch build: the default pins the CPU wheel
# these machines carry; on a CUDA machine use e.g. `make demo TORCH=torch` (or an index URL).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
# pytest-xdist workers of `make test`, each test file on one worker (module fixtures built once):
# 2 took the CPU suite from 9.9 to 7.3 minutes on a 2-core machine. 0 runs it in one process.
TEST_WORKERS ?= 2
BIN := $(VENV)/bin

.PHONY: demo test lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/megactx demo

lint: $(VENV)/.installed
	$(BIN)/ruff check megactx tests

test: $(VENV)/.installed lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) build *.egg-info
