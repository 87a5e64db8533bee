# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The dry start's tests run on the vLLM the images ship (0.33.0): its wheel's Python with DSpark
installed (`tools/dry_start/environment.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ignored_errors
from tools.dry_start import environment

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def vllm_033() -> dict[str, str]:
    """The environment that runs Python with vLLM 0.33.0 (DSpark installed) first on the path."""
    return {**os.environ, "PYTHONPATH": str(environment.ensure())}


@pytest.fixture(scope="session")
def dry_start(vllm_033):
    """`python -m tools.dry_start ARGS` on vLLM 0.33.0, run once per set of arguments in the
    session: (exit status, stdout lines, the JSON report with `--json`)."""
    runs: dict[tuple[str, ...], tuple[int, list[str], dict | None]] = {}

    def run(*args: str) -> tuple[int, list[str], dict | None]:
        if args not in runs:
            result = subprocess.run(
                [sys.executable, "-m", "tools.dry_start", *args],
                cwd=REPO,
                env=vllm_033,
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
            lines = result.stdout.strip().splitlines()
            assert lines, result.stderr[-3000:]
            if result.returncode == 0:  # a healthy start swallows no error
                assert ignored_errors(result.stdout + result.stderr) == [], args
            report = json.loads(lines[-1]) if "--json" in args else None
            runs[args] = (result.returncode, lines, report)
        return runs[args]

    return run
