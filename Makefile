# pd-proxy: the two commands are `make demo` and `make test`; everything they need is set up here.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
MODEL_DIR ?= .cache/tiny-llama
PY := $(VENV)/bin/python
export PD_VLLM_VENV := $(abspath $(VLLM_VENV))
export PD_MODEL_DIR := $(abspath $(MODEL_DIR))

.PHONY: all venv vllm model prometheus lint test test-fast demo up clean

all: test

# The project's own environment (editable install with the dev extras). Redone only when
# pyproject.toml changes.
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check --upgrade pip
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

# The real vLLM runtime (CPU build + NIXL), apart from the project's environment. The script is
# idempotent: a second run sees the finished environment and does nothing.
vllm:
	bash workers/install_vllm.sh $(VLLM_VENV)

# The tiny local Llama (tokenizer + random weights), built deterministically; skipped when present.
model: venv
	$(PY) -m workers.model build --out $(MODEL_DIR)

# Prometheus for `make up` and the local-stack test: Debian's package where the machine allows
# (idempotent; prints SKIPPED with the reason otherwise, never fails).
prometheus:
	bash deploy/install_prometheus.sh

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy .

# Everything: lint, unit, simulator-backed and real-vLLM end-to-end tests.
test: venv vllm model prometheus lint
	$(PY) -m pytest

# Without the real-vLLM end-to-end tests.
test-fast: venv lint
	$(PY) -m pytest -m 'not vllm'

demo: venv vllm model
	$(PY) -m deploy.demo --model $(MODEL_DIR)

# The whole stack in the foreground: real vLLM prefill + decode on CPU, pd-proxy, and Prometheus
# scraping them (Debian's package is installed first when the machine allows; skipped with a note
# otherwise). Prints every URL; Ctrl-C stops everything. Options go in UP_ARGS, e.g.
#   make up UP_ARGS='--workers sim'     (pd-sim workers: up in seconds)
#   make up UP_ARGS='--decode 2 --port 8080'
up: venv vllm model prometheus
	$(PY) -m deploy.local --model $(MODEL_DIR) $(UP_ARGS)

clean:
	rm -rf $(VENV) .cache .mypy_cache .ruff_cache .pytest_cache
