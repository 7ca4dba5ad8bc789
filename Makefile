# relay: `make serve` runs it on this machine; `make test` is what CI runs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Every dependency pinned (the dev extra's whole tree): with warnings as errors, a new release
# of any of them must not change what `make test` and CI run. `make lock` refreshes it.
LOCK   := requirements/dev.lock
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: serve test check lint format bench system-deps lock clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.base: pyproject.toml $(LOCK) | $(BIN)/python
	$(BIN)/pip install -q -c $(LOCK) -e .
	@touch $@

$(VENV)/.dev: pyproject.toml $(LOCK) | $(BIN)/python
	$(BIN)/pip install -q -c $(LOCK) -e '.[dev]'
	@touch $@ $(VENV)/.base

# The newest releases pyproject.toml allows, resolved in a throwaway venv and written down;
# the package itself is left out (--exclude-editable). Review the diff, run `make test`, commit.
lock:
	rm -rf $(VENV)-lock
	$(PYTHON) -m venv $(VENV)-lock
	$(VENV)-lock/bin/pip install -q -e '.[dev]'
	{ sed -n '/^#/p' $(LOCK); $(VENV)-lock/bin/pip freeze --exclude-editable; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf $(VENV)-lock

system-deps:
	@bash scripts/system-deps.sh

serve: $(VENV)/.base
	@bash scripts/system-deps.sh serve
	$(BIN)/relay serve --dev

lint: $(VENV)/.dev
	$(BIN)/ruff check relay testing tests bench jobs
	$(BIN)/ruff format --check relay testing tests bench jobs
	$(BIN)/mypy
	$(BIN)/lint-imports

format: $(VENV)/.dev
	$(BIN)/ruff format relay testing tests bench jobs
	$(BIN)/ruff check --fix relay testing tests bench jobs

# The suite runs in worker processes (pytest-xdist): most tests wait on sandboxes, restarts
# and timeouts more than they compute, so more workers than the machine's 2 cores. Tests
# that share a module's relay stay in one worker; slow ones start first (tests/parallel.py).
TEST_WORKERS ?= 4
PARALLEL := -n $(TEST_WORKERS) --dist loadgroup
# Each worker imports the suite, and pytest rewrites every test module's asserts: about half
# of a worker's start (~7 of ~14 s of CPU) that the bytecode cache saves from the second run
# on. So pytest writes it (__pycache__/, ignored by git) even where PYTHONDONTWRITEBYTECODE is set.
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/pytest

# The 25 longest tests (over 5 s) are listed at the end: where the suite's time goes, for
# keeping `make test` within its 15 minutes as it grows.
test: $(VENV)/.dev system-deps lint
	$(PYTEST) $(PARALLEL) --durations=25 --durations-min=5

# The inner loop (target: 2 minutes; README.md says what it measured): lint, types, and the
# tests that need no PostgreSQL, no browser, no Node, no relay process and no long waits.
# `make test` (and CI) runs everything.
# Its tests wait on short timeouts more than the whole suite's: 6 workers.
CHECK_WORKERS ?= 6

check: $(VENV)/.dev lint
	$(PYTEST) -n $(CHECK_WORKERS) --dist loadgroup -m "not (postgres or browser or node or slow)"

bench: $(VENV)/.dev
	@bash scripts/system-deps.sh bench
	$(BIN)/python -m bench
	$(BIN)/python -m bench.leaks
	$(BIN)/python -m bench.promises --write
	$(BIN)/python -m bench.pools --write
	$(BIN)/python -m bench.routes --write
	$(BIN)/python -m bench.mcp_calls --write

clean:
	rm -rf $(VENV) $(VENV)-lock .pytest_cache .mypy_cache .ruff_cache
