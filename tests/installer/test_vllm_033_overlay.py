# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""vLLM 0.33.0, the version the images ship: install into a copy of its sources, then import
every overlay module from that tree and build the DSpark config path (EngineArgs -> VllmConfig
-> the DSpark proposer) against it, in a subprocess with the environment's CPU torch.

What a CPU machine cannot do with the 0.33.0 wheel (a CUDA build: no CPU kernels in it, and it
pins torch 2.14) is recorded in docs/installer.md; this test covers what it can."""

import os
import sys
from pathlib import Path

import pytest
import yaml
from installer_testlib import CACHE_033, REPO, copy_vllm_tree, run_installer, tiny_dspark_pair

from installer.errors import ExitCode
from tests.helpers import probe_report, start_probe

pytestmark = pytest.mark.multiproc  # the probe imports vLLM 0.33.0 in a subprocess


@pytest.fixture(scope="module")
def probe(pristine_033: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("vllm-0.33.0-installed")
    tree = copy_vllm_tree(pristine_033, root / "site")
    installed = run_installer(REPO, "--vllm-path", str(tree))
    assert installed.returncode == ExitCode.OK, installed.stderr
    target, draft = tiny_dspark_pair(root)
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CACHE_ROOT": str(root / "vllm-cache"),  # 0.32.0's model-info cache differs
        "HF_HUB_OFFLINE": "1",
        "VLLM_USE_V2_MODEL_RUNNER": "0",
    }
    script = Path(__file__).with_name("overlay_probe.py")
    command = [sys.executable, str(script), *(str(path) for path in (tree, REPO, target, draft))]
    report = probe_report(start_probe(command, env, root))
    report["tree"] = str(tree)
    return report


def test_the_probe_ran_the_0_33_0_tree(probe):
    assert probe["vllm"] == "0.33.0"
    assert probe["vllm_file"] == str(Path(probe["tree"]) / "vllm" / "__init__.py")
    assert probe["vllm_file"] != str(CACHE_033 / "vllm" / "__init__.py")


def test_every_overlay_module_imports_from_0_33_0(probe):
    overlay = yaml.safe_load((REPO / "recipe" / "pins.yaml").read_text())["overlay"]
    assert sorted(probe["imports"]) == sorted(overlay)
    failed = {path: error for path, error in probe["imports"].items() if error != "ok"}
    assert failed == {}


def test_the_dspark_config_path_builds_against_0_33_0(probe):
    assert "config_error" not in probe, probe["config_error"]
    assert probe["method"] == "dspark"
    assert probe["dspark_confidence_scheduler"] == "threshold"
    assert probe["proposer"] == "DSparkPagedProposer"  # the Qwen3 draft's proposer
    assert probe["scheduler"] == "threshold"
