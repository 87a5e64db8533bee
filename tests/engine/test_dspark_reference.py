"""Drafts from the proposer's paged draft context equal a naive full recompute.

The reference below is written from the DSpark formulas in float64 and shares
no code with the overlay: target features come from Hugging Face's Qwen3 (the
residual stream after each tapped layer), and every logged draft block is
recomputed from the whole context before its anchor. Draft tokens are argmaxes,
so a draft token is accepted when its reference logit is within ``TOLERANCE``
of the best (float32 engine vs float64 reference; near-ties may legitimately
flip). The Markov chain is fed the logged drafts, so one such tie cannot
cascade into the positions after it.
"""

import json
from pathlib import Path

import pytest
import torch

from dspark_demo import tiny_models
from dspark_demo.engine import dspark_config, read_draft_log, run_engine

pytestmark = pytest.mark.engine

K = 4
# float32 logits of magnitude ~1 carry ~1e-6 error; 1e-4 leaves a wide margin
# while any real mismatch (wrong position, stale ring entry) moves logits by ~1e-2.
TOLERANCE = 1e-4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Neox-style rotary embedding of ``x`` ``[T, heads, D]``."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.double()[:, None] * inv_freq[None]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]
    rotated = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    return x * cos + rotated * sin


class TargetFeatures:
    """Residual stream after each tapped layer of the HF target (-1: the
    embeddings), float64, concatenated in config order."""

    def __init__(self, target_dir: Path, layer_ids: list[int]) -> None:
        from transformers import Qwen3ForCausalLM

        self.model = Qwen3ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float64)
        self.layer_ids = layer_ids

    @torch.no_grad()
    def __call__(self, token_ids: list[int]) -> torch.Tensor:
        captured: dict[int, torch.Tensor] = {}

        def capture(i: int):
            return lambda _m, _inp, out: captured.__setitem__(
                i, out[0] if isinstance(out, tuple) else out
            )

        model = self.model.model
        hooks = [
            (model.embed_tokens if i == -1 else model.layers[i]).register_forward_hook(capture(i))
            for i in self.layer_ids
        ]
        try:
            self.model(torch.tensor([token_ids]))
        finally:
            for hook in hooks:
                hook.remove()
        return torch.cat([captured[i][0] for i in self.layer_ids], dim=-1)


