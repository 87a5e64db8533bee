# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""After --uninstall, vLLM is stock again: its V1 runner refuses method "dspark",
which the installed environment accepts (the refusal is what the patches lift)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_fixtures.checkpoints import qwen3

# vLLM validates the config in subprocesses.
pytestmark = [pytest.mark.multiproc, pytest.mark.each_vllm]

VALIDATE_DSPARK_CONFIG = """
import sys
from vllm.engine.arg_utils import EngineArgs
EngineArgs(
    model=sys.argv[1],
    dtype="float32",
    max_model_len=256,
    speculative_config={"method": "dspark", "model": sys.argv[2], "num_speculative_tokens": 4},
).create_engine_config()
print("accepted")
"""


def validate_dspark_config(tmp_path: Path, pythonpath: str | None) -> subprocess.CompletedProcess:
    target = qwen3.build_qwen3_target(tmp_path / "target")
    draft = qwen3.save_dspark_draft(tmp_path / "draft", qwen3.DSparkDraftSpec())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    env.pop("PYTHONPATH", None)
    if pythonpath:
        # The 0.33.0 wheel's dist-info labels no CPU build: name the platform as upstream allows.
        env.update(PYTHONPATH=pythonpath, VLLM_TARGET_DEVICE="cpu")
    return subprocess.run(
        [sys.executable, "-c", VALIDATE_DSPARK_CONFIG, str(target), str(draft)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_installed_environment_accepts_dspark_on_v1(tmp_path: Path):
    result = validate_dspark_config(tmp_path, None)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "accepted" in result.stdout


def test_uninstalled_vllm_refuses_dspark_on_v1_again(pristine_running: Path, tmp_path: Path):
    # The running version's vLLM as its wheel ships it (for 0.32.0: the environment's after
    # install.py --uninstall), checked file by file against the wheel's RECORD.
    result = validate_dspark_config(tmp_path, str(pristine_running))
    assert result.returncode != 0
    assert "Model Runner V1 does not support: dspark speculative decoding" in result.stderr
