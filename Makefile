# The README's commands. Every target creates (or reuses) the virtual environment in .venv first.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and only when the venv has none: the CPU wheel where pip finds one on disk, the
# registry's build elsewhere. `make VENV_FLAGS=--system-site-packages` reuses a torch (e.g. CUDA) already installed.
TORCH_VERSION ?= 2.13.0
VENV_FLAGS ?=
CONFIG ?= conf/default.yaml
ARGS ?=
STAMP := $(VENV)/.installed

export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export TOKENIZERS_PARALLELISM := false
# No hub downloads unless asked for: `make run HF_HUB_OFFLINE=0 CONFIG=conf/examples/gpt2-hh.yaml`.
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= $(HF_HUB_OFFLINE)

PIP_QUIET := 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true

.PHONY: install run test lint bench ui mlflow-ui prefect-ui compare clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || { echo "installing torch==$(TORCH_VERSION)"; \
		$(PY) -m pip install -q "torch==$(TORCH_VERSION)" $(PIP_QUIET); }
	@echo "installing the project into $(VENV)"
	@$(PY) -m pip install -q -e ".[dev]" $(PIP_QUIET)
	@$(PY) -c "import torch, transformers, prefect, mlflow, rlhf" 
	@touch $@

run: $(STAMP)
	$(PY) -m flows.pipeline --config $(CONFIG) $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q $(ARGS)

bench: $(STAMP)
	$(PY) -m rlhf.bench $(ARGS)

mlflow-ui: $(STAMP)
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlruns/mlflow.db --host 127.0.0.1 --port 5000

prefect-ui: $(STAMP)
	$(VENV)/bin/prefect server start --host 127.0.0.1 --port 4200

clean:
	rm -rf outputs .prefect mlruns/mlflow.db mlruns/artifacts
