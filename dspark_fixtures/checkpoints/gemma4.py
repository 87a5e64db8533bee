# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Tiny Gemma-4 checkpoints: a text-only ``Gemma4ForCausalLM`` target in the release config's keys
and DeepSpec Gemma-4 DSpark drafts, plus a Qwen3-architecture DFlash draft on the same taps (vLLM
has no Gemma-4 DFlash class) for side-by-side runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark_fixtures.checkpoints.common import (
    HEAD_DIM,
    HIDDEN_SIZE,
    INTERMEDIATE_SIZE,
    MAX_POSITIONS,
    NOISE_TOKEN_ID,
    NUM_HEADS,
    VOCAB_SIZE,
    build_tokenizer,
    trained_norm,
)
from dspark_fixtures.checkpoints.qwen3 import (
    AttentionGeometry,
    DSparkDraftSpec,
    random_dspark_weights,
    save_dflash_draft,
)

GEMMA4_GLOBAL_HEAD_DIM = 64
GEMMA4_TARGET_KINDS = ("random", "zero-norm", "bigram")


def _gemma4_text_config_dict() -> dict:
    """A text-only Gemma-4 target with the release config's keys at tiny sizes:
    sliding-window layers of head_dim 32 and a last full-attention layer of
    ``global_head_dim`` whose values reuse the keys (``attention_k_eq_v``),
    proportional partial RoPE, tied embeddings, final-logit soft-capping (small
    enough to move the tiny logits)."""
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": 4,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": 2,
        "num_global_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "global_head_dim": GEMMA4_GLOBAL_HEAD_DIM,
        "attention_k_eq_v": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "sliding_window": 32,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "final_logit_softcapping": 0.5,
        "tie_word_embeddings": True,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": VOCAB_SIZE,
        "num_kv_shared_layers": 0,
        "enable_moe_block": False,
        "use_double_wide_mlp": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "torch_dtype": "float32",
    }


def build_gemma4_target(model_dir: Path, seed: int = 0, kind: str = "random") -> Path:
    """A 4-layer ``Gemma4ForCausalLM`` (3 sliding-window layers, 1 full).

    ``kind="zero-norm"`` zeroes the final norm: every logit is zero and greedy
    decoding emits token 0, which a draft with a zero final norm and zero
    Markov projection predicts exactly (the oracle; the tied embeddings stay
    intact). ``kind="bigram"`` zeroes every attention output projection, so
    each position's output depends on its own token only, and scales the MLP
    outputs up so that the next token is not the current one again (with tied
    embeddings a bare embedding predicts itself)."""
    from safetensors.torch import save_file
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    if kind not in GEMMA4_TARGET_KINDS:
        raise ValueError(f"kind must be one of {GEMMA4_TARGET_KINDS}, got {kind!r}")
    model_dir.mkdir(parents=True, exist_ok=True)
    config = _gemma4_text_config_dict()
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(
        Gemma4TextConfig(
            **{k: v for k, v in config.items() if k not in ("architectures", "model_type")}
        )
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(trained_norm(param.numel(), generator))
        if kind == "zero-norm":
            model.model.norm.weight.zero_()
        elif kind == "bigram":
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.mul_(30.0)
    # The release layout: the config as Google ships it (global_head_dim,
    # num_global_key_value_heads), the tied lm_head left out of the file.
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / "model.safetensors").chmod(0o644)  # see build_qwen3_target
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    build_tokenizer(model_dir)
    return model_dir


@dataclass
class Gemma4DraftSpec:
    """Shape of a tiny Gemma-4 DSpark draft (DeepSpec's ``build_draft_config``:
    the target's text config, full-attention layers only)."""

    block_size: int = 4
    markov_rank: int = 8
    target_layer_ids: list[int] = field(default_factory=lambda: [0, 2, 3])
    num_layers: int = 3
    confidence_head: bool = False
    seed: int = 1
    scale: float = 0.05


def gemma4_draft_config(spec: Gemma4DraftSpec) -> dict:
    config = _gemma4_text_config_dict()
    config.update(
        {
            "architectures": ["Gemma4DSparkModel"],
            "target_model_type": "gemma4",
            "target_text_model_type": "gemma4_text",
            "num_target_layers": config["num_hidden_layers"],
            "num_hidden_layers": spec.num_layers,
            "enable_moe_block": False,
            "hidden_size_per_layer_input": 0,
            "block_size": spec.block_size,
            "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * spec.num_layers,
            "mask_token_id": NOISE_TOKEN_ID,
            "target_layer_ids": list(spec.target_layer_ids),
            "num_anchors": 512,
            "enable_confidence_head": spec.confidence_head,
            "markov_rank": spec.markov_rank,
            "markov_head_type": "vanilla",
        }
    )
    if spec.confidence_head:
        config["confidence_head_with_markov"] = True
    return config


