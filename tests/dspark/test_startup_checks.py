# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The start-up checks (``dspark/checks.py``) of the draft's config values, log path and weight
files: the pure checks, then ``check_dspark_config``, which vLLM's front end runs on the
VllmConfig it builds (``EngineArgs.create_engine_config``, patched), for the tiny Qwen3 and
Gemma-4 pairs. tests/engine/test_refusal_last_line.py shows `vllm serve` refusing there, before
any engine process starts."""

import copy
import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig

from dspark_fixtures.checkpoints import gemma4, qwen3
from vllm.v1.spec_decode.dspark.checks import (
    check_block_size,
    check_draft_flags,
    check_draft_log,
    check_mask_token_id,
    check_safetensors_files,
    check_target_feature_width,
    check_target_layer_ids,
    mask_token_id,
    target_layer_ids,
)

VOCAB, HIDDEN, LAYERS = 1000, 64, 2


def qwen3_draft(**values) -> PretrainedConfig:
    base = {"mask_token_id": 5, "target_layer_ids": [-1, 0], "hidden_size": HIDDEN}
    return PretrainedConfig(**{**base, **values})


def check(config: PretrainedConfig) -> None:
    check_block_size(config)
    check_draft_flags(config)
    check_mask_token_id(mask_token_id(config), VOCAB)
    check_target_layer_ids(target_layer_ids(config), LAYERS)
    check_target_feature_width(config, HIDDEN)


def test_a_valid_config_passes():
    check(qwen3_draft(block_size=7, markov_rank=8, sample_from_anchor=False))  # -1: embeddings
    check(qwen3_draft(dflash_config={"mask_token_id": VOCAB - 1, "target_layer_ids": [1]}))
    check(qwen3_draft(mask_token_id=None, target_hidden_size=HIDDEN, hidden_size=32))
    check(qwen3_draft(target_layer_ids=None, dflash_config={"target_layer_ids": [0, 1]}))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"block_size": 0}, "block_size=0 is not a positive integer"),
        ({"block_size": -2}, "block_size=-2 is not a positive integer"),
        ({"block_size": "4"}, "block_size='4' is not a positive integer"),
        ({"block_size": True}, "block_size=True is not a positive integer"),
        ({"dspark_block_size": 0}, "dspark_block_size=0"),
        ({"mask_token_id": VOCAB}, f"mask_token_id={VOCAB} is not a token id"),
        ({"mask_token_id": -1}, "mask_token_id=-1 is not a token id"),
        ({"mask_token_id": "5"}, "mask_token_id='5'"),
        ({"dflash_config": {"mask_token_id": 10**6}}, "mask_token_id=1000000"),
        ({"target_layer_ids": ["0", 1]}, "target_layer_ids=['0', 1] is not a list of integer"),
        ({"target_layer_ids": 3}, "target_layer_ids=3 is not a list"),
        ({"target_layer_ids": None}, "names no target layers: set target_layer_ids"),
        ({"target_layer_ids": [0, 5]}, "target_layer_ids [0, 5] must be strictly increasing"),
        ({"target_layer_ids": [1, 0]}, "target_layer_ids [1, 0] must be strictly increasing"),
        ({"target_layer_ids": [-2, 0]}, "lie within [-1, 1] for this 2-layer target"),
        ({"hidden_size": 32}, "target features of width 32"),
        ({"sample_from_anchor": "false"}, "sample_from_anchor='false' is not a boolean"),
        ({"enable_confidence_head": 1}, "enable_confidence_head=1 is not a boolean"),
        ({"confidence_head_with_markov": "yes"}, "confidence_head_with_markov='yes'"),
        ({"markov_rank": 0}, "markov_rank=0 is not a positive integer"),
        ({"markov_rank": 2.5}, "markov_rank=2.5 is not a positive integer"),
        ({"target_hidden_size": 128}, "target features of width 128"),
    ],
)
def test_bad_values_are_refused_naming_field_value_and_fix(values, message):
    with pytest.raises(
        ValueError, match=r"Set it|List the|Use the|Write true|set target|\d\]"
    ) as caught:
        check(qwen3_draft(**values))
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_draft_log_must_be_an_appendable_file(tmp_path):
    check_draft_log(None)
    check_draft_log(str(tmp_path / "drafts.jsonl"))
    (start,) = [json.loads(line) for line in (tmp_path / "drafts.jsonl").read_text().splitlines()]
    assert start["event"] == "start" and start["pid"] == os.getpid()
    with pytest.raises(ValueError, match=r"must be a file path"):
        check_draft_log("")
    with pytest.raises(ValueError, match=r"is a directory\. Name a file"):
        check_draft_log(str(tmp_path))
    with pytest.raises(ValueError, match=r"does not exist\. Create it first"):
        check_draft_log(str(tmp_path / "missing" / "drafts.jsonl"))
    with pytest.raises(ValueError, match=r"cannot be appended to \(No such file"):
        check_draft_log("/proc/self/dspark-drafts.jsonl")
    # Opens, but takes no write: only writing at start-up finds that.
    with pytest.raises(ValueError, match=r"cannot be appended to \(No space left on device\)"):
        check_draft_log("/dev/full")


def test_not_writable_is_refused_for_a_non_root_user(tmp_path):
    if os.getuid() == 0:
        pytest.skip("root may write anywhere; /proc covers the refusal above")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="cannot be appended to"):
        check_draft_log(str(locked / "drafts.jsonl"))


def test_incomplete_safetensors_files_are_named(tmp_path):
    save_file({"w": torch.ones(64, 64)}, str(tmp_path / "model-00001.safetensors"))
    save_file({"v": torch.ones(8)}, str(tmp_path / "model-00002.safetensors"))
    check_safetensors_files(str(tmp_path))
    check_safetensors_files("org/hub-id")  # not a local directory: vLLM verifies downloads
    shard = tmp_path / "model-00002.safetensors"
    data = shard.read_bytes()
    not_json = b"not json"
    for broken in (
        data[:-5],  # truncated data
        data[:6],  # not even the header's length
        struct.pack("<Q", len(not_json)) + not_json,
        struct.pack("<Q", 3) + b"[1]",
    ):
        shard.write_bytes(broken)
        with pytest.raises(ValueError) as caught:
            check_safetensors_files(str(tmp_path))
        message = str(caught.value)
        assert message.startswith(f"{shard} is not a complete safetensors file (")
        assert message.endswith("Download this file again.") and "\n" not in message


# --- check_dspark_config on vLLM's own config --------------------------------------------------


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield monkeypatch


def engine_config(target, draft, **fields):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(target),
        dtype="float32",
        max_model_len=256,
        block_size=32,
        speculative_config={
            "method": "dspark",
            "model": str(draft),
            "num_speculative_tokens": 4,
            **fields,
        },
    ).create_engine_config()


@pytest.fixture(scope="module")
def configs(tmp_path_factory, monkeypatch_module) -> dict:
    """vLLM's config for the tiny Qwen3 and Gemma-4 target/draft pairs (nothing is loaded)."""
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    root = tmp_path_factory.mktemp("startup")
    qwen3_target = qwen3.build_qwen3_target(root / "qwen3")
    gemma4_target = gemma4.build_gemma4_target(root / "gemma4")
    spec = gemma4.Gemma4DraftSpec()
    return {
        "qwen3": engine_config(
            qwen3_target,
            qwen3.save_dspark_draft(root / "qwen3-draft", qwen3.DSparkDraftSpec()),
        ),
        "gemma4": engine_config(
            gemma4_target, gemma4.save_gemma4_draft(root / "gemma4-draft", spec, gemma4_target)
        ),
    }


