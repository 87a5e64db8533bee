# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""A tiny DeepSeek-V4 target whose checkpoint carries its DSpark draft as ``mtp.*``.

Config keys and tensor names are those DeepSeek-V4-Flash ships (the config starts from the
published one, ``dspark_fixtures.deepseek_v4_flash.V4_FLASH_CONFIG``; tensors ``embed.weight``,
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

from dspark_fixtures.checkpoints.common import NOISE_TOKEN_ID, VOCAB_SIZE, build_tokenizer
from dspark_fixtures.deepseek_v4_flash import V4_FLASH_CONFIG

# The published DeepSeek-V4-Flash config, cut down: every key it ships, unquantised, 2 layers
# without compression or hash routing, 64 experts (the fewest ``biased_topk_cpu`` takes).
TINY_V4_CONFIG: dict = {
    **{key: value for key, value in V4_FLASH_CONFIG.items() if key != "quantization_config"},
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "q_lora_rank": 64,
    "o_lora_rank": 64,
    "o_groups": 2,
    "compress_ratios": [0, 0],
    "index_topk": 64,
    "index_n_heads": 4,
    "rope_scaling": None,
    "max_position_embeddings": 4096,
    "n_routed_experts": 64,
    "moe_intermediate_size": 32,
    "num_hash_layers": 0,
    "expert_dtype": "bf16",
    "bos_token_id": 1,
    "eos_token_id": 2,
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
    model_dir: Path,
    checkpoint: dict[str, Tensor],
    config: dict = TINY_V4_CONFIG,
    keep_dtypes: bool = False,
) -> Path:
    """Write ``config.json``, ``model.safetensors`` (bf16, or each tensor's own dtype with
    ``keep_dtypes``) and a word-level tokenizer."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {
        k: (v if keep_dtypes else v.to(torch.bfloat16)).contiguous() for k, v in checkpoint.items()
    }
    save_file(tensors, str(model_dir / "model.safetensors"))
    build_tokenizer(model_dir)
    return model_dir


# The ring-reading oracle ------------------------------------------------------------------------
# Token t's greedy successor is cycle_next(t): ids are grouped in cycles of PERIOD, so every
# sequence the bigram target writes repeats with that period. The oracle draft predicts slot j by
# attending to the ring entry exactly PERIOD positions before the slot's own RoPE position; with
# the block at (a + 1) + j that entry holds the token at a + 1 + j - PERIOD, which equals the token
# at a + 1 + j, so the draft's lm_head read gives the right next token. Any other phase reads a
# token one cycle step off and every draft is wrong. The period is longer than a step's k + 1 rows,
# so the entries read were written steps earlier: a request reading another's slot fails.
PERIOD = 37
_ROPE_PAIRS = 8  # highest-frequency rotary pairs the oracle's queries and keys use
_CONSTANT = 4.0  # the embedding coordinate every token shares (drives the position-only scores)
_KEY_GAIN = 13.0  # kv_norm weight on the rotary dims: score gap about 30 nats per position
_OUTPUT_GAIN = 20.0  # wo_b gain: the attention read outweighs the block token's own embedding


def cycle_next(token: int, period: int = PERIOD, vocab_size: int = VOCAB_SIZE) -> int:
    """The bigram target's greedy successor of ``token``: ids cycle in groups of ``period``
    (the last, partial group cycles on its own)."""
    base = period * (token // period)
    return base + (token - base + 1) % min(period, vocab_size - base)


def cycle_prompt(first: int, length: int, period: int = PERIOD) -> list[int]:
    """``length`` tokens that follow the cycle from ``first``."""
    tokens = [first]
    while len(tokens) < length:
        tokens.append(cycle_next(tokens[-1], period))
    return tokens


def _rotated_pairs(angle_per_pair: list[float], rope_dim: int) -> Tensor:
    """A rope-dim vector whose interleaved pair i is (cos a_i, sin a_i); later pairs zero."""
    out = torch.zeros(rope_dim)
    for i, angle in enumerate(angle_per_pair):
        out[2 * i], out[2 * i + 1] = math.cos(angle), math.sin(angle)
    return out


def oracle_v4_checkpoint(
    config: dict = TINY_V4_CONFIG,
    target_noise: float = 0.0,
    period: int = PERIOD,
    seed: int = 0,
) -> dict[str, Tensor]:
    """The tiny V4 checkpoint turned into the ring-reading oracle.

    Target: every layer's output projections are scaled by ``target_noise`` (0: the residual
    stream stays the token's embedding and greedy decoding follows ``cycle_next``; > 0: a
    context-dependent target that mostly follows it). Draft: stage 0 reads the ring entry PERIOD
    positions back; everything else in the draft adds nothing (zero outputs, uniform mHC).
    ``period`` must lie in [k, sliding_window].

    Every norm keeps a per-layer, non-unit weight, as trained ones have. Where the oracle's read
    passes through a norm, the linear after it is divided by that weight (``_unscaled``), so the
    read is what unit norms would give: the target's final norm into ``head``, ``attn_norm``
    into ``wq_a``, ``q_norm`` into ``wq_b``, ``main_norm`` into ``wkv`` (the block's keys, which
    the read does not attend to, keep a small per-dim scale), ``kv_norm`` into ``wo_a``; its
    rotary dims keep one gain per RoPE pair, which keeps every score's peak at PERIOD.
    """
    ckpt = random_v4_checkpoint(config, seed)
    H, V, D, rd = (config[k] for k in ("hidden_size", "vocab_size", "head_dim", "qk_rope_head_dim"))
    heads, groups, o_lora, n = (
        config[k] for k in ("num_attention_heads", "o_groups", "o_lora_rank", "hc_mult")
    )
    g = torch.Generator().manual_seed(seed + 1)
    embed = torch.randn(V, H, generator=g)
    embed[:, -1] = _CONSTANT
    head = torch.zeros(V, H)
    for token in range(V):
        head[cycle_next(token, period, V), :-1] = embed[token, :-1]
    ckpt["head.weight"] = _unscaled(head, ckpt["norm.weight"])
    ckpt["embed.weight"] = embed
    for i in range(config["num_hidden_layers"]):
        for name in list(ckpt):
            if name.startswith(f"layers.{i}.") and name.endswith(("wo_b.weight", "w2.weight")):
                ckpt[name] = ckpt[name] * target_noise

    theta = config["rope_theta"]
    freqs = [theta ** (-2 * i / rd) for i in range(_ROPE_PAIRS)]
    key_rope = _rotated_pairs([0.0] * _ROPE_PAIRS, rd)
    query_rope = _rotated_pairs([-period * f for f in freqs], rd)  # key_rope rotated by -period
    stages = len(config["dspark_target_layer_ids"])
    for s in range(stages):
        p = f"mtp.{s}."
        for name in list(ckpt):
            if name.startswith(p) and name.endswith(("wo_b.weight", "w2.weight")):
                ckpt[name] = torch.zeros_like(ckpt[name])
        for part in ("attn", "ffn"):
            ckpt[f"{p}hc_{part}_fn"] = torch.zeros_like(ckpt[f"{p}hc_{part}_fn"])
            ckpt[f"{p}hc_{part}_base"] = torch.zeros_like(ckpt[f"{p}hc_{part}_base"])
    last = f"mtp.{stages - 1}."
    ckpt[last + "hc_head_fn"] = torch.zeros(n, n * H)
    ckpt[last + "hc_head_base"] = torch.zeros(n)
    ckpt[last + "markov_head.markov_w1.weight"] = torch.zeros_like(
        ckpt[last + "markov_head.markov_w1.weight"]
    )

    p = "mtp.0."
    eye = torch.eye(H)
    ckpt[p + "main_proj.weight"] = torch.cat([eye, torch.zeros(H, (stages - 1) * H)], dim=1)
    wkv = torch.zeros(D, H)
    wkv[: H - 1, : H - 1] = torch.eye(H - 1)
    wkv[D - rd :, H - 1] = key_rope
    kv_norm = ckpt[p + "attn.kv_norm.weight"].clone()
    pair_gain = 1.0 + 0.1 * torch.randn(rd // 2, generator=g)
    kv_norm[D - rd :] = _KEY_GAIN * pair_gain.repeat_interleave(2)
    wq_b = torch.zeros(heads * D, H)
    for h in range(heads):
        wq_b[h * D + D - rd : (h + 1) * D, H - 1] = query_rope
    wo_a = torch.zeros(groups * o_lora, heads // groups * D)
    wo_a[: H - 1, : H - 1] = torch.eye(H - 1)  # group 0, head 0, non-rotary dims
    wo_b = torch.zeros(H, groups * o_lora)
    wo_b[: H - 1, : H - 1] = _OUTPUT_GAIN * torch.eye(H - 1)
    ckpt |= {
        p + "attn.wq_a.weight": _unscaled(eye, ckpt[p + "attn_norm.weight"]),
        p + "attn.wq_b.weight": _unscaled(wq_b, ckpt[p + "attn.q_norm.weight"]),
        p + "attn.wkv.weight": _unscaled(wkv, ckpt[p + "main_norm.weight"]),
        p + "attn.kv_norm.weight": kv_norm,
        p + "attn.attn_sink": torch.full((heads,), -30.0),
        p + "attn.wo_a.weight": _unscaled(wo_a, torch.cat([kv_norm[: D - rd], torch.ones(rd)])),
        p + "attn.wo_b.weight": wo_b,
    }
    return ckpt


def _unscaled(linear: Tensor, norm_weight: Tensor) -> Tensor:
    """``linear`` whose input channels are divided by the norm weight before it (for a grouped
    linear, the weight of one group's input): the pair gives what a unit norm would."""
    return linear / norm_weight.repeat(linear.shape[1] // norm_weight.numel())
