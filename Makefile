# `make demo` and `make test` each build the virtual environment from nothing, then run.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.prunetool-installed
# torch first, pinned to the CPU build this machine carries, so no multi-GB CUDA wheel is pulled.
TORCH ?= torch==2.13.0

.PHONY: setup engines demo test test-fast bench docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

# vLLM's CPU build (a venv of its own) and llama.cpp built from PyPI's llama-cpp-python sources, cached in
# ~/.cache/prunetool/engines (PRUNETOOL_ENGINES): minutes the first time, seconds after. Tests marked
# `engines` use them and skip, saying why, where they are absent.
engines:
	bash engines/setup.sh all

# The demo needs neither internet nor a data folder: eval then runs the hop probes and held-out perplexity.
# The repair is short so the demo stays within minutes: the patch is fitted on the 16 selection windows
# (8k tokens; 64k by default), and heal trains on the 4k generated tokens after prune's held-out windows.
demo: setup
	$(BIN)/prunetool models
	$(BIN)/prunetool score smollm2-135m --output-file demo-scores.json --plot demo-scores.png
	$(BIN)/prunetool heads smollm2-135m --kv-budget 128 --output-dir demo-heads --force
	$(BIN)/prunetool prune --drop 6 --patch --patch-windows 16 --output-dir demo-pruned --force --plot demo-prune.png
	$(BIN)/prunetool heal --tokens 4096 --seq-len 256 --batch-size 4 --output-dir demo-healed --force
	$(BIN)/prunetool eval --limit 10 --output-file demo-eval.json

test: setup engines
	$(BIN)/python -m pytest -q -ra

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

bench: setup
	$(BIN)/python bench/score_overhead.py

# Results tables in docs/ and README.md, and docs/quality.png, from bench/results/*.json; runs no model.
docs: setup
	$(BIN)/python -c "import matplotlib" 2>/dev/null || $(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/python bench/render_docs.py

clean:
	rm -rf $(VENV) .pytest_cache demo-scores.json demo-scores.png demo-heads demo-pruned demo-healed demo-prune.png demo-eval.json
