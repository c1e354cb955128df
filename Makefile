# splitkv: one-command set-up and runs. `make demo` and `make test` work on a
# fresh machine with Python >= 3.10 and make.
#
# The first run creates the virtual environment .venv and installs into it;
# later runs reuse it, and run pip again only when pyproject.toml has changed
# since (stamp files in .venv record what was installed). `make reinstall`
# forces a fresh install, e.g. after changing TORCH.
PYTHON ?= python3
VENV   ?= .venv
# PyTorch, pinned: on a machine without CUDA pip may then take a local CPU-only
# wheel of that release where one is provided (a plain `torch` requirement
# would fetch a multi-GB CUDA build). On a GPU machine whose Python already
# has PyTorch, keep it:  make demo TORCH= VENV_FLAGS=--system-site-packages
TORCH  ?= torch==2.13.0
# SGLang, pinned, without its dependencies (it is pure Python and nothing imports it): the tests read its
# Triton extend kernel out of it and compare splitkv with it at SGLang's own call site. The release
# splitkv.integrations.sglang was written against.
SGLANG ?= sglang==0.5.10.post1
VENV_FLAGS ?=
BIN    := $(VENV)/bin
# Without a GPU the kernels run through Triton's interpreter, which needs the
# `interpreter` extra (an older NumPy); a GPU machine keeps its NumPy.
CORE_EXTRA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo . || echo .[interpreter])
# Stamps: the package (+ torch), the package with the benchmark's tools (the
# dev extra: pytest, hypothesis, matplotlib, tqdm), the package with every extra, and
# SGLang by its pin (a new pin installs again).
CORE_STAMP  := $(VENV)/.installed-core
BENCH_STAMP := $(VENV)/.installed-bench
ALL_STAMP   := $(VENV)/.installed-all
# Triton 3.6 (the H200's), installed aside for the Gluon kernel's CPU compile check
# (tests/test_gluon_compile.py); the package never imports it.
TRITON36    := $(VENV)/triton36
SGLANG_STAMP := $(VENV)/.installed-$(subst ==,-,$(SGLANG))

.PHONY: demo test docs notebooks bench validate check-gpu setup setup-all reinstall

$(BIN)/activate:
	@echo ">> Creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip

$(CORE_STAMP): pyproject.toml | $(BIN)/activate
	@echo ">> Installing splitkv, PyTorch and Triton into $(VENV) (quiet; about a minute the first time)"
	$(BIN)/python -m pip install -q $(TORCH) -e "$(CORE_EXTRA)"
	@touch $@

$(ALL_STAMP): pyproject.toml | $(BIN)/activate
	@echo ">> Installing splitkv with its test, notebook and docs tools into $(VENV) (quiet; 1-2 minutes the first time)"
	$(BIN)/python -m pip install -q $(TORCH) -e ".[dev,notebooks,docs]"
	@$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $@ $(CORE_STAMP) $(BENCH_STAMP)

$(SGLANG_STAMP): | $(BIN)/activate
	@echo ">> Installing $(SGLANG) into $(VENV), without its dependencies"
	$(BIN)/python -m pip install -q --no-deps $(SGLANG)
	@touch $@

$(BENCH_STAMP): pyproject.toml | $(BIN)/activate
	@echo ">> Installing splitkv with the benchmark's tools into $(VENV) (quiet; about a minute the first time)"
	$(BIN)/python -m pip install -q $(TORCH) -e ".[dev]"
	@touch $@ $(CORE_STAMP)

## Install the package (and PyTorch) into .venv; a no-op when up to date.
setup: $(CORE_STAMP)

## Install the package with every extra (tests, notebooks, docs) and SGLang (for the tests) into .venv.
setup-all: $(ALL_STAMP) $(SGLANG_STAMP)

## Run pip again now, whatever the stamps say (e.g. after changing TORCH).
reinstall:
	@if [ -e $(ALL_STAMP) ]; then rm -f $(CORE_STAMP) $(BENCH_STAMP) $(ALL_STAMP); $(MAKE) --no-print-directory setup-all; \
	elif [ -e $(BENCH_STAMP) ]; then rm -f $(CORE_STAMP) $(BENCH_STAMP); $(MAKE) --no-print-directory $(BENCH_STAMP); \
	else rm -f $(CORE_STAMP); $(MAKE) --no-print-directory setup; fi

## The demo: split-KV against the float64 oracle and the baseline, with times
## (CPU: Triton interpreter, small shapes, 1-2 minutes; GPU: real shapes).
demo: $(CORE_STAMP)
	$(BIN)/python -m splitkv demo

## Every test: unit/property tests (tests/test_notebooks_course.py among them runs every notebook with its
## exercises solved, SPLITKV_SOLUTIONS=1, and requires each to pass), the notebooks under nbval as stored
## (the learner's state: stubs, waiting exercises), the docs build and the browser check.
test: $(ALL_STAMP) $(SGLANG_STAMP) triton36
	$(BIN)/python -m pytest -q tests --ignore=tests/browser
	SPLITKV_SOLUTIONS=0 $(BIN)/python -m pytest -q --nbval notebooks --nbval-sanitize-with notebooks/nbval_sanitize.cfg
	$(BIN)/mkdocs build --strict
	$(BIN)/python -m pytest -q tests/browser

## Triton 3.6 in .venv/triton36 (once; without a network the check that uses it is skipped).
triton36: | $(BIN)/activate
	@[ -e $(TRITON36)/.installed ] || { echo ">> Installing Triton 3.6 aside into $(TRITON36) (once)"; \
	  $(BIN)/python -m pip install -q --no-deps --target $(TRITON36) triton==3.6.0 && touch $(TRITON36)/.installed \
	  || echo ">> Triton 3.6 unavailable: its compile check will be skipped"; }

## Open the tutorial notebooks in JupyterLab (it prints the address to open).
notebooks: $(ALL_STAMP)
	$(BIN)/jupyter lab notebooks

## Build the docs site and serve it on http://127.0.0.1:8000
docs: $(ALL_STAMP)
	$(BIN)/mkdocs serve

## The benchmark (GPU only): writes figures/benchmark_<gpu>.json and .md and the plots.
## Checks for a GPU first, then installs only what the benchmark needs.
bench: check-gpu
	@$(MAKE) --no-print-directory $(BENCH_STAMP)
	$(BIN)/python -m splitkv.bench

## Re-validate the package on a GPU (about 8 minutes): every test in parallel processes, compute-sanitizer,
## the golden outputs, host times and the quick benchmark against the committed records (figures/validation_<gpu>/).
validate: check-gpu
	@$(MAKE) --no-print-directory $(BENCH_STAMP)
	$(BIN)/python -m splitkv.bench.validate

# An NVIDIA GPU (nvidia-smi lists one) or an AMD one (/dev/kfd, ROCm), else stop at once.
check-gpu:
	@if nvidia-smi -L >/dev/null 2>&1 || [ -e /dev/kfd ]; then :; else \
	echo "make $(MAKECMDGOALS) needs a GPU (nvidia-smi finds none here). On a CPU, make demo runs the kernels" \
	     "through Triton's interpreter; the H200 results are in figures/benchmark_h200.md."; exit 1; fi
