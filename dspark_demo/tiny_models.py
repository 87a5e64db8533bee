"""Tiny local models for running a real vLLM engine with DSpark on a CPU.

Everything is built from scratch on disk in well under a second (no hub access):
a word-level tokenizer, a Qwen3 target, and DeepSpec-format Qwen3 DSpark drafts
whose weights the tests and the demo can shape (random, oracle, or trained).
Sizes follow what vLLM's CPU attention backend accepts (head_dim 32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

VOCAB_SIZE = 1000
HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 128
HEAD_DIM = 32
NUM_HEADS = 2
NUM_KV_HEADS = 1
MAX_POSITIONS = 512
NOISE_TOKEN_ID = 4
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]


def build_tokenizer(model_dir: Path) -> None:
    """A whitespace word-level tokenizer: `<unk> <s> </s> <pad> w0 .. w995`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL_TOKENS + [f"w{i}" for i in range(VOCAB_SIZE - len(SPECIAL_TOKENS))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tokenizer.save_pretrained(str(model_dir))


def _qwen3_config_dict(num_layers: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": num_layers,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": MAX_POSITIONS,
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


def build_qwen3_target(model_dir: Path, seed: int = 0, kind: str = "random") -> Path:
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
    model = Qwen3ForCausalLM(Qwen3Config(**_qwen3_config_dict(num_layers=2)))
    with torch.no_grad():
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


@dataclass
class DSparkDraftSpec:
    """Shape of a tiny DeepSpec-format Qwen3 DSpark draft."""

    block_size: int = 4
    markov_rank: int = 8
    target_layer_ids: list[int] = field(default_factory=lambda: [0, 1])
    num_layers: int = 1
    confidence_head: bool = False
    confidence_with_markov: bool = False
    sliding_window: int | None = None
    seed: int = 1
    scale: float = 0.05


def dspark_draft_config(spec: DSparkDraftSpec) -> dict:
    config = _qwen3_config_dict(num_layers=spec.num_layers)
    layer_type = "sliding_attention" if spec.sliding_window else "full_attention"
    config.update(
        {
            "architectures": ["Qwen3DSparkModel"],
            "layer_types": [layer_type] * spec.num_layers,
            "block_size": spec.block_size,
            "target_hidden_size": HIDDEN_SIZE,
            "markov_rank": spec.markov_rank,
            "dflash_config": {
                "target_layer_ids": list(spec.target_layer_ids),
                "mask_token_id": NOISE_TOKEN_ID,
            },
        }
    )
    if spec.sliding_window:
        config["sliding_window"] = spec.sliding_window
        config["dflash_config"]["causal"] = False
    if spec.confidence_head:
        config["enable_confidence_head"] = True
        config["confidence_head_with_markov"] = spec.confidence_with_markov
    return config


def random_dspark_weights(spec: DSparkDraftSpec) -> dict[str, torch.Tensor]:
    """DeepSpec tensor names and shapes, random values (norms = 1)."""
    generator = torch.Generator().manual_seed(spec.seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * spec.scale

    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    weights: dict[str, torch.Tensor] = {}
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = rand(q_size, HIDDEN_SIZE)
        weights[p + "self_attn.k_proj.weight"] = rand(kv_size, HIDDEN_SIZE)
        weights[p + "self_attn.v_proj.weight"] = rand(kv_size, HIDDEN_SIZE)
        weights[p + "self_attn.o_proj.weight"] = rand(HIDDEN_SIZE, q_size)
        weights[p + "self_attn.q_norm.weight"] = torch.ones(HEAD_DIM)
        weights[p + "self_attn.k_norm.weight"] = torch.ones(HEAD_DIM)
        weights[p + "input_layernorm.weight"] = torch.ones(HIDDEN_SIZE)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN_SIZE)
        weights[p + "mlp.gate_proj.weight"] = rand(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        weights[p + "mlp.up_proj.weight"] = rand(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        weights[p + "mlp.down_proj.weight"] = rand(HIDDEN_SIZE, INTERMEDIATE_SIZE)
    num_taps = len(spec.target_layer_ids)
    weights["fc.weight"] = rand(HIDDEN_SIZE, HIDDEN_SIZE * num_taps)
    weights["hidden_norm.weight"] = torch.ones(HIDDEN_SIZE)
    weights["norm.weight"] = torch.ones(HIDDEN_SIZE)
    weights["markov_head.markov_w1.weight"] = rand(VOCAB_SIZE, spec.markov_rank)
    weights["markov_head.markov_w2.weight"] = rand(VOCAB_SIZE, spec.markov_rank)
    if spec.confidence_head:
        width = HIDDEN_SIZE + (spec.markov_rank if spec.confidence_with_markov else 0)
        weights["confidence_head.proj.weight"] = rand(1, width)
        weights["confidence_head.proj.bias"] = torch.zeros(1)
    return weights


def save_dspark_draft(
    model_dir: Path, spec: DSparkDraftSpec, weights: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write config.json, model.safetensors and the tokenizer of a draft."""
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    if weights is None:
        weights = random_dspark_weights(spec)
    (model_dir / "config.json").write_text(json.dumps(dspark_draft_config(spec), indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").chmod(0o644)  # see build_qwen3_target
    build_tokenizer(model_dir)
    return model_dir


def oracle_dspark_weights(spec: DSparkDraftSpec) -> dict[str, torch.Tensor]:
    """Random backbone, zero Markov projection: paired with a zero-lm_head target,
    every draft logit ties at zero and argmax picks token 0, as the target does."""
    weights = random_dspark_weights(spec)
    weights["markov_head.markov_w2.weight"].zero_()
    return weights


def bigram_dspark_weights(
    spec: DSparkDraftSpec, target_dir: Path, blur: float = 0.3
) -> dict[str, torch.Tensor]:
    """For a ``bigram`` target: the Markov head reproduces the target's
    next-token function (W1 = the RMS-normalised embedding of the previous
    token, W2 = the target lm_head, scaled to dominate), so the chain drafts the
    target's own continuation; ``blur`` adds noise to W1 so that some positions
    disagree and accepted prefixes of every length occur. Needs
    ``spec.markov_rank == HIDDEN_SIZE``."""
    from safetensors.torch import load_file

    if spec.markov_rank != HIDDEN_SIZE:
        raise ValueError(f"bigram drafts need markov_rank={HIDDEN_SIZE}")
    target = load_file(str(target_dir / "model.safetensors"))
    embed = target["model.embed_tokens.weight"]
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + 1e-6)
    generator = torch.Generator().manual_seed(spec.seed + 1)
    weights = random_dspark_weights(spec)
    for i in range(spec.num_layers):
        weights[f"layers.{i}.self_attn.o_proj.weight"].zero_()
        weights[f"layers.{i}.mlp.down_proj.weight"].zero_()
    weights["markov_head.markov_w1.weight"] = normed + blur * torch.randn(
        normed.shape, generator=generator
    )
    weights["markov_head.markov_w2.weight"] = 10.0 * target["lm_head.weight"]
    return weights
