# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Drafts in the engine equal DeepSpec's draft forward, recomputed from scratch.

The reference below follows DeepSpec's own modeling code for its Qwen3 drafts
(``deepspec/modeling/dspark/qwen3/modeling.py``: ``Qwen3DSparkModel._forward_backbone``
and ``Qwen3DSparkAttention.forward``) in float64 and shares no code with the
overlay or with vLLM: the context is ``hidden_norm(fc(target features))`` for
every position before the block; in each draft layer the keys of context and
block are projected by that layer's ``k_proj`` and normalised by **that layer's**
``k_norm``, RoPE'd at their absolute positions, and every block query attends to
the whole context and the whole block. Target features come from Hugging
Face's Qwen3 (the residual stream after each tapped layer). Every logged draft
block is recomputed from the whole context before its anchor.

``benchmarks/draft_reference.py`` holds a second plain-torch Qwen3 draft on purpose: a
trainable float32 module written from vLLM's conventions, to train and score drafts in batches.
This one is derived independently, from DeepSpec's code, so that a convention both got wrong
would not go unseen.

Draft tokens are argmaxes, so a draft token is accepted when its reference
logit is within ``TOLERANCE`` of the best (float32 engine vs float64
reference; near-ties may legitimately flip). The Markov chain is fed the logged
drafts, so one such tie cannot cascade into the positions after it.

The tiny drafts have two layers with distinct, non-unit norm weights, so a
context K-norm that applies one layer's weight to another's keys (vLLM's
stacked ``rms_norm`` call on CPU, which the ``qwen3-dflash`` patch replaces)
fails the comparison: ``test_recompute_check_fails_with_the_stacked_k_norm``.
"""

import json
from pathlib import Path

import pytest
import torch

from dspark_fixtures.checkpoints import qwen3
from dspark_fixtures.engine import TinyEngine, dspark_config, read_draft_log, run_engine

K = 4
# float32 logits of magnitude ~1 carry ~1e-6 error; 1e-4 leaves a wide margin
# while any real mismatch (wrong position, another layer's norm) moves logits by ~1e-2.
TOLERANCE = 1e-4
PROMPTS = ["w5 w6 w7 w8 w5 w6", ("w10 " * 20).strip(), "w300 w12 w999 w4 w87 w87 w1 w2 w3"]
MAX_TOKENS = [30, 24, 36]
# Chunked prefill and three requests at a time, so the draft context is
# written in ragged steps; the draft attends to the full context.
CHUNKED = dict(max_num_seqs=3, max_num_batched_tokens=16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed if weight is None else normed * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """HF's ``rotate_half`` rotary embedding of ``x`` ``[T, heads, D]``."""
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
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float64)
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


