# Every target installs the project into .venv first if needed (from scratch on a fresh machine).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install check test bench demo format fuzz chaos

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

check: $(STAMP)
	$(BIN)/ruff format --check app tests bench examples
	$(BIN)/ruff check app tests bench examples
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format app tests bench examples
	$(BIN)/ruff check --fix app tests bench examples

# Coverage of app/ in this process (the e2e tests' subprocesses are not counted): ~86% now.
test: $(STAMP)
	$(BIN)/pytest --cov=app --cov-report=term:skip-covered --cov-fail-under=80

demo: $(STAMP)
	$(BIN)/inferproxy demo

bench: $(STAMP)
	$(BIN)/python bench/bench_library.py

# The long differential fuzz run of app/http against h11 (bench/README.md, "fuzz"): every divergence,
# shortest input first; `make test` runs a short one. FUZZ_EXAMPLES per side (server, client).
FUZZ_EXAMPLES ?= 20000
fuzz: $(STAMP)
	$(BIN)/python bench/fuzz_http.py --examples $(FUZZ_EXAMPLES)

# The chaos suite's long run (tests/chaos with the benchmark machine's counts: >= 20 kills, longer loads);
# `make test` runs its short one. A failure prints its seed: CHAOS_SEED=N repeats it.
chaos: $(STAMP)
	$(BIN)/pytest tests/chaos --chaos-long $(if $(CHAOS_SEED),--chaos-seed $(CHAOS_SEED))
