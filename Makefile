# Thin wrappers: each target creates/uses .venv and installs the project first: the exact
# versions of requirements.lock, then ampflow itself with --no-deps, so nothing newer comes in.
# An installed torch of the lock's release (CPU or CUDA build) is kept: pip leaves a
# satisfied requirement alone. TORCH="<pip requirement>" installs that torch in place of the
# lock's line (a CUDA build, another release): make install TORCH="torch==2.13.0+cu126".
# `make lock` writes the lock anew from pyproject.toml's bounds (README: Versions).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ampflow-installed
LOCK := requirements.lock
TORCH ?=
# the throwaway virtualenv `make lock` resolves in
LOCK_VENV ?= $(VENV)-lock
DEMO_CELLS ?= 200
# pytest-xdist workers of `make test` (each test module, and the README's demo run with
# the tests reading it, stays in one worker; tests/conftest.py); 0 runs in this process
TEST_WORKERS ?= 2
CORES ?= all
# the demo's configuration (config/config.yaml is the template for your own data) and
# its `dataset`: outputs under results/$(DATASET)/
DEMO_CONFIG ?= config/demo.yaml
DATASET ?= demo

.PHONY: install lock demo demo-gpu test lint bench gpu-check clean-demo

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# the lock in one resolve (TORCH's requirement in place of its torch line), then ampflow
# alone; pip check fails when the lock no longer meets pyproject.toml's bounds
$(STAMP): pyproject.toml $(LOCK) | $(BIN)/python
	$(if $(TORCH),grep -v '^torch==' $(LOCK) > $(VENV)/lock-without-torch.txt)
	$(BIN)/python -m pip install -q $(if $(TORCH),"$(TORCH)" -r $(VENV)/lock-without-torch.txt,-r $(LOCK))
	$(BIN)/python -m pip install -q --no-deps -e .
	$(BIN)/python -m pip check
	@touch $@

install: $(STAMP)

# requirements.lock anew: a throwaway virtualenv gets ampflow[test] at the newest releases
# within pyproject.toml's bounds and the lock's torch (or TORCH's), and scripts/lock.py
# freezes it. Then: git diff requirements.lock, match envs/*.yaml, make test.
lock:
	rm -rf $(LOCK_VENV)
	$(PY) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install -q "$(or $(TORCH),$(shell grep -m1 '^torch==' $(LOCK) 2>/dev/null),torch)" -e ".[test]"
	$(LOCK_VENV)/bin/python scripts/lock.py $(LOCK)
	rm -rf $(LOCK_VENV)

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
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup

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
	$(BIN)/python scripts/bench_optimizer.py
	$(BIN)/python scripts/bench_determinism.py
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python scripts/bench_parallel.py

# on a GPU node: one line per check (environment, memory model vs the CUDA allocator,
# attention, training steps/s, the GPU tests but the slow ones); without a GPU one
# SKIP line and exit 0 (scripts/gpu_check.sh says more)
gpu-check: $(STAMP)
	PYTHON=$(BIN)/python bash scripts/gpu_check.sh

clean-demo:
	rm -rf results/demo results/demo-gpu resources/demo logs/demo logs/demo-gpu
