# moeflow — developer and reproduction recipes.
#   make setup   create .venv and install moeflow with its test dependencies, at the versions in requirements.lock
#   make lock    re-resolve requirements.lock in a fresh virtualenv (newest versions pyproject.toml allows)
#   make test    the CPU test suite (GPU and slow tests are marked and skipped)
#   make gpu-check [QUICK=1]   every `gpu` test and the GPU benchmarks: one table, one JSON line (exits 0 with "no CUDA device" without one)
#   make lint    ruff (lint + format check), mypy and the layering contract (lint-imports), configured in pyproject.toml
#   make docs    regenerate docs/cli.md (from the typer app) and docs/results/*.md (from benchmarks/results/*.json)
#   make reproduce-<paper> [QUICK=1] [DEVICE=cuda]   re-make a paper's tables into reports/<paper>/
#   make reproduce-all     every paper (`make -k` keeps going past a recipe with a failed step)
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# torch: 2.13.0 is a CPU wheel on the project's build machines and the CUDA wheel from PyPI elsewhere.
# Override for another build, e.g. `make setup TORCH='torch==2.14.1'` (it replaces the lock's torch pin).
TORCH   ?= torch==2.13.0
LOCK    ?= requirements.lock
DATA    ?= ../shared/data
MODEL   ?= models/olmoe-deep
# reproduction recipes (recipes/reproduce/<paper>.py): QUICK=1 is <= 10 min each on 2 CPU cores; DEVICE=cuda uses the GPU
RECIPES := expertflow casmoe moe-gps speculating-experts specmd
REPRODUCE := $(addprefix reproduce-,$(RECIPES))
QUICK   ?=
DEVICE  ?= cpu
REPRO_FLAGS = $(if $(filter 1 yes true,$(QUICK)),--quick) --device $(DEVICE) --model $(MODEL) --data-dir $(DATA)

.PHONY: setup lock test test-slow test-gpu gpu-check lint docs models bench clean-artifacts reproduce-all $(REPRODUCE)

# Every install is constrained by the lock (with its torch pin replaced by $(TORCH)), so a fresh clone gets what CI tested.
setup:
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	grep -v '^torch==' $(LOCK) > $(VENV)/constraints.txt
	echo "$(TORCH)" >> $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt pip
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt "$(TORCH)"
	DISABLE_CUDA=1 $(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e ".[dev]"   # DISABLE_CUDA: hqq's sdist skips its optional CUDA kernels
	$(BIN)/python -m pip check
	$(BIN)/python -c 'from moeflow.runtime.cachecore import warm; print(f"cache core kernels ready in {warm():.0f} s")'   # numba compiles them once (cached beside the sources)
	$(BIN)/moeflow --version

# A fresh resolution into requirements.lock; check it with `make setup lint test` before committing it.
LOCKVENV := .lock-venv
lock:
	rm -rf $(LOCKVENV) && $(PY) -m venv $(LOCKVENV)
	$(LOCKVENV)/bin/python -m pip install -q --upgrade pip
	$(LOCKVENV)/bin/python -m pip install -q "$(TORCH)"
	DISABLE_CUDA=1 $(LOCKVENV)/bin/python -m pip install -q -e ".[dev]"
	{ sed -n '/^#/p' $(LOCK); $(LOCKVENV)/bin/python -m pip freeze --all --exclude-editable \
	  | grep -v '^moeflow' | sed -E 's/^(torch==[^+]*)\+.*/\1/'; } > $(LOCK).tmp
	mv $(LOCK).tmp $(LOCK)
	rm -rf $(LOCKVENV)
	@echo "wrote $(LOCK); now: make setup lint test"

test:
	$(BIN)/python -m pytest -q -m "not slow and not gpu" tests

lint:
	$(BIN)/ruff check moeflow tests benchmarks recipes
	$(BIN)/ruff format --check moeflow tests benchmarks recipes
	$(BIN)/mypy
	$(BIN)/lint-imports

test-slow:
	$(BIN)/python -m pytest -q -m "slow" tests

test-gpu:
	$(BIN)/python -m pytest -q -m "gpu" tests

# `pytest -m gpu` and the GPU benchmarks (benchmarks/gpu_check.py); logs and gpu-check.json in reports/gpu-check/
gpu-check:
	$(BIN)/python benchmarks/gpu_check.py --model $(MODEL) $(if $(filter 1 yes true,$(QUICK)),--quick)

models:
	$(BIN)/python recipes/train_models.py --data-dir $(DATA) --out models --minutes 50 --only olmoe-mini & \
	$(BIN)/python recipes/train_models.py --data-dir $(DATA) --out models --minutes 50 --only mixtral-mini & \
	wait
	$(BIN)/python recipes/train_models.py --data-dir $(DATA) --out models --minutes 70 --lr 2e-3 --only olmoe-deep

docs:
	$(BIN)/python -m moeflow.cli.docs
	$(BIN)/python benchmarks/render_results.py render

bench:
	$(BIN)/python benchmarks/trace_overhead.py --model $(MODEL)
	$(BIN)/python benchmarks/offload.py --model $(MODEL)

reproduce-all: $(REPRODUCE)

$(REPRODUCE): reproduce-%:
	$(BIN)/python -m recipes.reproduce $* $(REPRO_FLAGS)
