"""Strict loading of the DeepSeek-V4 DSpark draft from a synthetic checkpoint that uses the real
``mtp.{s}.*`` names and (scaled-down) shapes, and validation of the ``dspark_*`` config fields."""

import pytest
import torch
from dsv4_reference import TINY_CONFIG, build_draft, synthetic_checkpoint

from vllm.v1.spec_decode.dspark.deepseek_v4 import (
    DeepSeekV4DSparkConfig,
    DSparkCheckpointError,
    DSparkConfigError,
    TensorParallelShard,
    deepseek_v4_draft_weights,
    is_deepseek_v4_dspark,
    load_deepseek_v4_draft,
)
from vllm.v1.spec_decode.dspark.deepseek_v4.loader import load_backbone_weights

CHECKPOINT = synthetic_checkpoint()
DRAFT_NAMES = sorted(name for name in CHECKPOINT if name.startswith("mtp."))
INTER = TINY_CONFIG["moe_intermediate_size"]


@pytest.fixture(scope="module")
def draft():
    """Loaded but not post-processed (vLLM's CPU linears repack their weights afterwards)."""
    model = build_draft(None)
    load_deepseek_v4_draft(model, CHECKPOINT.items())
    return model


def params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def test_every_tensor_lands_where_the_checkpoint_says(draft):
    p = params(draft)
    for s in range(2):
        c, b = f"mtp.{s}.", f"backbone.stages.{s}."
        shared_gate_up = p[b + "ffn.shared_experts.gate_up_proj.weight"]
        assert torch.equal(shared_gate_up[:INTER], CHECKPOINT[c + "ffn.shared_experts.w1.weight"])
        assert torch.equal(shared_gate_up[INTER:], CHECKPOINT[c + "ffn.shared_experts.w3.weight"])
        assert torch.equal(
            p[b + "ffn.shared_experts.down_proj.weight"],
            CHECKPOINT[c + "ffn.shared_experts.w2.weight"],
        )
        assert torch.equal(
            p[b + "ffn.gate.e_score_correction_bias"], CHECKPOINT[c + "ffn.gate.bias"]
        )
        for e in range(TINY_CONFIG["n_routed_experts"]):
            w13 = p[b + "ffn.experts.w13_weight"][e]
            assert torch.equal(w13[:INTER], CHECKPOINT[f"{c}ffn.experts.{e}.w1.weight"])
            assert torch.equal(w13[INTER:], CHECKPOINT[f"{c}ffn.experts.{e}.w3.weight"])
            assert torch.equal(
                p[b + "ffn.experts.w2_weight"][e], CHECKPOINT[f"{c}ffn.experts.{e}.w2.weight"]
            )
        assert torch.equal(p[b + "hc_attn.fn"], CHECKPOINT[c + "hc_attn_fn"])
        assert torch.equal(p[b + "attn.attn_sink"], CHECKPOINT[c + "attn.attn_sink"])
    assert torch.equal(p["backbone.stages.1.hc_head.scale"], CHECKPOINT["mtp.1.hc_head_scale"])
    assert torch.equal(
        p["markov_head.markov_w1.weight"], CHECKPOINT["mtp.1.markov_head.markov_w1.weight"]
    )
    assert torch.equal(
        p["confidence_head.proj.weight"], CHECKPOINT["mtp.1.confidence_head.proj.weight"]
    )
    assert "confidence_head.proj.bias" not in p  # DeepSeek-V4's confidence head has no bias


def test_target_tensors_are_ignored_and_heads_renamed():
    names = [name for name, _ in deepseek_v4_draft_weights(CHECKPOINT.items(), draft_config())]
    assert "embed.weight" not in names and "layers.0.attn.wq_a.weight" not in names
    assert "markov_head.markov_w2.weight" in names
    assert "confidence_head.proj.weight" in names
    assert "mtp.1.norm.weight" in names


@pytest.mark.parametrize("name", DRAFT_NAMES)
def test_any_missing_draft_tensor_fails_naming_it(draft, name):
    incomplete = {k: v for k, v in CHECKPOINT.items() if k != name}
    head_name = name.removeprefix("mtp.1.")
    expected = head_name if head_name.startswith(("markov_head", "confidence_head")) else name
    with pytest.raises((DSparkCheckpointError, ValueError), match=expected.replace(".", r"\.")):
        draft.load_weights(deepseek_v4_draft_weights(incomplete.items(), draft_config()))


@pytest.mark.parametrize(
    "extra",
    [
        "mtp.0.attn.wq_c.weight",
        "mtp.1.ffn.experts.4.w1.weight",  # one expert more than the config's 4
        "mtp.0.markov_head.markov_w1.weight",  # heads belong to the last stage only
        "mtp.1.confidence_head.proj.bias",
        "mtp.0.hc_head_fn",
    ],
)
def test_unknown_draft_tensor_fails_naming_it(draft, extra):
    weights = {**CHECKPOINT, extra: torch.zeros(1)}
    with pytest.raises((DSparkCheckpointError, ValueError), match=r"unknown|Unexpected") as error:
        draft.load_weights(deepseek_v4_draft_weights(weights.items(), draft_config()))
    # The last stage's head tensors reach the loader under the shared heads' names.
    named = extra.removeprefix("mtp.1.") if "confidence_head" in extra else extra
    assert named in str(error.value)