def changed(vllm_config, *, k: int | None = None, model: str | None = None, **values):
    """``vllm_config`` with the draft's config values (or k, or its directory) changed."""
    vllm_config = copy.copy(vllm_config)
    speculative = vllm_config.speculative_config = copy.copy(vllm_config.speculative_config)
    draft = speculative.draft_model_config = copy.copy(speculative.draft_model_config)
    draft.hf_config = copy.deepcopy(draft.hf_config)
    for name, value in values.items():
        setattr(draft.hf_config, name, value)
    if k is not None:
        speculative.num_speculative_tokens = k
    if model is not None:
        draft.model = model
    return vllm_config


def refusal(vllm_config) -> str:
    from vllm.v1.spec_decode.dspark_proposer import check_dspark_config

    with pytest.raises(ValueError) as caught:
        check_dspark_config(vllm_config)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("DSpark refused the configuration: ")
    return message


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("qwen3", {"k": 5}, "exceeds the DSpark draft's trained block size 4"),
        ("qwen3", {"k": 5}, "Use num_speculative_tokens <= 4"),
        ("qwen3", {"target_layer_ids": [0, 5]}, "target_layer_ids [0, 5]"),
        ("qwen3", {"target_layer_ids": [0, 5]}, "this 2-layer target"),
        ("qwen3", {"target_layer_ids": None}, "names no target layers"),
        ("qwen3", {"architectures": ["Qwen3ForCausalLM"]}, "is not a DSpark draft the V1"),
        ("qwen3", {"mask_token_id": 10**6}, "mask_token_id=1000000 is not a token id"),
        ("qwen3", {"block_size": "4"}, "block_size='4' is not a positive integer"),
        ("qwen3", {"block_size": 0}, "block_size=0 is not a positive integer"),
        ("qwen3", {"layer_types": ["sliding_attention"] * 2}, "has sliding-window layers"),
        ("gemma4", {"attention_k_eq_v": False}, "sets attention_k_eq_v=false"),
        ("gemma4", {"num_target_layers": 9}, "trained for a 9-layer target"),
        ("gemma4", {"k": 5}, "exceeds the DSpark draft's trained block size 4"),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else value,
)
def test_the_proposer_refuses_bad_draft_configs_before_building(configs, family, change, message):
    assert message in refusal(changed(configs[family], **change))