def random_gemma4_draft_weights(spec: Gemma4DraftSpec) -> dict[str, torch.Tensor]:
    """DeepSpec's Gemma-4 draft tensor names and shapes (``Gemma4DSparkModel``
    state dict: values reuse the keys, so no ``v_proj``; ``v_norm`` has no
    weight), random values, norms as ``trained_norm`` leaves them."""
    generator = torch.Generator().manual_seed(spec.seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * spec.scale

    def norm(size: int) -> torch.Tensor:
        return trained_norm(size, generator)

    head_dim = GEMMA4_GLOBAL_HEAD_DIM
    q_size, kv_size = NUM_HEADS * head_dim, 1 * head_dim
    weights: dict[str, torch.Tensor] = {}
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = rand(q_size, HIDDEN_SIZE)
        weights[p + "self_attn.k_proj.weight"] = rand(kv_size, HIDDEN_SIZE)
        weights[p + "self_attn.o_proj.weight"] = rand(HIDDEN_SIZE, q_size)
        weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
        weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
        weights[p + "mlp.gate_proj.weight"] = rand(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        weights[p + "mlp.up_proj.weight"] = rand(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        weights[p + "mlp.down_proj.weight"] = rand(HIDDEN_SIZE, INTERMEDIATE_SIZE)
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            weights[p + name + ".weight"] = norm(HIDDEN_SIZE)
        weights[p + "layer_scalar"] = torch.ones(1)  # an untrained buffer in DeepSpec
    weights["fc.weight"] = rand(HIDDEN_SIZE, HIDDEN_SIZE * len(spec.target_layer_ids))
    weights["hidden_norm.weight"] = norm(HIDDEN_SIZE)
    weights["norm.weight"] = norm(HIDDEN_SIZE)
    weights["markov_head.markov_w1.weight"] = rand(VOCAB_SIZE, spec.markov_rank)
    weights["markov_head.markov_w2.weight"] = rand(VOCAB_SIZE, spec.markov_rank)
    if spec.confidence_head:
        weights["confidence_head.proj.weight"] = rand(1, HIDDEN_SIZE + spec.markov_rank)
        weights["confidence_head.proj.bias"] = torch.zeros(1)
    return weights


def save_gemma4_draft(
    model_dir: Path, spec: Gemma4DraftSpec, target: Path, weights: dict | None = None
) -> Path:
    """A Gemma-4 DSpark draft as DeepSpec saves it, with frozen copies of the
    target's embedding and (tied) lm_head."""
    from safetensors.torch import load_file, save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    weights = dict(random_gemma4_draft_weights(spec) if weights is None else weights)
    embed = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    weights["embed_tokens.weight"] = embed
    weights["lm_head.weight"] = embed.clone()
    (model_dir / "config.json").write_text(json.dumps(gemma4_draft_config(spec), indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").chmod(0o644)
    build_tokenizer(model_dir)
    return model_dir


def oracle_gemma4_draft_weights(spec: Gemma4DraftSpec) -> dict[str, torch.Tensor]:
    """For a ``zero-norm`` target: a zero final norm and zero Markov projection
    make every draft logit zero, so argmax drafts token 0, as the target emits."""
    weights = random_gemma4_draft_weights(spec)
    weights["norm.weight"].zero_()
    weights["markov_head.markov_w2.weight"].zero_()
    return weights


def bigram_gemma4_draft_weights(
    spec: Gemma4DraftSpec, target_dir: Path, blur: float = 0.05, markov_scale: float = 2.5
) -> dict[str, torch.Tensor]:
    """For a ``bigram`` Gemma-4 target, as ``bigram_dspark_weights``: W1 is the
    target's final hidden state of each token on its own (its next-token
    function), W2 the tied head times ``markov_scale``. Needs ``markov_rank ==
    HIDDEN_SIZE``."""
    from transformers import Gemma4ForCausalLM

    if spec.markov_rank != HIDDEN_SIZE:
        raise ValueError(f"bigram drafts need markov_rank={HIDDEN_SIZE}")
    target = Gemma4ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        tokens = torch.arange(VOCAB_SIZE)[:, None]
        normed = target.model(input_ids=tokens).last_hidden_state[:, 0]
    embed = target.model.embed_tokens.weight.detach()
    generator = torch.Generator().manual_seed(spec.seed + 1)
    weights = random_gemma4_draft_weights(spec)
    weights["markov_head.markov_w1.weight"] = normed + blur * torch.randn(
        normed.shape, generator=generator
    )
    weights["markov_head.markov_w2.weight"] = markov_scale * embed
    return weights


def gemma4_dflash_draft_spec(spec: Gemma4DraftSpec) -> DSparkDraftSpec:
    """A DFlash draft for the tiny Gemma-4 target in upstream's only DFlash
    architecture, Qwen3 (``DFlashQwen3ForCausalLM``): vLLM has no Gemma-4 DFlash
    class. It taps the same target layers as the Gemma-4 DSpark draft ``spec``
    (same hidden size) and has as many layers of the same attention width
    (``GEMMA4_GLOBAL_HEAD_DIM``, one KV head), so that a side-by-side run
    compares drafts of about the same cost."""
    geometry = AttentionGeometry(num_kv_heads=1, head_dim=GEMMA4_GLOBAL_HEAD_DIM)
    return DSparkDraftSpec(
        block_size=spec.block_size,
        target_layer_ids=list(spec.target_layer_ids),
        num_layers=spec.num_layers,
        geometry=geometry,
        layout="dflash",
        seed=spec.seed,
        scale=spec.scale,
    )


def save_gemma4_dflash_draft(model_dir: Path, spec: Gemma4DraftSpec, oracle: bool = False) -> Path:
    """Write the Qwen3-architecture DFlash draft of ``gemma4_dflash_draft_spec``.
    It shares the target's embedding and tied lm_head; ``oracle`` zeroes its
    final norm, so every draft logit is zero and argmax drafts token 0, as a
    ``zero-norm`` target emits."""
    dflash_spec = gemma4_dflash_draft_spec(spec)
    weights = random_dspark_weights(dflash_spec)
    if oracle:
        weights["norm.weight"].zero_()
    return save_dflash_draft(model_dir, dflash_spec, weights)
