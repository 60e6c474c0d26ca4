# Thin wrappers: each target creates/uses .venv and installs the project first.
# An already installed torch (CPU or CUDA build) is kept: pip leaves a satisfied
# requirement alone. To choose one explicitly: make test TORCH="torch==2.13.0".
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ampflow-installed
TORCH ?=
DEMO_CELLS ?= 200
CORES ?= all
# the demo's configuration (config/config.yaml is the template for your own data) and
# its `dataset`: outputs under results/$(DATASET)/
DEMO_CONFIG ?= config/demo.yaml
DATASET ?= demo

.PHONY: install demo demo-gpu test lint bench gpu-check clean-demo

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	@if [ -n "$(TORCH)" ]; then $(BIN)/python -m pip install -q "$(TORCH)"; fi
	$(BIN)/python -m pip install -q -e ".[test]"
	@touch $@

install: $(STAMP)

# the workflow, then its HTML report (a zip: unzip it and open report/report.html), then
# the per-configuration summary table once more, as the last lines of the log
demo: $(STAMP)
	$(BIN)/ampflow demo-data resources/demo --cells $(DEMO_CELLS) --seed 0
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --profile profiles/local --configfile $(DEMO_CONFIG) --cores $(CORES)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --profile profiles/local --configfile $(DEMO_CONFIG) --report results/$(DATASET)/report.zip
	@echo "Report: results/$(DATASET)/report.zip (unzip it and open report/report.html in a browser)"
	@echo "Summary (results/$(DATASET)/figures/summary.tsv):"
	@cat results/$(DATASET)/figures/summary.txt

# the same demo planned for this machine's GPUs (config/demo-gpu.yaml: train.device
# cuda, one process per visible GPU); without a GPU it stops before any job
demo-gpu:
	$(MAKE) demo DEMO_CONFIG=config/demo-gpu.yaml DATASET=demo-gpu

test: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest

# the workflow (snakemake --lint, snakefmt), the package (ruff, configured in
# pyproject.toml) and its layers (import-linter's contracts in pyproject.toml)
lint: $(STAMP)
	@# the demo's config names its inputs, which the workflow reads when it is parsed
	test -f resources/demo/cells.tsv || $(BIN)/ampflow demo-data resources/demo --cells $(DEMO_CELLS) --seed 0
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --lint --configfile $(DEMO_CONFIG)
	$(BIN)/snakefmt --check workflow/
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts
	$(BIN)/lint-imports
	$(BIN)/python scripts/import_layers.py --check

bench: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python scripts/bench_prepare.py
	$(BIN)/python scripts/bench_attention.py
	$(BIN)/python scripts/bench_extract.py
	$(BIN)/python scripts/bench_profile.py
	$(BIN)/python scripts/bench_memory_model.py
	$(BIN)/python scripts/bench_train.py
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python scripts/bench_parallel.py

# on a GPU node: one line per check (environment, memory model vs the CUDA allocator,
# attention, training steps/s, pytest -m gpu), under 8 minutes; without a GPU one
# SKIP line and exit 0 (scripts/gpu_check.sh says more)
gpu-check: $(STAMP)
	PYTHON=$(BIN)/python bash scripts/gpu_check.sh

clean-demo:
	rm -rf results/demo results/demo-gpu resources/demo logs/demo logs/demo-gpu