def test_the_unchanged_configs_pass_the_checks(configs):
    """The control: what the cases above change is all that makes them refused."""
    from vllm.v1.spec_decode.dspark_proposer import check_dspark_config

    check_dspark_config(changed(configs["qwen3"]))
    check_dspark_config(changed(configs["gemma4"]))


def test_the_front_end_refuses_before_returning_the_config(configs):
    """``create_engine_config`` itself refuses: no engine process, no weights."""
    qwen3 = configs["qwen3"]
    with pytest.raises(ValueError) as caught:
        engine_config(
            qwen3.model_config.model,
            qwen3.speculative_config.draft_model_config.model,
            num_speculative_tokens=5,
        )
    assert str(caught.value) == (
        "DSpark refused the configuration: num_speculative_tokens=5 exceeds the DSpark draft's "
        "trained block size 4: it never learned to predict that far. Use "
        "num_speculative_tokens <= 4."
    )


@pytest.mark.parametrize(
    ("fields", "line"),
    [
        (
            {"method": "dspakr"},
            "speculative_config.method='dspakr' is not accepted. Did you mean 'dspark'? "
            "Accepted: 'ngram', ",
        ),
        (
            {"num_speculative_tokens": "five"},
            "speculative_config.num_speculative_tokens='five' is not an integer. Write a whole "
            "number, e.g. 5.",
        ),
        (
            {"num_speculative_tokens": 4.5},
            "speculative_config.num_speculative_tokens=4.5 is not an integer.",
        ),
        (
            {"dspark_draft_topk_x": 8},
            "speculative_config has no field 'dspark_draft_topk_x'. Did you mean "
            "'dspark_draft_topk'?",
        ),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else None,
)
def test_pydantic_refusals_are_one_line_naming_the_field(configs, fields, line):
    """Not pydantic's dump of every literal of every union member (~56 lines for a method)."""
    qwen3 = configs["qwen3"]
    with pytest.raises(ValueError) as caught:
        engine_config(
            qwen3.model_config.model, qwen3.speculative_config.draft_model_config.model, **fields
        )
    message = str(caught.value)
    assert "\n" not in message and message.startswith(line), message


def test_a_truncated_draft_file_is_refused_before_building(configs, tmp_path):
    draft = shutil.copytree(
        configs["qwen3"].speculative_config.draft_model_config.model, tmp_path / "draft"
    )
    weights = draft / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    message = refusal(changed(configs["qwen3"], model=str(draft)))
    assert message.startswith(f"DSpark refused the configuration: {weights} is not a complete")


def test_a_draft_log_directory_is_refused(configs, tmp_path):
    vllm_config = changed(configs["qwen3"])
    vllm_config.speculative_config.dspark_draft_log = str(tmp_path)
    assert f"dspark_draft_log='{tmp_path}' is a directory" in refusal(vllm_config)


def test_vllm_refuses_adaptive_verification_for_dspark(configs):
    qwen3 = configs["qwen3"]
    with pytest.raises(Exception, match="does not support: adaptive draft verification"):
        engine_config(
            qwen3.model_config.model,
            qwen3.speculative_config.draft_model_config.model,
            enable_adaptive_verification=True,
        )


# --- The DeepSeek-V4 draft's config (deepseek_v4/config.py) --------------------------------------


def v4_config(**changes):
    from dspark_fixtures.checkpoints.deepseek_v4 import TINY_V4_CONFIG
    from vllm.v1.spec_decode.dspark.deepseek_v4.config import DeepSeekV4DSparkConfig

    return DeepSeekV4DSparkConfig.from_hf_config({**TINY_V4_CONFIG, **changes})


def test_the_tiny_v4_config_passes_as_a_mapping_and_as_a_pretrained_config():
    from dspark_fixtures.checkpoints.deepseek_v4 import TINY_V4_CONFIG
    from vllm.v1.spec_decode.dspark.deepseek_v4.config import DeepSeekV4DSparkConfig

    config = v4_config()
    assert config == DeepSeekV4DSparkConfig.from_hf_config(PretrainedConfig(**TINY_V4_CONFIG))
    assert config.feature_size == config.num_stages * config.hidden_size
    rope = {"rope_parameters": {"rope_theta": 5000.0}}
    without_theta = {k: v for k, v in TINY_V4_CONFIG.items() if k != "rope_theta"}
    assert DeepSeekV4DSparkConfig.from_hf_config({**without_theta, **rope}).rope_theta == 5000.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dspark_block_size": 0}, "dspark_block_size = 0: Input should be greater than 0"),
        ({"dspark_block_size": "4"}, "dspark_block_size = '4': Input should be a valid integer"),
        ({"dspark_block_size": True}, "dspark_block_size = True: Input should be a valid integer"),
        ({"rms_norm_eps": True}, "rms_norm_eps = True: Input should be a valid number"),
        ({"dspark_target_layer_ids": []}, "dspark_target_layer_ids = []: Tuple should have at"),
        ({"dspark_target_layer_ids": ["0"]}, "dspark_target_layer_ids.0 = '0'"),
        ({"dspark_target_layer_ids": [1, 0]}, "must be strictly increasing, got [1, 0]"),
        ({"dspark_target_layer_ids": [-1, 0]}, "contains -1 (embedding output)"),
        ({"dspark_target_layer_ids": [0, 99]}, "must each be -1 (embedding output) or in"),
        ({"dspark_noise_token_id": 10**6}, "dspark_noise_token_id must be in [0, vocab_size="),
        ({"dspark_markov_rank": -1}, "dspark_markov_rank = -1: Input should be greater than or"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu': Input should be 'silu'"),
        ({"norm_topk_prob": False}, "norm_topk_prob = False: Input should be True"),
        ({"enable_confidence_head": "yes"}, "enable_confidence_head = 'yes': Input should be"),
        ({"o_groups": 3}, "must be a multiple of o_groups=3"),
        ({"sliding_window": 0}, "sliding_window = 0: Input should be greater than 0"),
        ({"hc_mult": 0}, "hc_mult = 0"),
        ({"hc_sinkhorn_iters": 0}, "hc_sinkhorn_iters = 0"),
        ({"num_experts_per_tok": 999}, "num_experts_per_tok must be in [1, n_routed_experts="),
        ({"qk_rope_head_dim": 3}, "qk_rope_head_dim must be even and in (0, head_dim="),
        ({"num_hash_layers": 99}, "would fall inside num_hash_layers=99"),
        ({"hc_eps": None}, "hc_eps = None: Input should be a valid number"),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else None,
)
def test_the_v4_config_refuses_a_bad_field_in_one_line_naming_it(changes, message):
    from vllm.v1.spec_decode.dspark.deepseek_v4.config import DSparkConfigError

    with pytest.raises(DSparkConfigError) as caught:
        v4_config(**changes)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_missing_v4_field_is_named():
    from dspark_fixtures.checkpoints.deepseek_v4 import TINY_V4_CONFIG
    from vllm.v1.spec_decode.dspark.deepseek_v4.config import (
        DeepSeekV4DSparkConfig,
        DSparkConfigError,
    )

    source = {k: v for k, v in TINY_V4_CONFIG.items() if k != "hc_eps"}
    with pytest.raises(DSparkConfigError, match=r"the checkpoint config has no `hc_eps`"):
        DeepSeekV4DSparkConfig.from_hf_config(source)


def test_the_start_up_log_names_the_release(configs, monkeypatch):
    """Two nodes' logs say which dspark-vllm they run (the release install.py records). The
    proposer itself is not built: only the line logged before it is read."""
    import logging

    from vllm.v1.spec_decode.dspark import __version__, paged_proposer
    from vllm.v1.spec_decode.dspark_proposer import make_dspark_proposer

    monkeypatch.setattr(paged_proposer, "DSparkPagedProposer", lambda *args: None)

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.v1.spec_decode.dspark_proposer")
    logger.addHandler(handler)
    try:
        make_dspark_proposer(changed(configs["qwen3"]), torch.device("cpu"))
    finally:
        logger.removeHandler(handler)
    messages = [record.getMessage() for record in records]
    assert f"DSpark {__version__} (dspark-vllm), qwen3 draft." in messages, messages
