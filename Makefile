# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
# Everyday tasks; each runs in the pinned CPU environment that `make env` builds (.venv, vLLM
# 0.33.0; docs/vllm-versions.md), `make test` also in .venv-vllm-0.32.0.
# CONTRIBUTING.md says what each test tier covers.

PYTHON := .venv/bin/python
PYTEST := $(PYTHON) -m pytest
# Two workers (pytest-xdist), each taking whole test files so that module-scoped engines start
# once, in the order tests/conftest.py sorts them (slowest tier first) rather than xdist's (most
# tests first); PYTEST_ARGS adds options, e.g. PYTEST_ARGS=--durations=30.
XDIST := -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: help env install lint test-fast test dry-start demo

help:
	@echo "make env        build .venv (vLLM 0.33.0) and .venv-vllm-0.32.0, DSpark installed in both"
	@echo "make install    reinstall DSpark into both after changing overlay/ or patches/"
	@echo "make lint       ruff, ruff format, mypy, SPDX headers, shellcheck, hadolint"
	@echo "make test-fast  the unit tier (no vLLM engine, no Docker)"
	@echo "make test       the whole suite, as CI runs it"
	@echo "make dry-start  vLLM 0.33.0's start-up of PROFILE on DEVICE (gb10, b200, b300, rtx-pro-6000)"
	@echo "make demo       the CPU demo: DSpark against no speculation on tiny models"

env:
	bash scripts/setup-cpu-env.sh

install:
	$(PYTHON) tools/refresh_pins.py
	$(PYTHON) install.py
	.venv-vllm-0.32.0/bin/python install.py

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
	$(PYTHON) tools/check_spdx.py
	git ls-files -z '*.sh' .ci/run | xargs -0 .venv/bin/shellcheck
	git ls-files -z 'docker/*.Dockerfile' | xargs -0 .venv/bin/hadolint

test-fast:
	$(PYTEST) -m unit -q $(XDIST) $(PYTEST_ARGS)

test:
	$(PYTEST) $(XDIST) $(PYTEST_ARGS)
	.venv-vllm-0.32.0/bin/python -m pytest -m each_vllm $(XDIST) $(PYTEST_ARGS)

PROFILE ?= deepseek-v4-flash-2x-spark
DEVICE ?= gb10
dry-start:
	$(PYTHON) -m tools.dry_start --profile $(PROFILE) --device $(DEVICE)

demo:
	$(PYTHON) -m dspark_demo
