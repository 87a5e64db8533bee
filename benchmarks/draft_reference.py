# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Plain-torch forward of DeepSpec-format Qwen3 block drafts (DSpark and DFlash).

Written from vLLM's conventions so that a draft trained or scored here means the
same thing inside the engine:

* target features at target layer t are the residual stream after decoder layer t
  (before the final norm), concatenated over `target_layer_ids` in order, then
  `fc` and `hidden_norm` give the context states;
* per draft layer, context K = RoPE(k_norm(k_proj(ctx))) at the context position
  and V = v_proj(ctx); block queries attend to every context key at a position
  <= the anchor a (the last position with target features) and to all block keys
  (non-causal);
* DSpark (`sample_from_anchor`, upstream V2): block `[c, noise x (k-1)]` at
  positions a+1..a+k, slot j predicts position a+2+j, and a low-rank Markov head
  adds `markov_w2 @ markov_w1[prev_j]` (prev_0 = c, then the previous draft);
* DFlash (vLLM V1 `DFlashProposer`): block `[c, noise x k]` at a+1..a+1+k, slot
  j >= 1 predicts its own position a+1+j; no Markov head.

Either way prediction i (0-based) is for position a+2+i, where c sits at a+1.

The engine tests check vLLM's drafts against a second reference on purpose
(``tests/engine/test_dspark_reference.py``): float64, one block at a time, derived from
DeepSpec's code rather than from this module, so that the two agree only if both read the
checkpoint as DeepSpec does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ROPE_THETA = 10000.0
RMS_EPS = 1e-6


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * weight


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding; `x` is [..., seq, heads, head_dim], `positions`
    broadcasts against [..., seq]."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / ROPE_THETA ** (
        torch.arange(0, head_dim, 2, dtype=torch.float32, device=x.device) / head_dim
    )
    angles = positions.to(torch.float32)[..., None] * inv_freq
    cos = torch.cat([angles.cos(), angles.cos()], -1)[..., None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[..., None, :]
    half = head_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class TargetFeatureTap:
    """Runs a Hugging Face Qwen3 target and keeps the residual stream after the
    tapped decoder layers (HF's last `hidden_states` entry is post-norm, so the
    decoder layers are hooked instead)."""

    def __init__(self, target: torch.nn.Module, layer_ids: list[int]) -> None:
        if any(i < 0 for i in layer_ids):
            raise ValueError("layer id -1 (embedding output) is not supported here")
        self.target = target
        self.layer_ids = layer_ids

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[batch, seq] token ids -> [batch, seq, len(layer_ids) * hidden]."""
        captured: dict[int, torch.Tensor] = {}
        hooks = []
        for layer_id in self.layer_ids:

            def hook(_module, _args, output, layer_id=layer_id):
                captured[layer_id] = output[0] if isinstance(output, tuple) else output

            hooks.append(self.target.model.layers[layer_id].register_forward_hook(hook))
        try:
            self.target(input_ids=input_ids, use_cache=False)
        finally:
            for handle in hooks:
                handle.remove()
        return torch.cat([captured[i] for i in self.layer_ids], dim=-1)


@dataclass(frozen=True)
class BlockLayout:
    """Where the block sits and which slots predict, for k drafted tokens."""

    num_draft_tokens: int
    sample_from_anchor: bool  # True: DSpark; False: vLLM V1 DFlash
    block_start_shift: int = 0  # RoPE positions of the block move by this (fault injection)

    @property
    def first_predicting_slot(self) -> int:
        return 0 if self.sample_from_anchor else 1

    @property
    def block_len(self) -> int:
        return self.num_draft_tokens + self.first_predicting_slot


class TorchBlockDraft(torch.nn.Module):
    """A Qwen3 block draft over DeepSpec tensor names; embed and lm_head are the
    target's, frozen. The Markov head is used when its weights are present."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        embed_tokens: torch.Tensor,
        lm_head: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        noise_token_id: int,
    ) -> None:
        super().__init__()
        self.params = torch.nn.ParameterDict(
            {name.replace(".", "__"): torch.nn.Parameter(w.clone()) for name, w in weights.items()}
        )
        self.register_buffer("embed_tokens", embed_tokens.detach().clone())
        self.register_buffer("lm_head", lm_head.detach().clone())
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.noise_token_id = noise_token_id
        self.num_layers = sum(1 for name in weights if name.endswith("self_attn.q_proj.weight"))
        self.has_markov = "markov_head.markov_w1.weight" in weights

    def weight(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "__")]

    def state_dict_deepspec(self) -> dict[str, torch.Tensor]:
        return {name.replace("__", "."): p.detach().clone() for name, p in self.params.items()}

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], num_heads, self.head_dim)

    def context_states(self, features: torch.Tensor) -> torch.Tensor:
        return F.linear(features, self.weight("fc.weight"))

    def _attention(
        self,
        layer: int,
        hidden: torch.Tensor,
        block_positions: torch.Tensor,
        ctx: torch.Tensor,
        ctx_positions: torch.Tensor,
        ctx_visible: torch.Tensor,
    ) -> torch.Tensor:
        """hidden [B, n, L, H] block states; ctx [B, T, H]; ctx_visible [B, n, T]."""
        p = f"layers.{layer}.self_attn."
        q = self._heads(F.linear(hidden, self.weight(p + "q_proj.weight")), self.num_heads)
        k = self._heads(F.linear(hidden, self.weight(p + "k_proj.weight")), self.num_kv_heads)
        v = self._heads(F.linear(hidden, self.weight(p + "v_proj.weight")), self.num_kv_heads)
        q = rope(rms_norm(q, self.weight(p + "q_norm.weight")), block_positions)
        k = rope(rms_norm(k, self.weight(p + "k_norm.weight")), block_positions)
        ctx_normed = rms_norm(ctx, self.weight("hidden_norm.weight"))
        ck = self._heads(F.linear(ctx_normed, self.weight(p + "k_proj.weight")), self.num_kv_heads)
        cv = self._heads(F.linear(ctx_normed, self.weight(p + "v_proj.weight")), self.num_kv_heads)
        ck = rope(rms_norm(ck, self.weight(p + "k_norm.weight")), ctx_positions)

        group = self.num_heads // self.num_kv_heads
        scale = self.head_dim**-0.5
        # Scores against context keys [B, n, h, L, T] and block keys [B, n, h, L, L].
        ck_h = ck.repeat_interleave(group, dim=2)  # [B, T, h, d]
        cv_h = cv.repeat_interleave(group, dim=2)
        k_h = k.repeat_interleave(group, dim=3)  # [B, n, L, h, d]
        v_h = v.repeat_interleave(group, dim=3)
        ctx_scores = torch.einsum("bnlhd,bthd->bnhlt", q, ck_h) * scale
        ctx_scores = ctx_scores.masked_fill(~ctx_visible[:, :, None, None, :], float("-inf"))
        blk_scores = torch.einsum("bnlhd,bnmhd->bnhlm", q, k_h) * scale
        probs = torch.softmax(torch.cat([ctx_scores, blk_scores], dim=-1), dim=-1)
        num_ctx = ctx.shape[1]
        out = torch.einsum("bnhlt,bthd->bnlhd", probs[..., :num_ctx], cv_h)
        out = out + torch.einsum("bnhlm,bnmhd->bnlhd", probs[..., num_ctx:], v_h)
        return F.linear(out.flatten(-2), self.weight(p + "o_proj.weight"))

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        p = f"layers.{layer}.mlp."
        gate = F.silu(F.linear(x, self.weight(p + "gate_proj.weight")))
        return F.linear(
            gate * F.linear(x, self.weight(p + "up_proj.weight")),
            self.weight(p + "down_proj.weight"),
        )

    def base_logits(
        self,
        features: torch.Tensor,
        token_ids: torch.Tensor,
        anchors: torch.Tensor,
        layout: BlockLayout,
    ) -> torch.Tensor:
        """Backbone logits [B, n, k] x vocab of prediction i = position a+2+i.

        features [B, T, nT*H] and token_ids [B, T] of whole sequences; anchors [B, n]
        index the last context position; c = token_ids[a+1].
        """
        batch, num_ctx = token_ids.shape
        ctx = self.context_states(features)
        ctx_positions = torch.arange(num_ctx).expand(batch, num_ctx)
        ctx_visible = ctx_positions[:, None, :] <= anchors[..., None]  # [B, n, T]

        offsets = torch.arange(layout.block_len)
        block_positions = anchors[..., None] + 1 + layout.block_start_shift + offsets  # [B, n, L]
        anchor_tokens = torch.gather(token_ids, 1, anchors + 1)  # c, [B, n]
        block_tokens = torch.full_like(block_positions, self.noise_token_id)
        block_tokens[..., 0] = anchor_tokens
        hidden = F.embedding(block_tokens, self.embed_tokens)
        for layer in range(self.num_layers):
            p = f"layers.{layer}."
            normed = rms_norm(hidden, self.weight(p + "input_layernorm.weight"))
            hidden = hidden + self._attention(
                layer, normed, block_positions, ctx, ctx_positions, ctx_visible
            )
            normed = rms_norm(hidden, self.weight(p + "post_attention_layernorm.weight"))
            hidden = hidden + self._mlp(layer, normed)
        hidden = rms_norm(
            hidden[..., layout.first_predicting_slot :, :], self.weight("norm.weight")
        )
        return F.linear(hidden, self.lm_head)

    def markov_bias(self, previous_tokens: torch.Tensor) -> torch.Tensor:
        """Logit bias W2 @ W1[prev] for each previous token."""
        embedded = F.embedding(previous_tokens, self.weight("markov_head.markov_w1.weight"))
        return F.linear(embedded, self.weight("markov_head.markov_w2.weight"))

    def teacher_forced_logits(
        self,
        features: torch.Tensor,
        token_ids: torch.Tensor,
        anchors: torch.Tensor,
        layout: BlockLayout,
    ) -> torch.Tensor:
        """Training logits: the Markov head sees the true previous tokens
        (positions a+1 .. a+k)."""
        logits = self.base_logits(features, token_ids, anchors, layout)
        if not self.has_markov:
            return logits
        previous_positions = anchors[..., None] + 1 + torch.arange(layout.num_draft_tokens)
        previous = torch.gather(token_ids, 1, previous_positions.flatten(1)).view_as(
            previous_positions
        )
        return logits + self.markov_bias(previous)

    @torch.no_grad()
    def draft(
        self,
        features: torch.Tensor,
        token_ids: torch.Tensor,
        anchors: torch.Tensor,
        layout: BlockLayout,
    ) -> torch.Tensor:
        """Greedy drafts [B, n, k]: argmax chain through the Markov head."""
        logits = self.base_logits(features, token_ids, anchors, layout)
        if not self.has_markov:
            return logits.argmax(-1)
        previous = torch.gather(token_ids, 1, anchors + 1)
        drafts = []
        for i in range(layout.num_draft_tokens):
            previous = (logits[..., i, :] + self.markov_bias(previous)).argmax(-1)
            drafts.append(previous)
        return torch.stack(drafts, dim=-1)
