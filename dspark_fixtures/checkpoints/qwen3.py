# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Tiny Qwen3 checkpoints: a Qwen3 target and DeepSpec-format Qwen3 DSpark drafts (and DFlash
drafts) whose weights the tests and the demo can shape (random, oracle, or trained).

Drafts are written the way DeepSpec writes (and releases) them: top-level
``target_layer_ids``/``mask_token_id``/``block_size`` and frozen copies of the target's
``embed_tokens``/``lm_head``; ``layout="dflash"`` writes the DFlash/speculators variant
(``dflash_config``) instead. Built on disk in well under a second, no hub access.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from dspark_fixtures.checkpoints.common import (
    HEAD_DIM,
    HIDDEN_SIZE,
    INTERMEDIATE_SIZE,
    MAX_POSITIONS,
    NOISE_TOKEN_ID,
    NUM_HEADS,
    NUM_KV_HEADS,
    VOCAB_SIZE,
    build_tokenizer,
    trained_norm,
)


@dataclass(frozen=True)
class AttentionGeometry:
    """Attention shape of the tiny models: what sets their KV-cache width."""

    num_heads: int = NUM_HEADS
    num_kv_heads: int = NUM_KV_HEADS
    head_dim: int = HEAD_DIM
    max_positions: int = MAX_POSITIONS


TINY = AttentionGeometry()
# Qwen3-8B's KV width per layer (8 KV heads of 128) and a 128k context.
WIDE_KV = AttentionGeometry(num_heads=8, num_kv_heads=8, head_dim=128, max_positions=131072)


def _qwen3_config_dict(num_layers: int, geometry: AttentionGeometry = TINY) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": num_layers,
        "num_attention_heads": geometry.num_heads,
        "num_key_value_heads": geometry.num_kv_heads,
        "head_dim": geometry.head_dim,
        "max_position_embeddings": geometry.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "torch_dtype": "float32",
        "layer_types": ["full_attention"] * num_layers,
    }


TARGET_KINDS = ("random", "zero-lm-head", "bigram")


