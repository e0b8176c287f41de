# Set-up and everyday commands. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast bench clean

setup: $(VENV)/.installed

# torch is pinned to the CPU build that pip finds locally; a looser spec pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

demo: setup
	$(BIN)/paramserver demo

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

bench: setup
	$(BIN)/python bench/dense.py

clean:
	rm -rf $(VENV) build src/*.egg-info src/paramserver/base/_kernels*.so
