# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The V2 lane against vLLM 0.33.0's own code, on CPU: its rendered arguments through the
`vllm serve` parser and `EngineArgs` to a V2 `VllmConfig`, and the profile check's rule for
adaptive verification against vLLM's rule in DeepSeek-V4's indexer.

The DeepSeek-V4-Flash checkpoint is its config.json (the fields the project carries) and a
stand-in tokenizer. The config is built on vLLM's CPU platform: it runs every validator, but
the CUDA platform's decisions (attention class, graph mode and capture sizes) and Model Runner V2
itself need the device, so they are not made here; the dry start makes them (docs/dry-start.md)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from test_golden import SITES

from dspark_fixtures.checkpoints.common import build_tokenizer
from dspark_fixtures.deepseek_v4_flash import V4_FLASH_CONFIG
from dspark_launch.lanes import RUNNER_ENV, adaptive_verification_problem
from dspark_launch.profile import PROFILES_DIR, load_profile
from dspark_launch.render import plan_node
from dspark_launch.site import load_site
from tests.helpers import probe_report, start_probe
from tests.launch.launch_testlib import REPO, write_yaml

TREE_033 = REPO / ".cache" / "vllm-0.33.0"
PROBE = Path(__file__).with_name("lanes_vllm_probe.py")
# The compute capabilities the images target: GB10, RTX PRO 6000, B200, B300.
CAPABILITIES = ("12.1", "12.0", "10.0", "10.3")


# vLLM builds the config in a subprocess (lanes_vllm_probe.py).
pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def spark_v2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if not (TREE_033 / "vllm" / "__init__.py").is_file():
        pytest.skip(f"{TREE_033} is missing; run scripts/setup-cpu-env.sh")
    root = tmp_path_factory.mktemp("lanes-vllm")
    snapshot = root / "snapshot"
    snapshot.mkdir()
    (snapshot / "config.json").write_text(json.dumps(V4_FLASH_CONFIG))
    build_tokenizer(snapshot)
    profile = load_profile(PROFILES_DIR / "deepseek-v4-flash-2x-spark.yaml")
    site = load_site(write_yaml(root / "site.yaml", SITES["spark-docker-v2"]))
    plan = plan_node(profile, site, site.head)
    args = list(plan.serve_args)
    revision = args.index("--revision")
    del args[revision : revision + 2]  # a local directory has no revision
    args[0] = str(snapshot)
    (root / "args.json").write_text(json.dumps(args))
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
        # the rank's own environment, less what names the node
        **{key: plan.env[key] for key in (RUNNER_ENV, *profile.env)},
    }
    command = [sys.executable, str(PROBE), str(TREE_033), str(root / "args.json"), *CAPABILITIES]
    return {"profile": profile, **probe_report(start_probe(command, env, root))}


def test_vllm_builds_a_v2_config_from_the_v2_lanes_arguments(spark_v2):
    assert spark_v2["vllm"] == "0.33.0"
    assert "config_error" not in spark_v2, spark_v2["config_error"]
    profile = spark_v2["profile"]
    assert spark_v2["parsed_speculative_config"] == json.loads(
        profile.speculative.config_json() or ""
    )
    assert spark_v2["config"] == {
        "use_v2_model_runner": True,
        "method": "dspark",
        "num_speculative_tokens": profile.speculative.num_speculative_tokens,
        "draft_sample_method": "probabilistic",
        "enable_adaptive_verification": False,
        # upstream's lookahead for an anchor-sampling DSpark draft: k, not the trained block
        "num_lookahead_tokens": profile.speculative.num_speculative_tokens,
        "tensor_parallel_size": profile.tensor_parallel_size,
        "max_model_len": profile.max_model_len,
        "kv_cache_dtype": profile.kv_cache_dtype,
    }


def test_the_adaptive_verification_rule_is_vllms(spark_v2):
    """DeepSeek-V4's indexer decides where vLLM can verify adaptively: the profile check
    allows it exactly where vLLM's own function does, for every capability the images target."""
    vllm_says = spark_v2["deepseek_v4_indexer_varlen"]
    assert vllm_says == {"12.1": False, "12.0": False, "10.0": True, "10.3": True}
    assert {cc: adaptive_verification_problem([cc]) is None for cc in CAPABILITIES} == vllm_says
