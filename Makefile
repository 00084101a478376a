# Everything CI does is here; .ci/run calls these targets in a fresh venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install check test bench format

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'

check:
	$(BIN)/ruff format --check app tests bench
	$(BIN)/ruff check app tests bench
	$(BIN)/mypy

format:
	$(BIN)/ruff format app tests bench
	$(BIN)/ruff check --fix app tests bench

test:
	$(BIN)/pytest

bench:
	$(BIN)/python bench/bench_library.py
