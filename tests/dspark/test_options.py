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
from packaging.version import Version
from pydantic import ValidationError

import vllm
from dspark_fixtures.checkpoints import qwen3
from vllm.config import SpeculativeConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.spec_decode.dspark.checks import (
    OTHER_METHODS_FIELDS,
    RING_PROPOSER_UNSUPPORTED,
    check_confidence_scheduling_without_async,
    check_speculative_fields,
    unsupported_fields,
)
from vllm.v1.spec_decode.dspark.options import DSparkOptions


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, monkeypatch_module) -> tuple[Path, Path]:
    """A tiny Qwen3 target and DSpark draft."""
    root = tmp_path_factory.mktemp("options")
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    target = qwen3.build_qwen3_target(root / "target")
    draft = qwen3.save_dspark_draft(root / "draft", qwen3.DSparkDraftSpec())
    return target, draft


@pytest.fixture(scope="module")
def speculative_config(tiny_pair) -> SpeculativeConfig:
    return engine_config(*tiny_pair).speculative_config


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield monkeypatch


def options(config: SpeculativeConfig, async_scheduling: bool = False, **fields) -> DSparkOptions:
    """The front end's field checks (``check_dspark_config``, ``check_dspark_scheduling``), then
    what the proposer reads."""
    changed = copy.copy(config)
    for name, value in fields.items():
        setattr(changed, name, value)
    check_speculative_fields(
        changed, target_tensor_parallel_size=1, unsupported=RING_PROPOSER_UNSUPPORTED
    )
    read = DSparkOptions.from_config(changed)
    check_confidence_scheduling_without_async(read.scheduling.scheduler, async_scheduling)
    return read


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
    read = DSparkOptions.from_config(changed)
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
        check_speculative_fields(
            changed,
            target_tensor_parallel_size=1,
            unsupported=unsupported_fields("deepseek_v4"),
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
    # vLLM 0.33.0: FLy's settings (rejection_sample_method "fly"), and the lookahead block
    # hashes, which vLLM applies only to drafters that need EAGLE's trailing-block drop.
    "fly_window_size",
    "fly_entropy_threshold",
    "fly_entropy_top_k",
    "disable_lookahead_block_hashes",
}
REFUSED_HERE = {*RING_PROPOSER_UNSUPPORTED, *OTHER_METHODS_FIELDS}
# vLLM's post-init resets prompt_lookup_* to 0 for every method but n-gram.
RESET_BY_VLLM = {"prompt_lookup_max", "prompt_lookup_min"}
REFUSED_BY_VLLM = {
    "enable_adaptive_verification",
    "index_share_for_mtp_iteration",
    "use_heterogeneous_vocab",
    "tensor_parallel_size",
    "draft_lm_head_quantization",  # vLLM 0.33.0
    "xpress_topc",  # vLLM 0.33.0
}
INTERNAL = {
    "target_model_config",
    "target_parallel_config",
    "draft_model_config",
    "draft_parallel_config",
    "dspark_draft",  # the draft spec VllmConfig's validation builds, not a setting
}
OWN = {
    f"dspark_{name}"
    for name in (
        "confidence_scheduler",
        "confidence_threshold",
        "draft_log",
    )
}


ADDED_IN_0_33 = {
    "fly_window_size",
    "fly_entropy_threshold",
    "fly_entropy_top_k",
    "disable_lookahead_block_hashes",
    "draft_lm_head_quantization",
    "xpress_topc",
}
FIELDS = {f.name for f in dataclasses.fields(SpeculativeConfig)}
ON_0_32 = Version(vllm.__version__).release[:2] == (0, 32)


@pytest.mark.each_vllm
def test_every_speculative_config_field_is_accounted_for():
    classified = HONOURED | REFUSED_HERE | RESET_BY_VLLM | REFUSED_BY_VLLM | INTERNAL | OWN
    assert FIELDS - classified == set(), "classify the new field(s) for DSpark"
    assert classified - FIELDS == (ADDED_IN_0_33 if ON_0_32 else set())


needs_0_33 = pytest.mark.skipif(ON_0_32, reason="a vLLM 0.33.0 field")


def engine_config(target: Path, draft: Path, **fields):
    return EngineArgs(
        model=str(target),
        dtype="float32",
        max_model_len=256,
        enable_prefix_caching=True,
        speculative_config={
            "method": "dspark",
            "model": str(draft),
            "num_speculative_tokens": 4,
            **fields,
        },
    ).create_engine_config()


@needs_0_33
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"draft_lm_head_quantization": "fp8"}, "draft_lm_head_quantization is not supported"),
        ({"xpress_topc": 8}, "xpress_topc is only supported by XPress"),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else None,
)
def test_vllm_refuses_its_0_33_fields_for_dspark(tiny_pair, fields, message):
    with pytest.raises(ValueError, match=message):
        engine_config(*tiny_pair, **fields)


@needs_0_33
def test_dspark_blocks_get_no_lookahead_hashes(tiny_pair, monkeypatch):
    """vLLM 0.33.0 extends a prefix-cache block's hash over the tokens a drafter reads past it
    only where the drafter's KV depends on the next token (``needs_eagle_block_drop``: EAGLE,
    EAGLE3, MTP). DSpark's draft KV is the target's features alone: its hashes stay plain, with
    ``disable_lookahead_block_hashes`` or without; the control shows the field's effect when
    vLLM's predicate says yes."""
    for disable in (False, True):
        config = engine_config(*tiny_pair, disable_lookahead_block_hashes=disable)
        assert config.num_hash_lookahead_tokens == 0
    monkeypatch.setattr(SpeculativeConfig, "needs_eagle_block_drop", lambda self: True)
    assert engine_config(*tiny_pair).num_hash_lookahead_tokens > 0
    assert (
        engine_config(*tiny_pair, disable_lookahead_block_hashes=True).num_hash_lookahead_tokens
        == 0
    )


@needs_0_33
def test_fly_settings_reach_vllms_rejection_sampler_config(speculative_config):
    """FLy (``rejection_sample_method: fly``) is vLLM's rejection sampler: DSpark's greedy drafts
    pass through it as any drafter's; probabilistic drafts need the standard sampler."""
    fly = {"rejection_sample_method": "fly", "fly_window_size": 2, "fly_entropy_top_k": 4}
    assert options(speculative_config, **fly) == DSparkOptions()
    with pytest.raises(ValueError, match="needs rejection_sample_method='standard', got 'fly'"):
        options(speculative_config, draft_sample_method="probabilistic", **fly)


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
