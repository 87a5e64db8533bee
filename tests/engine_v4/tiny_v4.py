"""A tiny DeepSeek-V4 target whose checkpoint carries its DSpark draft as ``mtp.*``.

Config keys and tensor names are those DeepSeek-V4-Flash ships (``embed.weight``,
``layers.{i}.attn.wq_a.weight``, ``mtp.{s}.ffn.experts.{e}.w1.weight``, ...); sizes are cut down
except ``head_dim`` 512 and ``qk_rope_head_dim`` 64, which vLLM's DeepSeek-V4 CPU kernels require.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from dspark_demo.tiny_models import build_tokenizer

VOCAB_SIZE = 1000
NOISE_TOKEN_ID = 4

TINY_V4_CONFIG: dict = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 64,
    "o_lora_rank": 64,
    "o_groups": 2,
    "sliding_window": 128,
    "compress_ratios": [0, 0],
    "compress_rope_theta": 160000.0,
    "index_topk": 64,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 4096,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "num_hash_layers": 0,
    "num_nextn_predict_layers": 1,
    "expert_dtype": "bf16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
    "dspark_block_size": 4,
    "dspark_noise_token_id": NOISE_TOKEN_ID,
    "dspark_target_layer_ids": [0, 1],
    "dspark_markov_rank": 16,
}


def _layer_tensors(prefix: str, c: dict, linear: Callable, norm: Callable, vector: Callable):
    H, heads, D = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    groups, o_lora, q_lora = c["o_groups"], c["o_lora_rank"], c["q_lora_rank"]
    n, E, inter = c["hc_mult"], c["n_routed_experts"], c["moe_intermediate_size"]
    shared = inter * c["n_shared_experts"]
    p = prefix
    t = {
        p + "attn.wq_a.weight": linear(q_lora, H),
        p + "attn.wq_b.weight": linear(heads * D, q_lora),
        p + "attn.wkv.weight": linear(D, H),
        p + "attn.wo_a.weight": linear(groups * o_lora, heads // groups * D),
        p + "attn.wo_b.weight": linear(H, groups * o_lora),
        p + "attn.q_norm.weight": norm(q_lora),
        p + "attn.kv_norm.weight": norm(D),
        p + "attn.attn_sink": vector(heads),
        p + "attn_norm.weight": norm(H),
        p + "ffn_norm.weight": norm(H),
        p + "ffn.gate.weight": linear(E, H, gain=2.0),
        p + "ffn.gate.bias": vector(E, scale=0.3),
        p + "ffn.shared_experts.w1.weight": linear(shared, H, gain=2.0),
        p + "ffn.shared_experts.w2.weight": linear(H, shared),
        p + "ffn.shared_experts.w3.weight": linear(shared, H, gain=2.0),
    }
    for part in ("attn", "ffn"):
        t[f"{p}hc_{part}_fn"] = linear((2 + n) * n, n * H)
        t[f"{p}hc_{part}_base"] = vector((2 + n) * n, scale=0.5)
        t[f"{p}hc_{part}_scale"] = vector(3, scale=0.3, shift=1.0)
    for e in range(E):
        t[f"{p}ffn.experts.{e}.w1.weight"] = linear(inter, H, gain=2.0)
        t[f"{p}ffn.experts.{e}.w2.weight"] = linear(H, inter)
        t[f"{p}ffn.experts.{e}.w3.weight"] = linear(inter, H, gain=2.0)
    return t


def random_v4_checkpoint(config: dict = TINY_V4_CONFIG, seed: int = 0) -> dict[str, Tensor]:
    """Target and ``mtp.*`` draft tensors, fp32, with the names DeepSeek-V4-Flash ships."""
    g = torch.Generator().manual_seed(seed)
    H, V, r, n = (config[k] for k in ("hidden_size", "vocab_size", "dspark_markov_rank", "hc_mult"))

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> Tensor:
        return torch.randn(out_features, in_features, generator=g) * gain / math.sqrt(in_features)

    def norm(size: int) -> Tensor:
        return 1.0 + 0.2 * torch.randn(size, generator=g)

    def vector(*shape: int, scale: float = 1.0, shift: float = 0.0) -> Tensor:
        return torch.randn(*shape, generator=g) * scale + shift

    ckpt = {
        "embed.weight": vector(V, H),
        "head.weight": vector(V, H, scale=1.0 / math.sqrt(H)),
        "norm.weight": norm(H),
        "hc_head_fn": linear(n, n * H),
        "hc_head_base": vector(n, scale=0.5),
        "hc_head_scale": vector(1, scale=0.3, shift=1.0),
    }
    for i in range(config["num_hidden_layers"]):
        ckpt |= _layer_tensors(f"layers.{i}.", config, linear, norm, vector)
    stages = len(config["dspark_target_layer_ids"])
    for s in range(stages):
        ckpt |= _layer_tensors(f"mtp.{s}.", config, linear, norm, vector)
    ckpt |= {"mtp.0.main_proj.weight": linear(H, stages * H), "mtp.0.main_norm.weight": norm(H)}
    last = f"mtp.{stages - 1}."
    ckpt |= {
        last + "norm.weight": norm(H),
        last + "hc_head_fn": linear(n, n * H),
        last + "hc_head_base": vector(n, scale=0.5),
        last + "hc_head_scale": vector(1, scale=0.3, shift=1.0),
        last + "markov_head.markov_w1.weight": vector(V, r),
        last + "markov_head.markov_w2.weight": linear(V, r, gain=3.0),
        last + "confidence_head.proj.weight": linear(1, H + r),
    }
    return ckpt


def save_v4_target(
    model_dir: Path, checkpoint: dict[str, Tensor], config: dict = TINY_V4_CONFIG
) -> Path:
    """Write ``config.json``, ``model.safetensors`` (bf16) and a word-level tokenizer."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in checkpoint.items()}
    save_file(tensors, str(model_dir / "model.safetensors"))
    build_tokenizer(model_dir)
    return model_dir
