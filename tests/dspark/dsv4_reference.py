"""Tiny DeepSeek-V4 DSpark checkpoint with the real tensor names, and a float64 reference of the
draft written from the formulas (reference notes sections 4-5), independent of the module code."""

import math
import tempfile
import types

import torch
from torch import Tensor, nn

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import (
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.v1.spec_decode.dspark.deepseek_v4 import (
    TensorParallelShard,
    build_deepseek_v4_draft_model,
    load_deepseek_v4_draft,
)
from vllm.v1.spec_decode.dspark.draft_model import DSparkDraftModel

# Scaled-down DeepSeek-V4-Flash geometry (real: hidden 4096, 64 heads of 512 with 64 rotary dims,
# 256 experts top-6, W = 128, 3 stages, vocabulary 129280).
TINY_CONFIG: dict = {
    "model_type": "deepseek_v4",
    "architectures": ["DeepseekV4ForCausalLM"],
    "hidden_size": 64,
    "vocab_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 32,
    "o_lora_rank": 32,
    "o_groups": 2,
    "sliding_window": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 1.0,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "num_hash_layers": 3,
    "dspark_block_size": 4,
    "dspark_noise_token_id": 255,
    "dspark_target_layer_ids": [2, 3],
    "dspark_markov_rank": 16,
}


def synthetic_checkpoint(config: dict = TINY_CONFIG, seed: int = 0) -> dict[str, Tensor]:
    """``mtp.{s}.*`` tensors named and shaped as in DeepSeek-V4-Flash (fp32), plus a few target
    tensors the draft loader must ignore."""
    g = torch.Generator().manual_seed(seed)
    H, V, r = config["hidden_size"], config["vocab_size"], config["dspark_markov_rank"]
    heads, D = config["num_attention_heads"], config["head_dim"]
    groups, o_lora, q_lora = config["o_groups"], config["o_lora_rank"], config["q_lora_rank"]
    n, E, inter = config["hc_mult"], config["n_routed_experts"], config["moe_intermediate_size"]
    shared = inter * config["n_shared_experts"]
    stages = len(config["dspark_target_layer_ids"])

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> Tensor:
        return torch.randn(out_features, in_features, generator=g) * gain / math.sqrt(in_features)

    def norm(size: int) -> Tensor:
        return 1.0 + 0.2 * torch.randn(size, generator=g)

    def vector(*shape: int, scale: float = 1.0, shift: float = 0.0) -> Tensor:
        return torch.randn(*shape, generator=g) * scale + shift

    ckpt: dict[str, Tensor] = {
        "embed.weight": vector(V, H),
        "layers.0.attn.wq_a.weight": linear(q_lora, H),
        "head.weight": vector(V, H),
    }
    for s in range(stages):
        p = f"mtp.{s}."
        ckpt |= {
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
            ckpt |= {
                f"{p}hc_{part}_fn": linear((2 + n) * n, n * H),
                f"{p}hc_{part}_base": vector((2 + n) * n, scale=0.5),
                f"{p}hc_{part}_scale": vector(3, scale=0.3, shift=1.0),
            }
        for e in range(E):
            ckpt |= {
                f"{p}ffn.experts.{e}.w1.weight": linear(inter, H, gain=2.0),
                f"{p}ffn.experts.{e}.w2.weight": linear(H, inter),
                f"{p}ffn.experts.{e}.w3.weight": linear(inter, H, gain=2.0),
            }
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


class Float64Reference:
    """The draft in float64, one formula at a time, from the checkpoint tensors."""

    def __init__(self, checkpoint: dict[str, Tensor], config: dict = TINY_CONFIG) -> None:
        self.w = {k: v.double() for k, v in checkpoint.items()}
        self.c = config
        self.num_stages = len(config["dspark_target_layer_ids"])

    def p(self, stage: int, name: str) -> Tensor:
        return self.w[f"mtp.{stage}.{name}"]

    # Elementary formulas --------------------------------------------------------------------
    def rms(self, x: Tensor, weight: Tensor | None) -> Tensor:
        y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.c["rms_norm_eps"])
        return y if weight is None else y * weight

    def rope(self, x: Tensor, position: int, inverse: bool = False) -> Tensor:
        """Interleaved rotation of the last ``qk_rope_head_dim`` dims of a vector."""
        rd, D = self.c["qk_rope_head_dim"], x.shape[-1]
        out = x.clone()
        for i in range(rd // 2):
            angle = position * self.c["rope_theta"] ** (-2 * i / rd)
            if inverse:
                angle = -angle
            a, b = x[D - rd + 2 * i], x[D - rd + 2 * i + 1]
            out[D - rd + 2 * i] = a * math.cos(angle) - b * math.sin(angle)
            out[D - rd + 2 * i + 1] = b * math.cos(angle) + a * math.sin(angle)
        return out

    def mhc_pre(self, x: Tensor, fn: Tensor, base: Tensor, scale: Tensor):
        """x [n, H] (one token) -> (layer_input [H], post [n], comb [n, n])."""
        n, eps = self.c["hc_mult"], self.c["hc_eps"]
        flat = x.reshape(-1)
        mix = (fn @ flat) / math.sqrt((flat * flat).mean() + self.c["rms_norm_eps"])
        pre = torch.sigmoid(mix[:n] * scale[0] + base[:n]) + eps
        post = 2 * torch.sigmoid(mix[n : 2 * n] * scale[1] + base[n : 2 * n])
        comb = torch.softmax(mix[2 * n :].view(n, n) * scale[2] + base[2 * n :].view(n, n), -1)
        comb = comb + eps
        comb = comb / (comb.sum(0, keepdim=True) + eps)
        for _ in range(self.c["hc_sinkhorn_iters"] - 1):
            comb = comb / (comb.sum(1, keepdim=True) + eps)
            comb = comb / (comb.sum(0, keepdim=True) + eps)
        layer_input = sum(pre[i] * x[i] for i in range(n))
        return layer_input, post, comb

    def mhc_post(self, y: Tensor, x: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        n = self.c["hc_mult"]
        return torch.stack(
            [post[j] * y + sum(comb[i, j] * x[i] for i in range(n)) for j in range(n)]
        )

    def hc_head(self, x: Tensor) -> Tensor:
        """x [n, H] -> [H] with the last stage's hc_head weights."""
        last = self.num_stages - 1
        flat = x.reshape(-1)
        mix = (self.p(last, "hc_head_fn") @ flat) / math.sqrt(
            (flat * flat).mean() + self.c["rms_norm_eps"]
        )
        gate = torch.sigmoid(mix * self.p(last, "hc_head_scale") + self.p(last, "hc_head_base"))
        gate = gate + self.c["hc_eps"]
        return sum(gate[i] * x[i] for i in range(self.c["hc_mult"]))

    # Sub-blocks -------------------------------------------------------------------------------
    def kv(self, stage: int, hidden: Tensor, position: int) -> Tensor:
        kv = self.rms(
            self.p(stage, "attn.wkv.weight") @ hidden, self.p(stage, "attn.kv_norm.weight")
        )
        return self.rope(kv, position)

    def grouped_o(self, stage: int, heads_out: list[Tensor]) -> Tensor:
        groups, o_lora = self.c["o_groups"], self.c["o_lora_rank"]
        per_group = len(heads_out) // groups
        wo_a = self.p(stage, "attn.wo_a.weight")
        z = [
            wo_a[g * o_lora : (g + 1) * o_lora]
            @ torch.cat(heads_out[g * per_group : (g + 1) * per_group])
            for g in range(groups)
        ]
        return self.p(stage, "attn.wo_b.weight") @ torch.cat(z)

    def attention(
        self,
        stage: int,
        block: Tensor,
        positions: list[int],
        context: list[Tensor],
    ) -> Tensor:
        """block [n, H] of one request at ``positions``; ``context`` = the visible ring keys."""
        heads, D = self.c["num_attention_heads"], self.c["head_dim"]
        keys = context + [self.kv(stage, block[j], positions[j]) for j in range(len(positions))]
        sink = self.p(stage, "attn.attn_sink")
        out = []
        for i, pos in enumerate(positions):
            qa = self.rms(
                self.p(stage, "attn.wq_a.weight") @ block[i], self.p(stage, "attn.q_norm.weight")
            )
            q = (self.p(stage, "attn.wq_b.weight") @ qa).view(heads, D)
            heads_out = []
            for h in range(heads):
                qh = self.rope(self.rms(q[h], None), pos)
                scores = [float(qh @ k) / math.sqrt(D) for k in keys]
                m = max(max(scores), float(sink[h]))
                denominator = sum(math.exp(s - m) for s in scores) + math.exp(float(sink[h]) - m)
                o = sum(
                    math.exp(s - m) / denominator * k for s, k in zip(scores, keys, strict=True)
                )
                heads_out.append(self.rope(o, pos, inverse=True))
            out.append(self.grouped_o(stage, heads_out))
        return torch.stack(out)

    def route(self, stage: int, x: Tensor) -> tuple[list[int], list[float]]:
        logits = self.p(stage, "ffn.gate.weight") @ x
        scores = [math.sqrt(math.log1p(math.exp(float(v)))) for v in logits]
        bias = self.p(stage, "ffn.gate.bias")
        order = sorted(range(len(scores)), key=lambda e: -(scores[e] + float(bias[e])))
        chosen = order[: self.c["num_experts_per_tok"]]
        total = sum(scores[e] for e in chosen)
        return chosen, [scores[e] / total * self.c["routed_scaling_factor"] for e in chosen]

    def swiglu(self, w1: Tensor, w2: Tensor, w3: Tensor, x: Tensor) -> Tensor:
        limit = self.c["swiglu_limit"]
        gate = torch.clamp(w1 @ x, max=limit)
        up = torch.clamp(w3 @ x, min=-limit, max=limit)
        return w2 @ (gate * torch.sigmoid(gate) * up)

    def moe(self, stage: int, x: Tensor) -> Tensor:
        """x [H] (one token)."""
        chosen, weights = self.route(stage, x)
        out = self.swiglu(
            *(self.p(stage, f"ffn.shared_experts.{w}.weight") for w in ("w1", "w2", "w3")), x
        )
        for e, weight in zip(chosen, weights, strict=True):
            experts = (self.p(stage, f"ffn.experts.{e}.{w}.weight") for w in ("w1", "w2", "w3"))
            out = out + weight * self.swiglu(*experts, x)
        return out

    # Whole draft --------------------------------------------------------------------------------
    def context_entries(self, features: Tensor, position: int) -> Tensor:
        """One target row -> [stages, D]."""
        main_x = self.rms(
            self.p(0, "main_proj.weight") @ features.double(), self.p(0, "main_norm.weight")
        )
        return torch.stack([self.kv(s, main_x, position) for s in range(self.num_stages)])

    def sublayer(self, s: int, part: str, streams: Tensor, body) -> Tensor:
        """mHC pre -> RMSNorm -> body -> mHC post over streams [n_block, hc, H]."""
        weights = [self.p(s, f"hc_{part}_{k}") for k in ("fn", "base", "scale")]
        mixes = [self.mhc_pre(x, *weights) for x in streams]
        norm = self.p(s, f"{part}_norm.weight")
        y = body(torch.stack([self.rms(layer_input, norm) for layer_input, _, _ in mixes]))
        return torch.stack(
            [self.mhc_post(y[j], streams[j], post, comb) for j, (_, post, comb) in enumerate(mixes)]
        )

    def stage(self, s: int, streams: Tensor, positions: list[int], context: list[Tensor]) -> Tensor:
        streams = self.sublayer(
            s, "attn", streams, lambda u: self.attention(s, u, positions, context)
        )
        return self.sublayer(s, "ffn", streams, lambda u: torch.stack([self.moe(s, x) for x in u]))

    def block_hidden(
        self, embeds: Tensor, positions: list[int], context: Tensor
    ) -> tuple[Tensor, Tensor]:
        """One request: embeds [n, H], context [k, stages, D] (visible entries only)."""
        streams = embeds.double().unsqueeze(1).repeat(1, self.c["hc_mult"], 1)
        for s in range(self.num_stages):
            streams = self.stage(s, streams, positions, list(context[:, s].double()))
        dense = torch.stack([self.hc_head(x) for x in streams])
        return self.rms(dense, self.p(self.num_stages - 1, "norm.weight")), dense

    def markov_and_confidence(
        self, base_logits: Tensor, dense: Tensor, anchor_token: int
    ) -> tuple[list[int], list[float], float]:
        """Greedy Markov chain over base_logits [n, V]; returns drafts, confidences and the smallest
        top-1/top-2 logit gap met along the chain (how robust an exact token match is)."""
        last = self.num_stages - 1
        w1 = self.p(last, "markov_head.markov_w1.weight")
        w2 = self.p(last, "markov_head.markov_w2.weight")
        proj = self.p(last, "confidence_head.proj.weight")[0]
        previous, drafts, confidence, gap = anchor_token, [], [], math.inf
        for j in range(base_logits.shape[0]):
            logits = base_logits[j].double() + w2 @ w1[previous]
            top2 = torch.topk(logits, 2).values
            gap = min(gap, float(top2[0] - top2[1]))
            confidence.append(float(torch.sigmoid(proj @ torch.cat([dense[j], w1[previous]]))))
            previous = int(logits.argmax())
            drafts.append(previous)
        return drafts, confidence, gap


def build_draft(
    checkpoint: dict[str, Tensor] | None,
    config: dict = TINY_CONFIG,
    shard: TensorParallelShard | None = None,
    dtype: torch.dtype = torch.float32,
) -> DSparkDraftModel:
    """A draft as the proposer builds it (vLLM config set, one-process TP group), loaded
    strictly from ``checkpoint`` unless it is None."""
    with set_current_vllm_config(VllmConfig()):
        if not model_parallel_is_initialized():
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"file://{tempfile.mkstemp()[1]}",
                backend="gloo",
            )
            initialize_model_parallel(1)
        model = build_deepseek_v4_draft_model(
            config, vocab_size=config["vocab_size"], dtype=dtype, shard=shard
        )
    if checkpoint is not None:
        load_deepseek_v4_draft(model, checkpoint.items())
        # As the proposer does: vLLM's CPU linear layers (the Markov head) finish set-up here.
        model_config = types.SimpleNamespace(
            dtype=dtype, word_embeddings_untied_by_checkpoint=False, quantization=None
        )
        process_weights_after_loading(model, model_config, torch.device("cpu"))
    return model


class TinyTarget(nn.Module):
    """The two target pieces a draft shares: input embedding and lm_head (full vocabulary)."""

    def __init__(self, checkpoint: dict[str, Tensor]) -> None:
        super().__init__()
        self.embed = checkpoint["embed.weight"]
        self.head = checkpoint["head.weight"]

    def embed_input_ids(self, token_ids: Tensor) -> Tensor:
        return self.embed[token_ids]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return hidden @ self.head.t()
