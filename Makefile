# lora-pipeline: every target installs what it needs, once (stamp keyed on pyproject.toml).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch lies on local disk on our dev/CI machines; on a GPU machine set
# TORCH_SPEC to the CUDA build you want (e.g. TORCH_SPEC='torch==2.11.0').
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.setup-$(shell cat pyproject.toml | sha256sum | cut -c1-16)

export AXOLOTL_DO_NOT_TRACK=1
export HF_HUB_OFFLINE=1
export WANDB_MODE=disabled
export TOKENIZERS_PARALLELISM=false

.PHONY: setup demo test test-fast lint fleet-env sysdeps clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	@rm -f $(VENV)/.setup-*
	@touch $@
	@echo "setup done: $(VENV)"

demo: setup
	$(VENV)/bin/pipeline demo
	@echo "the CLI is $(VENV)/bin/pipeline: 'source $(VENV)/bin/activate' puts 'pipeline' on PATH"

test: setup fleet-env sysdeps
	$(VENV)/bin/pytest -q -n 2 --dist loadfile --no-loadscope-reorder

test-fast: setup
	$(VENV)/bin/pytest -q -m "not slow and not fleet"

lint: setup
	$(VENV)/bin/ruff check pipeline tests benchmarks scripts
	$(VENV)/bin/ruff format --check pipeline tests benchmarks scripts

# PostgreSQL and chromium for the registry tests (root + apt only; tests skip without them).
sysdeps:
	@bash scripts/ci_deps.sh

# A separate virtualenv with vLLM's CPU build (it pins its own torch): never the pipeline's.
fleet-env:
	bash scripts/fleet_env.sh

clean:
	rm -rf .state adapters/runs adapters/volume .pytest_cache
