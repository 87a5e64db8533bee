# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The DSpark proposer's settings from vLLM's real SpeculativeConfig: typed fields, cross-field
rules, and upstream fields refused by name. Start-up through the engine is covered by
tests/engine/test_dspark_speculative_fields.py; async scheduling never runs on vLLM's CPU build,
so its refusal is checked here on the config the engine would build."""

import copy
import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from dspark_demo.checkpoints import qwen3
from vllm.config import SpeculativeConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.spec_decode.dspark.checks import (
    DEEPSEEK_V4_UNSUPPORTED,
    OTHER_METHODS_FIELDS,
    RING_PROPOSER_UNSUPPORTED,
)
from vllm.v1.spec_decode.dspark.options import DSparkOptions


@pytest.fixture(scope="module")
def speculative_config(tmp_path_factory, monkeypatch_module) -> SpeculativeConfig:
    root = tmp_path_factory.mktemp("options")
    target = qwen3.build_qwen3_target(root / "target")
    draft = qwen3.save_dspark_draft(root / "draft", qwen3.DSparkDraftSpec())
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    vllm_config = EngineArgs(
        model=str(target),
        dtype="float32",
        max_model_len=256,
        speculative_config={"method": "dspark", "model": str(draft), "num_speculative_tokens": 4},
    ).create_engine_config()
    return vllm_config.speculative_config


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield monkeypatch


def options(config: SpeculativeConfig, async_scheduling: bool = False, **fields) -> DSparkOptions:
    changed = copy.copy(config)
    for name, value in fields.items():
        setattr(changed, name, value)
    return DSparkOptions.from_config(
        changed, async_scheduling=async_scheduling, target_tensor_parallel_size=1
    )


def test_defaults(speculative_config):
    assert options(speculative_config) == DSparkOptions()


def test_fields_are_read(speculative_config):
    read = options(
        speculative_config,
        draft_sample_method="probabilistic",
        dspark_draft_log="/tmp/drafts.jsonl",
        dspark_confidence_scheduler="threshold",
        dspark_confidence_threshold=0.25,
    )
    assert read.probabilistic and read.draft_log == "/tmp/drafts.jsonl"
    assert read.scheduling.scheduler == "threshold"
    assert read.scheduling.threshold == 0.25


def test_draft_topk_is_read_where_upstream_validated_it(speculative_config):
    changed = copy.copy(speculative_config)
    changed.draft_model_config = copy.copy(changed.draft_model_config)
    changed.draft_model_config.hf_config = copy.copy(changed.draft_model_config.hf_config)
    changed.draft_model_config.hf_config.dspark_draft_topk = 8
    read = DSparkOptions.from_config(changed, async_scheduling=False, target_tensor_parallel_size=1)
    assert read.draft_topk == 8


def test_confidence_scheduling_with_async_scheduling_is_refused(speculative_config):
    fields = {"dspark_confidence_scheduler": "threshold", "dspark_confidence_threshold": 0.3}
    with pytest.raises(ValueError, match=r"does not work with async scheduling.*--no-async"):
        options(speculative_config, async_scheduling=True, **fields)
    # Without confidence scheduling async is fine, probabilistic drafts included.
    assert options(speculative_config, async_scheduling=True, draft_sample_method="probabilistic")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"attention_backend": "CPU_ATTN"}, "speculative_config.attention_backend='CPU_ATTN'"),
        ({"kv_cache_dtype": "fp8"}, "speculative_config.kv_cache_dtype='fp8'"),
        ({"use_local_argmax_reduction": True}, "use_local_argmax_reduction=True"),
        ({"moe_backend": "triton"}, "speculative_config.moe_backend='triton'"),
        ({"max_model_len": 128}, "speculative_config.max_model_len=128"),
        ({"draft_tensor_parallel_size": 2}, "speculative_config.draft_tensor_parallel_size=2"),
        ({"suffix_decoding_max_tree_depth": 8}, "suffix_decoding_max_tree_depth=8 belongs"),
        (
            {"draft_sample_method": "probabilistic", "rejection_sample_method": "block"},
            "needs rejection_sample_method='standard'",
        ),
        ({"dspark_confidence_threshold": 0.3}, "dspark_confidence_threshold only applies"),
        ({"dspark_draft_log": ""}, "dspark_draft_log must be a file path"),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else None,
)
def test_fields_that_cannot_be_honoured_are_refused_by_name(speculative_config, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        options(speculative_config, **fields)


def test_auto_and_unset_are_not_refused(speculative_config):
    assert options(speculative_config, kv_cache_dtype="auto", enforce_eager=True)
    assert options(speculative_config, enforce_eager=False)


def test_deepseek_v4_also_refuses_quantization(speculative_config):
    changed = copy.copy(speculative_config)
    changed.quantization = "fp8"
    with pytest.raises(ValueError, match=re.escape("speculative_config.quantization='fp8'")):
        DSparkOptions.from_config(
            changed,
            async_scheduling=False,
            target_tensor_parallel_size=1,
            unsupported={**RING_PROPOSER_UNSUPPORTED, **DEEPSEEK_V4_UNSUPPORTED},
        )


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"dspark_confidence_threshold": 1.5}, "dspark_confidence_threshold"),
        ({"dspark_confidence_scheduler": "auto"}, "dspark_confidence_scheduler"),
        ({"dspark_draft_topk_x": 64}, "dspark_draft_topk_x"),
    ],
)
def test_pydantic_checks_the_typed_fields(fields, name):
    with pytest.raises(ValidationError, match=name):
        SpeculativeConfig(method="dspark", num_speculative_tokens=4, **fields)


@pytest.mark.parametrize("rule", ["survival_threshold", "hardware"])
def test_removed_confidence_rules_are_refused_naming_the_value_and_the_allowed_ones(rule):
    with pytest.raises(ValidationError) as caught:
        SpeculativeConfig(
            method="dspark", num_speculative_tokens=4, dspark_confidence_scheduler=rule
        )
    # One line of pydantic's message, as the engine's start-up shows it (the removed rules had no
    # benchmark in this repo that showed a gain; docs/confidence-scheduling.md).
    line = "Input should be 'off' or 'threshold' [type=literal_error, input_value="
    assert f"  {line}{rule!r}, input_type=str]" in str(caught.value).splitlines()


@pytest.mark.parametrize("name", ["dspark_step_rate_curve", "dspark_hardware_early_stop"])
def test_removed_confidence_fields_are_refused_by_name(name):
    with pytest.raises(ValidationError, match=f"{name}\n  Unexpected keyword argument"):
        SpeculativeConfig(method="dspark", num_speculative_tokens=4, **{name: "1:40"})


# Every SpeculativeConfig field and what the V1 DSpark path does with it (README, "Speculative-
# config options"). A field vLLM adds fails this test until someone decides.
HONOURED = {
    "num_speculative_tokens",
    "model",
    "method",
    "revision",
    "code_revision",
    "draft_load_config",
    "draft_sample_method",
    "dspark_draft_topk",
    "rejection_sample_method",
    "synthetic_acceptance_rates",
    "synthetic_acceptance_length",
    "num_speculative_tokens_per_batch_size",
    "disable_padded_drafter_batch",
    "disable_eagle_block_drop",
    "parallel_drafting",
    "quantization",
    "enforce_eager",
    "draft_tensor_parallel_size",
}
REFUSED_HERE = {*RING_PROPOSER_UNSUPPORTED, *OTHER_METHODS_FIELDS}
# vLLM's post-init resets prompt_lookup_* to 0 for every method but n-gram.
RESET_BY_VLLM = {"prompt_lookup_max", "prompt_lookup_min"}
REFUSED_BY_VLLM = {
    "enable_adaptive_verification",
    "index_share_for_mtp_iteration",
    "use_heterogeneous_vocab",
    "tensor_parallel_size",
}
INTERNAL = {
    "target_model_config",
    "target_parallel_config",
    "draft_model_config",
    "draft_parallel_config",
}
OWN = {
    f"dspark_{name}"
    for name in (
        "confidence_scheduler",
        "confidence_threshold",
        "draft_log",
    )
}


def test_every_speculative_config_field_is_accounted_for():
    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    classified = HONOURED | REFUSED_HERE | RESET_BY_VLLM | REFUSED_BY_VLLM | INTERNAL | OWN
    assert fields - classified == set(), "classify the new field(s) for DSpark"
    assert classified - fields == set()


REPO = Path(__file__).resolve().parents[2]
PROFILES = sorted((REPO / "recipe" / "profiles").glob("*.yaml"))


def load_profile(path: Path):
    """The launcher's own profile reader (launch/ is not a package on the test path)."""
    sys.path.insert(0, str(REPO / "launch"))
    try:
        from dspark_launch.profile import load_profile as load
    finally:
        sys.path.remove(str(REPO / "launch"))
    return load(path)


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_recipe_profiles_use_only_fields_that_work(speculative_config, path):
    """The speculative config each profile's launch builds, applied to the tiny DSpark config
    (the draft checkpoint aside) with the profile's async scheduling: DSpark accepts all of it."""
    profile = load_profile(path)
    serialized = profile.speculative.config_json()
    if serialized is None:
        pytest.skip("no speculative decoding in this profile")
    fields = json.loads(serialized)
    assert fields.pop("method") == "dspark"
    fields.pop("model", None)
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    assert set(fields) <= known - REFUSED_HERE - REFUSED_BY_VLLM - RESET_BY_VLLM - INTERNAL
    async_scheduling = "--async-scheduling" in profile.serve_args
    read = options(speculative_config, async_scheduling=async_scheduling, **fields)
    assert read.probabilistic == (fields.get("draft_sample_method") == "probabilistic")
