# Set-up and everyday commands. `make demo`, `make test` and `make test-all` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The test tiers are markers (pyproject.toml): cluster, parity, fault, net; engines (tests/conftest.py). The fast tier is
# everything else.
FAST_TIER := not (cluster or parity or fault or engines or net)
# Tests run in this many pytest processes (pytest-xdist); a test that waits on its nodes leaves the core to another.
PYTEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)  # every core: the tests that spawn processes mostly wait

# checkov, the static checker of the Kubernetes manifests (tests/integration/test_k8s_pods.py), in an environment of its
# own: its pins (packaging, networkx, boto3, ...) would move the project's. deploy/checkov-skips.yaml names the version.
CHECKOV_VENV := .venv-checkov
CHECKOV_VERSION := $(shell sed -n 's/^checkov: *//p' deploy/checkov-skips.yaml)

.PHONY: setup demo lint test test-all test-engines test-net slurm-packages bench clean

setup: $(VENV)/.installed

# torch is pinned to the CPU build that pip finds locally; a looser spec pulls a multi-GB CUDA build. pip compiles
# every module at install: where PYTHONDONTWRITEBYTECODE is set (CI), nothing else would, and each node process
# would compile torch again at its start.
$(VENV)/.installed: pyproject.toml setup.py src/paramserver/base/_kernels.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

$(CHECKOV_VENV)/.installed: deploy/checkov-skips.yaml
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q checkov==$(CHECKOV_VERSION)
	touch $@

demo: setup
	$(BIN)/paramserver demo

# ruff (lint + format), mypy and the import layers (lint-imports) on src/, configured in pyproject.toml;
# both tiers start with it.
lint: setup
	$(BIN)/ruff check src
	$(BIN)/ruff format --check src
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m paramserver.launch.cli.docs --check docs/cli.md docs/configuration.md

# The fast tier, for every edit: no test starts a process (tests/conftest.py refuses it); about a minute (under 2).
test: lint
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -m "$(FAST_TIER)" tests/unit

# Every tier: what CI runs (.ci/run, .ci/under-load). The set-up steps run side by side (checkov's environment,
# Slurm's packages, the venv; lint after them, as pip rewrites the editable install lint imports), and the
# engines tier (one pytest process: one Slurm and one Ray cluster per machine, mostly waiting on them) beside
# the other tiers, its output kept until theirs ends.
test-all:
	$(MAKE) -j3 $(CHECKOV_VENV)/.installed $(VENV)/.engines slurm-packages
	$(MAKE) lint
	@$(BIN)/python -m pytest -q -rs -p no:cacheprovider -m engines tests/engines > .engines-tier.log 2>&1 & \
	engines=$$!; \
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal --durations=15 -m "not engines and not net"; \
	main=$$?; wait $$engines; tier=$$?; echo "--- the engines tier (tests/engines) ---"; cat .engines-tier.log; \
	rm -f .engines-tier.log; \
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider -m net tests/net; net=$$?; \
	test $$main -eq 0 && test $$tier -eq 0 && test $$net -eq 0

# What the engines tier installs: the `ray` extra, and Slurm's Debian packages (apt; root only: without them
# the Slurm tests are skipped, saying why). Apt needs no venv: it runs beside the venv's set-up.
$(VENV)/.engines: $(VENV)/.installed pyproject.toml
	$(BIN)/pip install -q -e '.[test,ray]'
	touch $@

slurm-packages:
	-bash tests/engines/slurm_cluster.sh install > /dev/null

# The net tier alone: the emulated network of bench/net/ (root: network namespaces and tc; skipped without).
# In test-all it runs after the others: a link's rate check cannot share the cores.
test-net: lint
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider -m net tests/net

# The engines tier alone: a real Slurm cluster (network namespaces, so root) and a real Ray cluster.
test-engines: lint $(VENV)/.engines slurm-packages
	$(BIN)/python -m pytest -q -rs --durations=10 -m engines tests/engines

bench: setup
	$(BIN)/python bench/dense.py

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) build src/*.egg-info src/paramserver/base/_kernels*.so