class NaiveDSparkDraft:
    """One DSpark block from scratch: context K/V over every position up to the
    anchor, the block [anchor token, noise...] right after it, then Markov."""

    def __init__(self, draft_dir: Path, target_dir: Path) -> None:
        from safetensors.torch import load_file

        self.w = {k: v.double() for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
        target = load_file(str(target_dir / "model.safetensors"))
        self.embed = target["model.embed_tokens.weight"].double()
        self.lm_head = target["lm_head.weight"].double()
        config = json.loads((draft_dir / "config.json").read_text())
        self.num_layers = config["num_hidden_layers"]
        self.heads = config["num_attention_heads"]
        self.kv_heads = config["num_key_value_heads"]
        self.head_dim = config["head_dim"]
        self.noise = config["mask_token_id"]  # DeepSpec's top-level key

    def _heads(self, x: torch.Tensor, n: int, norm: torch.Tensor) -> torch.Tensor:
        return rms_norm(x.view(x.shape[0], n, self.head_dim), norm)

    def block_logits(
        self, features: torch.Tensor, anchor: int, anchor_token: int, drafts: list[int]
    ) -> torch.Tensor:
        w = self.w
        context = rms_norm(features[: anchor + 1] @ w["fc.weight"].T, w["hidden_norm.weight"])
        context_positions = torch.arange(anchor + 1)
        block_positions = torch.arange(anchor + 1, anchor + 1 + K)
        x = self.embed[[anchor_token] + [self.noise] * (K - 1)]
        for i in range(self.num_layers):
            layer = {k.split(".", 2)[2]: v for k, v in w.items() if k.startswith(f"layers.{i}.")}

            def keys_values(states, positions, layer=layer):
                k = states @ layer["self_attn.k_proj.weight"].T
                k = self._heads(k, self.kv_heads, layer["self_attn.k_norm.weight"])
                v = states @ layer["self_attn.v_proj.weight"].T
                return rope(k, positions), v.view(-1, self.kv_heads, self.head_dim)

            ctx_k, ctx_v = keys_values(context, context_positions)
            h = rms_norm(x, layer["input_layernorm.weight"])
            q = self._heads(
                h @ layer["self_attn.q_proj.weight"].T, self.heads, layer["self_attn.q_norm.weight"]
            )
            q = rope(q, block_positions)
            k, v = keys_values(h, block_positions)
            group = self.heads // self.kv_heads
            keys = torch.cat([ctx_k, k]).repeat_interleave(group, dim=1)
            values = torch.cat([ctx_v, v]).repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, keys) / self.head_dim**0.5
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(K, -1)
            x = x + attn @ layer["self_attn.o_proj.weight"].T
            h = rms_norm(x, layer["post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(h @ layer["mlp.gate_proj.weight"].T)
            x = x + (gate * (h @ layer["mlp.up_proj.weight"].T)) @ layer["mlp.down_proj.weight"].T
        # The full block is drafted; only its first len(drafts) slots are verified.
        logits = (rms_norm(x, w["norm.weight"]) @ self.lm_head.T)[: len(drafts)]
        previous = [anchor_token, *drafts[:-1]]
        markov = w["markov_head.markov_w1.weight"][previous] @ w["markov_head.markov_w2.weight"].T
        return logits + markov


@pytest.mark.parametrize(
    ("taps", "k"), [([0, 1], K), ([-1, 1], 2)], ids=["taps-0-1-k=block", "taps-emb-1-k<block"]
)
def test_paged_drafts_equal_full_recompute(tiny, tmp_path, taps, k):
    """Also shows the runner taps exactly the config's layers (-1 = the
    embeddings) and that k < block drafts the full block."""
    spec = tiny_models.DSparkDraftSpec(target_layer_ids=taps)
    draft_dir = tiny_models.save_dspark_draft(tmp_path / "draft", spec, target=tiny.random_target)
    prompts = ["w5 w6 w7 w8 w5 w6", "w10 " * 20, "w300 w12 w999 w4 w87 w87 w1 w2 w3"]
    prompts = [p.strip() for p in prompts]
    log = tmp_path / "drafts.jsonl"
    # Chunked prefill and three requests at a time, so the draft context is
    # written in ragged steps; the draft attends to the full context.
    run = run_engine(
        tiny.random_target,
        prompts,
        [30, 24, 36],
        dspark_config(draft_dir, k=k, draft_log=str(log)),
        max_num_seqs=3,
        max_num_batched_tokens=16,
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny.random_target))
    features = TargetFeatures(tiny.random_target, layer_ids=taps)
    draft = NaiveDSparkDraft(draft_dir, tiny.random_target)

    checked = 0
    for index, prompt in enumerate(prompts):
        sequence = tokenizer(prompt)["input_ids"] + run.token_ids[index]
        sequence_features = features(sequence)
        for anchor, record in sorted(read_draft_log(log)[str(index)].items()):
            if anchor + 1 >= len(sequence) or record["anchor_token"] != sequence[anchor + 1]:
                continue  # a partial-prefill step: its drafts are discarded by vLLM
            logits = draft.block_logits(
                sequence_features, anchor, record["anchor_token"], record["drafts"]
            )
            chosen = logits.gather(1, torch.tensor(record["drafts"])[:, None]).squeeze(1)
            gap = (logits.max(dim=1).values - chosen).max().item()
            assert gap <= TOLERANCE, (index, anchor, record["drafts"], logits.argmax(1).tolist())
            checked += 1
    assert checked >= 60
