# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The strict loader of the DeepSeek-V4 DSpark draft built from vLLM's modules."""

import pytest
import torch
from safetensors import safe_open

from dspark_fixtures.checkpoints import deepseek_v4 as tiny_v4
from dspark_fixtures.v4_draft import build_draft, v4_vllm_config
from vllm.v1.spec_decode.dspark.deepseek_v4 import (
    CheckpointDraftTensors,
    DeepSeekV4DSparkConfig,
    DSparkCheckpointError,
    expected_draft_names,
    load_deepseek_v4_draft,
)


@pytest.fixture(scope="module")
def checkpoint():
    return tiny_v4.random_v4_checkpoint()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, checkpoint):
    return tiny_v4.save_v4_target(tmp_path_factory.mktemp("v4") / "target", checkpoint)


@pytest.fixture(scope="module")
def vllm_config(model_dir):
    return v4_vllm_config(model_dir)


@pytest.fixture(scope="module")
def model(vllm_config):
    """One draft for the module: vLLM registers each layer name once per config, and a failing
    load checks names before it copies anything."""
    return build_draft(vllm_config)


def load(model, vllm_config, weights):
    hf_config = vllm_config.speculative_config.draft_model_config.hf_config
    load_deepseek_v4_draft(model, weights, hf_config)
    return model


def test_every_parameter_is_loaded_from_its_tensor(model, vllm_config, checkpoint):
    load(model, vllm_config, checkpoint)
    params = dict(model.named_parameters())
    stage0 = "model.layers.0."
    H = tiny_v4.TINY_V4_CONFIG["hidden_size"]
    q_lora = tiny_v4.TINY_V4_CONFIG["q_lora_rank"]
    o_lora = tiny_v4.TINY_V4_CONFIG["o_lora_rank"]
    expect = {
        stage0 + "attn.fused_wqa_wkv.weight": [
            checkpoint["mtp.0.attn.wq_a.weight"],
            checkpoint["mtp.0.attn.wkv.weight"],
        ],
        stage0 + "ffn.shared_experts.gate_up_proj.weight": [
            checkpoint["mtp.0.ffn.shared_experts.w1.weight"],
            checkpoint["mtp.0.ffn.shared_experts.w3.weight"],
        ],
        stage0 + "attn.wo_a.1.weight": [checkpoint["mtp.0.attn.wo_a.weight"][o_lora:]],
        stage0 + "ffn.gate.e_score_correction_bias": [checkpoint["mtp.0.ffn.gate.bias"]],
        "model.markov_head.markov_w2.weight": [checkpoint["mtp.1.markov_head.markov_w2.weight"]],
    }
    for name, parts in expect.items():
        want = torch.cat(parts).to(params[name].dtype)
        # vLLM pads vocabulary-parallel heads to a multiple of 64 rows.
        assert torch.equal(params[name][: want.shape[0]], want), name
    assert params[stage0 + "attn.fused_wqa_wkv.weight"].shape == (q_lora + 512, H)


def test_any_missing_draft_tensor_fails_by_name(model, vllm_config, checkpoint):
    config = DeepSeekV4DSparkConfig.from_hf_config(
        vllm_config.speculative_config.draft_model_config.hf_config
    )
    names = expected_draft_names(config, with_confidence=True)
    assert "mtp.0.ffn.shared_experts.w1.weight" in names
    assert len(names) == len([n for n in checkpoint if n.startswith("mtp.")])
    hf_config = vllm_config.speculative_config.draft_model_config.hf_config
    last_expert = f"experts.{config.n_routed_experts - 1}."
    for name in names:
        if "confidence_head" in name:
            continue  # an enabled head without weights is dropped, as upstream does
        if ".experts." in name and "experts.0." not in name and last_expert not in name:
            continue  # every name family, without all 64 experts of each stage
        partial = {k: v for k, v in checkpoint.items() if k != name}
        with pytest.raises(DSparkCheckpointError, match=rf"lacks 1 .*{name.replace('.', '[.]')}"):
            load_deepseek_v4_draft(model, partial, hf_config)


def test_unknown_and_gapped_draft_tensors_fail_by_name(model, vllm_config, checkpoint):
    hf_config = vllm_config.speculative_config.draft_model_config.hf_config
    extra = {**checkpoint, "mtp.0.ffn.shared_experts.w4.weight": checkpoint["norm.weight"]}
    with pytest.raises(
        DSparkCheckpointError, match=r"unknown .*mtp\.0\.ffn\.shared_experts\.w4\.weight"
    ):
        load_deepseek_v4_draft(model, extra, hf_config)
    gapped = {**checkpoint, "mtp.3.norm.weight": checkpoint["norm.weight"]}
    with pytest.raises(DSparkCheckpointError, match="contiguous"):
        load_deepseek_v4_draft(model, gapped, hf_config)
    scaled = {**checkpoint, "mtp.0.attn.wq_b.scale": checkpoint["norm.weight"]}
    with pytest.raises(DSparkCheckpointError, match="does not exist"):
        load_deepseek_v4_draft(model, scaled, hf_config)


def test_the_target_tensors_are_not_the_drafts(model, vllm_config, checkpoint):
    """Only ``mtp.*`` is read: the draft loads without any of the target's own tensors."""
    load(model, vllm_config, {k: v for k, v in checkpoint.items() if k.startswith("mtp.")})
    assert model.confidence_head is not None


def test_streamed_tensors_are_the_files_mtp_tensors(model, vllm_config, model_dir):
    """``CheckpointDraftTensors`` lists only ``mtp.*`` names and reads each one as safetensors
    itself does; the draft loads from it as from the tensors in memory."""
    path = model_dir / "model.safetensors"
    streamed = CheckpointDraftTensors([str(path)])
    with safe_open(path, framework="pt") as f:
        names = [n for n in f.keys() if n.startswith("mtp.")]  # noqa: SIM118
        assert sorted(streamed) == sorted(names) and len(names) < len(list(f.keys()))
        for name in names:
            tensor = streamed[name]
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, f.get_tensor(name)), name
    load(model, vllm_config, streamed)
    params = dict(model.named_parameters())
    with safe_open(path, framework="pt") as f:
        want = f.get_tensor("mtp.1.ffn.shared_experts.w2.weight")
    assert torch.equal(params["model.layers.1.ffn.shared_experts.down_proj.weight"], want)