def build_qwen3_target(
    model_dir: Path, seed: int = 0, kind: str = "random", geometry: AttentionGeometry = TINY
) -> Path:
    """A 2-layer Qwen3 target.

    ``kind="zero-lm-head"`` makes greedy decoding emit token 0 forever, which
    any draft sharing the target's lm_head predicts exactly (the acceptance
    oracle). ``kind="bigram"`` zeroes every layer's output projections, so the
    residual stream is the current token's embedding and the greedy next token
    is a fixed function of the current one: varied output that a draft can
    partly predict (see ``bigram_dspark_weights``).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if kind not in TARGET_KINDS:
        raise ValueError(f"kind must be one of {TARGET_KINDS}, got {kind!r}")
    model_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**_qwen3_config_dict(2, geometry)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(trained_norm(param.numel(), generator))
        if kind == "zero-lm-head":
            model.lm_head.weight.zero_()
        elif kind == "bigram":
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(str(model_dir), safe_serialization=True)
    # safetensors writes 0600; a container running as another user must read the mounted model.
    (model_dir / "model.safetensors").chmod(0o644)
    build_tokenizer(model_dir)
    return model_dir


DRAFT_LAYOUTS = ("deepspec", "dflash")


@dataclass
class DSparkDraftSpec:
    """Shape of a tiny Qwen3 DSpark draft."""

    block_size: int = 4
    markov_rank: int = 8
    target_layer_ids: list[int] = field(default_factory=lambda: [0, 1])
    num_layers: int = 2
    confidence_head: bool = False
    confidence_with_markov: bool = False
    geometry: AttentionGeometry = TINY
    layout: str = "deepspec"
    """``deepspec``: DeepSpec's release layout; ``dflash``: taps and mask token
    in ``dflash_config``, no embedding or head in the file."""
    seed: int = 1
    scale: float = 0.05


def dspark_draft_config(spec: DSparkDraftSpec) -> dict:
    if spec.layout not in DRAFT_LAYOUTS:
        raise ValueError(f"layout must be one of {DRAFT_LAYOUTS}, got {spec.layout!r}")
    config = _qwen3_config_dict(spec.num_layers, spec.geometry)
    config.update(
        {
            "architectures": ["Qwen3DSparkModel"],
            "block_size": spec.block_size,
            "target_hidden_size": HIDDEN_SIZE,
            "markov_rank": spec.markov_rank,
        }
    )
    taps = {"target_layer_ids": list(spec.target_layer_ids), "mask_token_id": NOISE_TOKEN_ID}
    if spec.layout == "deepspec":
        config.update(taps)
    else:
        config["dflash_config"] = taps
    if spec.confidence_head:
        config["enable_confidence_head"] = True
        config["confidence_head_with_markov"] = spec.confidence_with_markov
    return config


def random_dspark_weights(spec: DSparkDraftSpec) -> dict[str, torch.Tensor]:
    """DeepSpec tensor names and shapes, random values (norms: ``trained_norm``)."""
    generator = torch.Generator().manual_seed(spec.seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * spec.scale

    def norm(size: int) -> torch.Tensor:
        return trained_norm(size, generator)

    g = spec.geometry
    q_size, kv_size = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    weights: dict[str, torch.Tensor] = {}
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = rand(q_size, HIDDEN_SIZE)
        weights[p + "self_attn.k_proj.weight"] = rand(kv_size, HIDDEN_SIZE)
        weights[p + "self_attn.v_proj.weight"] = rand(kv_size, HIDDEN_SIZE)
        weights[p + "self_attn.o_proj.weight"] = rand(HIDDEN_SIZE, q_size)
        weights[p + "self_attn.q_norm.weight"] = norm(g.head_dim)
        weights[p + "self_attn.k_norm.weight"] = norm(g.head_dim)
        weights[p + "input_layernorm.weight"] = norm(HIDDEN_SIZE)
        weights[p + "post_attention_layernorm.weight"] = norm(HIDDEN_SIZE)
        weights[p + "mlp.gate_proj.weight"] = rand(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        weights[p + "mlp.up_proj.weight"] = rand(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        weights[p + "mlp.down_proj.weight"] = rand(HIDDEN_SIZE, INTERMEDIATE_SIZE)
    num_taps = len(spec.target_layer_ids)
    weights["fc.weight"] = rand(HIDDEN_SIZE, HIDDEN_SIZE * num_taps)
    weights["hidden_norm.weight"] = norm(HIDDEN_SIZE)
    weights["norm.weight"] = norm(HIDDEN_SIZE)
    weights["markov_head.markov_w1.weight"] = rand(VOCAB_SIZE, spec.markov_rank)
    weights["markov_head.markov_w2.weight"] = rand(VOCAB_SIZE, spec.markov_rank)
    if spec.confidence_head:
        width = HIDDEN_SIZE + (spec.markov_rank if spec.confidence_with_markov else 0)
        weights["confidence_head.proj.weight"] = rand(1, width)
        weights["confidence_head.proj.bias"] = torch.zeros(1)
    return weights


def save_dspark_draft(
    model_dir: Path,
    spec: DSparkDraftSpec,
    weights: dict[str, torch.Tensor] | None = None,
    target: Path | None = None,
) -> Path:
    """Write config.json, model.safetensors and the tokenizer of a draft. In
    DeepSpec's layout with a ``target``, the file also carries frozen copies of
    the target's embedding and lm_head, as DeepSpec's trainer saves them."""
    from safetensors.torch import load_file, save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    weights = dict(random_dspark_weights(spec) if weights is None else weights)
    if spec.layout == "deepspec" and target is not None:
        target_weights = load_file(str(target / "model.safetensors"))
        weights["embed_tokens.weight"] = target_weights["model.embed_tokens.weight"]
        weights["lm_head.weight"] = target_weights["lm_head.weight"]
    (model_dir / "config.json").write_text(json.dumps(dspark_draft_config(spec), indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").chmod(0o644)  # see build_qwen3_target
    build_tokenizer(model_dir)
    return model_dir


def dflash_draft_config(spec: DSparkDraftSpec) -> dict:
    """The same draft as upstream DFlash reads it: ``dflash_config``, no Markov head."""
    config = dspark_draft_config(replace(spec, layout="dflash"))
    config["architectures"] = ["DFlashDraftModel"]
    config.pop("markov_rank")
    return config


def save_dflash_draft(model_dir: Path, spec: DSparkDraftSpec, weights: dict) -> Path:
    """Write a DFlash draft from DSpark-named weights, dropping ``markov_head.*``."""
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    kept = {k: v.contiguous() for k, v in weights.items() if not k.startswith("markov_head.")}
    (model_dir / "config.json").write_text(json.dumps(dflash_draft_config(spec), indent=2))
    save_file(kept, str(model_dir / "model.safetensors"))
    build_tokenizer(model_dir)
    return model_dir


def load_target(model_dir: Path) -> torch.nn.Module:
    """The Hugging Face target in float32, eval mode."""
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def oracle_dspark_weights(spec: DSparkDraftSpec) -> dict[str, torch.Tensor]:
    """Random backbone, zero Markov projection: paired with a zero-lm_head target,
    every draft logit ties at zero and argmax picks token 0, as the target does."""
    weights = random_dspark_weights(spec)
    weights["markov_head.markov_w2.weight"].zero_()
    return weights


def bigram_dspark_weights(
    spec: DSparkDraftSpec, target_dir: Path, blur: float = 0.05, markov_scale: float = 2.5
) -> dict[str, torch.Tensor]:
    """For a ``bigram`` target: the Markov head reproduces the target's
    next-token function (W1 = the previous token's embedding through the
    target's final norm, W2 = the target lm_head times ``markov_scale``), so
    the chain drafts the target's own continuation; ``blur`` adds noise to W1
    so that some positions disagree and accepted prefixes of every length
    occur. The backbone stays random, so the context still reaches the base
    logits and moves near-ties.
    Needs ``spec.markov_rank == HIDDEN_SIZE``."""
    from safetensors.torch import load_file

    if spec.markov_rank != HIDDEN_SIZE:
        raise ValueError(f"bigram drafts need markov_rank={HIDDEN_SIZE}")
    target = load_file(str(target_dir / "model.safetensors"))
    embed = target["model.embed_tokens.weight"]
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + 1e-6)
    normed = normed * target["model.norm.weight"]
    generator = torch.Generator().manual_seed(spec.seed + 1)
    weights = random_dspark_weights(spec)
    weights["markov_head.markov_w1.weight"] = normed + blur * torch.randn(
        normed.shape, generator=generator
    )
    weights["markov_head.markov_w2.weight"] = markov_scale * target["lm_head.weight"]
    return weights
