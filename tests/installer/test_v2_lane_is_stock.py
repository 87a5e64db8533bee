# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""With Model Runner V2 selected, vLLM with DSpark installed is stock vLLM: the same config,
the same scheduler and KV-cache manager, the same prefix-cache hit, the same V2 DSpark
speculator and the same refusals, and not one overlay module imported on the way.

Each version's pristine tree and an installed copy of it run `v2_lane_probe.py` in
subprocesses (side by side) with the environment's CPU torch; vLLM's V2 runner itself needs
CUDA and Triton, so the probe stops before it (docs/lanes.md)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from installer.errors import ExitCode
from tests.helpers import probe_report, start_probe
from tests.installer.installer_testlib import REPO, copy_vllm_tree, run_installer, tiny_dspark_pair

PROBE = Path(__file__).with_name("v2_lane_probe.py")
# Fields the installed SpeculativeConfig adds (the V1 proposer's options); V2 refuses them.
V1_ONLY_FIELDS = {
    "dspark_confidence_scheduler": "off",
    "dspark_confidence_threshold": None,
    "dspark_draft_log": None,
    "dspark_draft": None,  # the V1 draft spec, which V2 never builds
}


def start_v2_probe(tree: Path, root: Path, target: Path, draft: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_USE_V2_MODEL_RUNNER": "1",
    }
    command = [sys.executable, str(PROBE), str(tree), str(REPO), str(target), str(draft)]
    return start_probe(command, env, root)


# Each probe builds vLLM's V2 config, scheduler and speculator in a subprocess.
pytestmark = pytest.mark.multiproc


@pytest.fixture(
    scope="module",
    params=[("0.32.0", "pristine_032"), ("0.33.0", "pristine_033")],
    ids=lambda param: param[0],
)
def probes(request, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    version, pristine_fixture = request.param
    pristine = request.getfixturevalue(pristine_fixture)
    root = tmp_path_factory.mktemp(f"v2-lane-{version}")
    installed = copy_vllm_tree(pristine, root / "installed" / "site")
    result = run_installer(REPO, "--vllm-path", str(installed))
    assert result.returncode == ExitCode.OK, result.stderr
    target, draft = tiny_dspark_pair(root)
    running = {}
    for name, tree in (("stock", pristine), ("installed", installed)):
        (root / name).mkdir(exist_ok=True)
        running[name] = start_v2_probe(tree, root / name, target, draft)
    reports = {name: probe_report(process) for name, process in running.items()}
    for name, tree in (("stock", pristine), ("installed", installed)):
        assert reports[name]["vllm"] == version
        assert reports[name]["vllm_file"] == str(tree / "vllm" / "__init__.py")
    return reports


def test_the_probe_selected_model_runner_v2(probes):
    assert probes["stock"]["config"]["use_v2_model_runner"] is True
    assert probes["stock"]["speculator"]["class"] == "DSparkSpeculator"


def test_the_v2_config_is_stock(probes):
    stock, installed = probes["stock"], probes["installed"]
    assert installed["config"] == stock["config"]
    added = set(installed["speculative_fields"]) - set(stock["speculative_fields"])
    assert {name: installed["speculative_fields"][name] for name in added} == V1_ONLY_FIELDS
    shared = {name: installed["speculative_fields"][name] for name in stock["speculative_fields"]}
    assert shared == stock["speculative_fields"]


def test_the_v2_scheduler_and_kv_cache_manager_are_stock(probes):
    stock, installed = probes["stock"], probes["installed"]
    assert installed["scheduler"] == stock["scheduler"]
    assert installed["kv_cache_manager"] == stock["kv_cache_manager"]
    assert installed["prefix_hit_tokens"] == stock["prefix_hit_tokens"] > 0


def test_the_v2_speculator_and_models_are_stock(probes):
    stock, installed = probes["stock"], probes["installed"]
    assert installed["speculator"] == stock["speculator"]
    assert installed["imports"] == stock["imports"]


def test_v2_refuses_what_stock_refuses(probes):
    stock, installed = probes["stock"], probes["installed"]
    adaptive = "adaptive_verification_without_graphs"
    assert installed["refusals"][adaptive] == stock["refusals"][adaptive]
    assert "Adaptive verification requires full CUDA graphs" in stock["refusals"][adaptive]
    # Stock has no such field; installed, it is the V1 proposer's, which V2 does not run.
    scheduler = "v1_confidence_scheduler"
    assert "dspark_confidence_scheduler" in stock["refusals"][scheduler]
    assert "Model Runner V2 does not yet support" in installed["refusals"][scheduler]
    assert "dspark_confidence_scheduler" in installed["refusals"][scheduler]


def test_no_overlay_module_is_imported_on_v2(probes):
    assert probes["installed"]["overlay_modules_imported"] == []