class DeepSpecQwen3Draft:
    """DeepSpec's Qwen3 draft forward for one block, in float64.

    ``sample_from_anchor``: DeepSpec's block ``[anchor token, mask, ...]``,
    every slot a prediction, plus the Markov head (DSpark); otherwise DFlash's
    ``[anchor token, mask x k]`` block whose slots after the first predict,
    without a Markov head (upstream DFlash drafts)."""

    def __init__(self, draft_dir: Path, target_dir: Path) -> None:
        from safetensors.torch import load_file

        self.w = {k: v.double() for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
        target = load_file(str(target_dir / "model.safetensors"))
        # DeepSpec's drafts ship frozen copies of the target's; DFlash's share them.
        self.embed = self.w.get("embed_tokens.weight", target["model.embed_tokens.weight"].double())
        self.lm_head = self.w.get("lm_head.weight", target["lm_head.weight"].double())
        config = json.loads((draft_dir / "config.json").read_text())
        taps = config.get("dflash_config") or config
        self.noise = taps["mask_token_id"]
        self.num_layers = config["num_hidden_layers"]
        self.heads = config["num_attention_heads"]
        self.kv_heads = config["num_key_value_heads"]
        self.head_dim = config["head_dim"]

    def _layer(self, i: int) -> dict[str, torch.Tensor]:
        prefix = f"layers.{i}."
        return {k.removeprefix(prefix): v for k, v in self.w.items() if k.startswith(prefix)}

    def _attention(self, p: dict, h, context, block_positions, context_positions):
        """``Qwen3DSparkAttention.forward``: context and block keys through the
        layer's own k_proj and k_norm, RoPE at absolute positions, no mask."""
        n, d = len(block_positions), self.head_dim
        q = rms_norm(
            (h @ p["self_attn.q_proj.weight"].T).view(n, self.heads, d),
            p["self_attn.q_norm.weight"],
        )
        k = torch.cat(
            [context @ p["self_attn.k_proj.weight"].T, h @ p["self_attn.k_proj.weight"].T]
        )
        v = torch.cat(
            [context @ p["self_attn.v_proj.weight"].T, h @ p["self_attn.v_proj.weight"].T]
        )
        k = rms_norm(k.view(-1, self.kv_heads, d), p["self_attn.k_norm.weight"])
        v = v.view(-1, self.kv_heads, d)
        positions = torch.cat([context_positions, block_positions])
        q, k = rope(q, block_positions), rope(k, positions)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
        return out @ p["self_attn.o_proj.weight"].T

    def block_logits(
        self,
        features: torch.Tensor,
        anchor: int,
        anchor_token: int,
        drafts: list[int],
        block_size: int,
        sample_from_anchor: bool = True,
    ) -> torch.Tensor:
        """Logits of the logged drafts of the block after context position
        ``anchor`` (the anchor token sits at ``anchor + 1``)."""
        w = self.w
        context = rms_norm(features[: anchor + 1] @ w["fc.weight"].T, w["hidden_norm.weight"])
        context_positions = torch.arange(anchor + 1)
        block_positions = torch.arange(anchor + 1, anchor + 1 + block_size)
        x = self.embed[[anchor_token] + [self.noise] * (block_size - 1)]
        for i in range(self.num_layers):
            p = self._layer(i)
            h = rms_norm(x, p["input_layernorm.weight"])
            x = x + self._attention(p, h, context, block_positions, context_positions)
            h = rms_norm(x, p["post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(h @ p["mlp.gate_proj.weight"].T)
            x = x + (gate * (h @ p["mlp.up_proj.weight"].T)) @ p["mlp.down_proj.weight"].T
        logits = rms_norm(x, w["norm.weight"]) @ self.lm_head.T
        if not sample_from_anchor:
            return logits[1 : 1 + len(drafts)]
        # The full block is drafted; only its first len(drafts) slots are verified.
        previous = [anchor_token, *drafts[:-1]]
        markov = w["markov_head.markov_w1.weight"][previous] @ w["markov_head.markov_w2.weight"].T
        return logits[: len(drafts)] + markov


def draft_gaps(
    log: Path,
    prompts: list[str],
    token_ids: list[list[int]],
    reference,
    target: Path,
    taps: list[int],
    block_size: int,
    sample_from_anchor: bool = True,
) -> list[float]:
    """Per logged decode step, how far the worst draft token's reference logit
    lies below the reference's best (0: every draft is the reference's argmax).
    ``reference.block_logits`` recomputes one block."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    features = TargetFeatures(target, layer_ids=taps)
    gaps = []
    for index, prompt in enumerate(prompts):
        sequence = tokenizer(prompt)["input_ids"] + token_ids[index]
        sequence_features = features(sequence)
        for anchor, record in sorted(read_draft_log(log)[str(index)].items()):
            if anchor + 1 >= len(sequence) or record["anchor_token"] != sequence[anchor + 1]:
                continue  # a partial-prefill step: its drafts are discarded by vLLM
            logits = reference.block_logits(
                sequence_features,
                anchor,
                record["anchor_token"],
                record["drafts"],
                block_size,
                sample_from_anchor,
            )
            chosen = logits.gather(1, torch.tensor(record["drafts"])[:, None]).squeeze(1)
            gaps.append((logits.max(dim=1).values - chosen).max().item())
    return gaps


def dspark_gaps(tiny, tmp_path: Path, taps: list[int], k: int) -> list[float]:
    spec = qwen3.DSparkDraftSpec(target_layer_ids=taps)
    draft_dir = qwen3.save_dspark_draft(tmp_path / "draft", spec, target=tiny.random_target)
    log = tmp_path / "drafts.jsonl"
    run = run_engine(
        tiny.random_target,
        PROMPTS,
        MAX_TOKENS,
        dspark_config(draft_dir, k=k, dspark_draft_log=str(log)),
        **CHUNKED,
    )
    reference = DeepSpecQwen3Draft(draft_dir, tiny.random_target)
    target = tiny.random_target
    return draft_gaps(log, PROMPTS, run.token_ids, reference, target, taps, spec.block_size)


@pytest.mark.parametrize(
    ("taps", "k"), [([0, 1], K), ([-1, 1], 2)], ids=["taps-0-1-k=block", "taps-emb-1-k<block"]
)
def test_paged_drafts_equal_deepspec_recompute(tiny, tmp_path, taps, k):
    """Also shows the runner taps exactly the config's layers (-1 = the
    embeddings) and that k < block drafts the full block."""
    gaps = dspark_gaps(tiny, tmp_path, taps, k)
    assert len(gaps) >= 60
    assert max(gaps) <= TOLERANCE, [round(g, 4) for g in gaps]


def stacked_k_norm(self, all_k: torch.Tensor) -> torch.Tensor:
    """Upstream's call: one rms_norm over every layer's keys with the stacked
    ``[L, head_dim]`` weights (on CPU every layer gets row 0)."""
    from vllm import _custom_ops as ops

    all_k_normed = torch.empty_like(all_k)
    ops.rms_norm(all_k_normed, all_k, self._k_norm_weights, self._rms_norm_eps)
    return all_k_normed


def test_recompute_check_fails_with_the_stacked_k_norm(tiny, tmp_path, monkeypatch):
    """The check above has teeth: with upstream's stacked K-norm call restored,
    the second draft layer's context keys get the first layer's norm and the
    drafts leave the reference at many steps."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    monkeypatch.setattr(DFlashQwen3Model, "_normalize_context_k", stacked_k_norm)
    gaps = dspark_gaps(tiny, tmp_path, [0, 1], K)
    wrong = sum(gap > TOLERANCE for gap in gaps)
    assert wrong >= len(gaps) // 4, (wrong, len(gaps))


def test_upstream_dflash_drafts_equal_deepspec_recompute(tiny, tmp_path):
    """Upstream DFlash (``method: dflash``) under the install: the same
    two-layer backbone in DFlash's layout drafts as the reference's DFlash
    block. DFlash writes no draft log, so the proposer's output is logged
    here, in the ``dspark_draft_log`` format."""
    from vllm.v1.spec_decode.dspark.draft_log import DraftLog

    spec = qwen3.DSparkDraftSpec()
    draft_dir = qwen3.save_dflash_draft(
        tmp_path / "dflash", spec, qwen3.random_dspark_weights(spec)
    )
    k = spec.block_size - 1  # DFlash: the block is the anchor token and k masks
    log = tmp_path / "dflash.jsonl"
    config = {"method": "dflash", "model": str(draft_dir), "num_speculative_tokens": k}
    draft_log = DraftLog(str(log))
    with TinyEngine(tiny.random_target, config, **CHUNKED) as engine:
        drafter = engine.model_runner.drafter
        propose = drafter.propose

        def logged_propose(*args, **kwargs):
            drafts = propose(*args, **kwargs)
            rows = torch.arange(drafts.shape[0]) * (1 + k)
            draft_log.append(
                engine.model_runner.input_batch.req_ids[: drafts.shape[0]],
                drafter.positions[rows] - 1,
                drafter.input_ids[rows],
                drafts,
                None,
            )
            return drafts

        drafter.propose = logged_propose
        run = engine.generate(PROMPTS, MAX_TOKENS)
    reference = DeepSpecQwen3Draft(draft_dir, tiny.random_target)
    taps = spec.target_layer_ids
    gaps = draft_gaps(
        log, PROMPTS, run.token_ids, reference, tiny.random_target, taps, 1 + k, False
    )
    assert len(gaps) >= 60
    assert max(gaps) <= TOLERANCE, [round(g, 4) for g in gaps]
