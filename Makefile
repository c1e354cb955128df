# splitkv: one-command set-up and runs. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
# torch 2.13.0 resolves to the CPU build kept on this project's machines. On a
# GPU machine whose Python already has torch, keep it:
#   make demo TORCH= VENV_FLAGS=--system-site-packages
TORCH  ?= torch==2.13.0
VENV_FLAGS ?=
BIN    := $(VENV)/bin

.PHONY: demo test test-py test-notebooks docs docs-build serve-docs bench setup setup-all

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/activate
	$(BIN)/pip install -q $(TORCH) -e .

setup-all: $(BIN)/activate
	$(BIN)/pip install -q $(TORCH) -e ".[dev,notebooks,docs]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null

## The main job: parity and timing table (interpreter at small shapes on a CPU, real shapes on a GPU).
demo: setup
	$(BIN)/python -m splitkv demo

## Every test: unit/property tests, notebooks under nbval, the docs build and the browser check.
test: setup-all
	$(BIN)/python -m pytest -q tests --ignore=tests/browser
	$(BIN)/python -m pytest -q --nbval notebooks
	$(BIN)/mkdocs build --strict --quiet
	$(BIN)/python -m pytest -q tests/browser

## Build the docs site and serve it on http://127.0.0.1:8000
docs: setup-all
	$(BIN)/mkdocs serve

## The benchmark (GPU only): writes figures/benchmark_h200.json and the plots.
bench: setup-all
	$(BIN)/python -m splitkv.bench
