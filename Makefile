# relay: `make serve` runs it on this machine; `make test` is what CI runs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: serve test lint format bench system-deps clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	@touch $@

$(VENV)/.dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@ $(VENV)/.base

system-deps:
	@bash scripts/system-deps.sh

serve: $(VENV)/.base
	@bash scripts/system-deps.sh serve
	$(BIN)/relay serve --dev

lint: $(VENV)/.dev
	$(BIN)/ruff check relay tests bench jobs
	$(BIN)/ruff format --check relay tests bench jobs
	$(BIN)/mypy
	$(BIN)/lint-imports

format: $(VENV)/.dev
	$(BIN)/ruff format relay tests bench jobs
	$(BIN)/ruff check --fix relay tests bench jobs

test: $(VENV)/.dev system-deps lint
	$(BIN)/pytest

bench: $(VENV)/.dev
	@bash scripts/system-deps.sh bench
	$(BIN)/python -m bench
	$(BIN)/python -m bench.leaks
	$(BIN)/python -m bench.promises --write

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