def test_extra_or_gapped_stages_fail(draft):
    extra_stage = {**CHECKPOINT, "mtp.2.attn.wq_a.weight": torch.zeros(1)}
    with pytest.raises(DSparkCheckpointError, match="3 draft stages"):
        draft.load_weights(deepseek_v4_draft_weights(extra_stage.items(), draft_config()))
    gapped = {k.replace("mtp.1.", "mtp.2."): v for k, v in CHECKPOINT.items()}
    with pytest.raises(DSparkCheckpointError, match="contiguous"):
        draft.load_weights(deepseek_v4_draft_weights(gapped.items(), draft_config()))


def test_wrong_shape_fails_naming_the_tensor(draft):
    bad = {**CHECKPOINT, "mtp.0.attn.wkv.weight": torch.zeros(8, TINY_CONFIG["hidden_size"])}
    with pytest.raises(DSparkCheckpointError, match=r"mtp\.0\.attn\.wkv\.weight has shape"):
        draft.load_weights(deepseek_v4_draft_weights(bad.items(), draft_config()))


def fp8_blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantise ``weight`` to e4m3 with one fp32 scale per ``block x block`` tile."""
    rows, cols = weight.shape
    tiles = weight.unfold(0, block, block).unfold(1, block, block)
    scale = tiles.abs().amax(dim=(-1, -2)) / 448.0
    expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (weight / expanded).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
def test_fp8_block_scaled_weights_are_dequantised(scale_dtype):
    model = build_draft(None)
    quantised = dict(CHECKPOINT)
    expected = {}
    for name in ("mtp.0.attn.wq_b.weight", "mtp.1.ffn.shared_experts.w1.weight"):
        fp8, scale = fp8_blocks(CHECKPOINT[name], 16)
        if scale_dtype == torch.float8_e8m0fnu:  # power-of-two scales, as in ue8m0 checkpoints
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
            fp8 = (CHECKPOINT[name] / scale.repeat_interleave(16, 0).repeat_interleave(16, 1)).to(
                torch.float8_e4m3fn
            )
        expanded = scale.repeat_interleave(16, 0).repeat_interleave(16, 1)
        expected[name] = fp8.float() * expanded
        quantised[name] = fp8
        quantised[name.removesuffix(".weight") + ".scale"] = scale.to(scale_dtype)
    backbone_weights = [
        (k, v)
        for k, v in deepseek_v4_draft_weights(quantised.items(), draft_config())
        if k.startswith("mtp.")
    ]
    load_backbone_weights(model.backbone, backbone_weights, fp8_block=(16, 16))
    p = params(model.backbone)
    assert torch.equal(p["stages.0.attn.wq_b.weight"], expected["mtp.0.attn.wq_b.weight"])
    gate_up = p["stages.1.ffn.shared_experts.gate_up_proj.weight"]
    assert torch.equal(gate_up[:INTER], expected["mtp.1.ffn.shared_experts.w1.weight"])
    # Quantisation error only: the dequantised weight is close to the original.
    torch.testing.assert_close(
        gate_up[:INTER], CHECKPOINT["mtp.1.ffn.shared_experts.w1.weight"], atol=0.05, rtol=0.1
    )


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (sign bit 8, magnitude index 0-7) [rows, cols] -> bytes, even column low."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def test_mxfp4_routed_experts_are_dequantised():
    g = torch.Generator().manual_seed(21)
    name = "mtp.1.ffn.experts.2.w3.weight"
    rows, cols = CHECKPOINT[name].shape
    codes = torch.randint(0, 16, (rows, cols), generator=g)
    exponents = torch.randint(-8, -2, (rows, cols // 32), generator=g).float()
    values = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    expected = values * torch.exp2(exponents).repeat_interleave(32, -1)
    weights = {
        **CHECKPOINT,
        name: mxfp4_pack(codes).view(torch.int8),
        name.removesuffix(".weight") + ".scale": torch.exp2(exponents).to(torch.float8_e8m0fnu),
    }
    model = build_draft(None)
    load_deepseek_v4_draft(model, weights.items())
    w13 = params(model)["backbone.stages.1.ffn.experts.w13_weight"][2]
    assert torch.equal(w13[INTER:], expected)
    assert torch.equal(w13[:INTER], CHECKPOINT["mtp.1.ffn.experts.2.w1.weight"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"mtp.0.attn.wkv.weight": torch.zeros(32, 64, dtype=torch.float8_e4m3fn)},
            r"mtp\.0\.attn\.wkv\.weight has no companion",
        ),
        (
            {"mtp.0.ffn.experts.0.w1.weight": torch.zeros(32, 32, dtype=torch.int8)},
            r"mtp\.0\.ffn\.experts\.0\.w1\.weight has no companion",
        ),
        ({"mtp.0.attn.wkv.scale": torch.ones(1, 1)}, "neither FP8 nor packed FP4"),
        (
            {
                "mtp.0.ffn.experts.0.w1.weight": torch.zeros(32, 32, dtype=torch.int8),
                "mtp.0.ffn.experts.0.w1.scale": torch.ones(32, 1),
            },
            "one scale per 32 values",
        ),
    ],
)
def test_malformed_quantisation_fails_clearly(draft, change, message):
    weights = {**CHECKPOINT, **change}
    with pytest.raises(DSparkCheckpointError, match=message):
        draft.load_weights(deepseek_v4_draft_weights(weights.items(), draft_config()))


def test_tp2_shards_slice_heads_groups_experts_and_shared_expert():
    for rank in range(2):
        model = build_draft(None, shard=TensorParallelShard(rank, 2))
        load_deepseek_v4_draft(model, CHECKPOINT.items())
        p = params(model.backbone)
        head_rows = slice(rank * 2 * 32, (rank + 1) * 2 * 32)  # 2 heads of 32 per rank
        assert torch.equal(
            p["stages.0.attn.wq_b.weight"], CHECKPOINT["mtp.0.attn.wq_b.weight"][head_rows]
        )
        group = slice(rank * 32, (rank + 1) * 32)  # 1 group of o_lora 32 per rank
        assert torch.equal(
            p["stages.0.attn.wo_a.weight"], CHECKPOINT["mtp.0.attn.wo_a.weight"][group]
        )
        assert torch.equal(
            p["stages.0.attn.wo_b.weight"], CHECKPOINT["mtp.0.attn.wo_b.weight"][:, group]
        )
        for local in range(2):
            expert = 2 * rank + local
            assert torch.equal(
                p["stages.0.ffn.experts.w2_weight"][local],
                CHECKPOINT[f"mtp.0.ffn.experts.{expert}.w2.weight"],
            )
        half = slice(rank * 16, (rank + 1) * 16)
        gate_up = p["stages.0.ffn.shared_experts.gate_up_proj.weight"]
        assert torch.equal(gate_up[:16], CHECKPOINT["mtp.0.ffn.shared_experts.w1.weight"][half])
        assert torch.equal(gate_up[16:], CHECKPOINT["mtp.0.ffn.shared_experts.w3.weight"][half])
        # Replicated: the context projection every rank needs for the full ring.
        assert torch.equal(p["stages.0.main_proj.weight"], CHECKPOINT["mtp.0.main_proj.weight"])


def draft_config(**changes) -> DeepSeekV4DSparkConfig:
    return DeepSeekV4DSparkConfig.from_hf_config({**TINY_CONFIG, **changes})


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"dspark_block_size": 0}, "dspark_block_size"),
        ({"dspark_noise_token_id": -1}, "dspark_noise_token_id"),
        ({"dspark_noise_token_id": 256}, "dspark_noise_token_id"),
        ({"dspark_markov_rank": -1}, "dspark_markov_rank"),
        ({"dspark_target_layer_ids": []}, "must not be empty"),
        ({"dspark_target_layer_ids": [3, 2]}, "strictly increasing"),
        ({"dspark_target_layer_ids": [2, 2]}, "strictly increasing"),
        ({"dspark_target_layer_ids": [2, 4]}, r"in \[0, 3\]"),
        ({"dspark_target_layer_ids": [-2, 1]}, r"-1 \(embedding output\)"),
        ({"dspark_target_layer_ids": "2,3"}, "list of integers"),
        ({"dspark_block_size": None}, "dspark_block_size"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"num_attention_heads": 5}, "o_groups"),
        ({"num_hash_layers": 9}, "num_hash_layers"),
    ],
)
def test_invalid_config_fails_naming_the_field(changes, field):
    with pytest.raises(DSparkConfigError, match=field):
        draft_config(**changes)


def test_missing_config_field_is_named():
    config = {k: v for k, v in TINY_CONFIG.items() if k != "sliding_window"}
    with pytest.raises(DSparkConfigError, match="no `sliding_window`"):
        DeepSeekV4DSparkConfig.from_hf_config(config)


def test_embedding_tap_is_rejected_for_deepseek_v4():
    with pytest.raises(DSparkConfigError, match=r"-1 \(embedding output\).*cannot tap"):
        draft_config(dspark_target_layer_ids=[-1, 0, 3])


def test_valid_config_and_detection():
    config = draft_config(dspark_target_layer_ids=[0, 1, 3])
    assert config.num_stages == 3 and config.feature_size == 3 * 64
    assert is_deepseek_v4_dspark(type("C", (), TINY_CONFIG)())
    assert not is_deepseek_v4_dspark(type("C", (), {**TINY_CONFIG, "dspark_block_size": 0})())


def test_wrong_shape_of_a_sharded_tensor_fails_on_every_rank():
    bad = {**CHECKPOINT, "mtp.1.attn.wq_b.weight": torch.zeros(3 * 32, 32)}
    for rank in range(2):
        model = build_draft(None, shard=TensorParallelShard(rank, 2))
        with pytest.raises(DSparkCheckpointError, match=r"wq_b\.weight has shape \(96, 32\)"):
            load_deepseek_v4_draft(model, bad.items())
