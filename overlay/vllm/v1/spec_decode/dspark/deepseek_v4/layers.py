"""Torch building blocks of one DeepSeek-V4 DSpark draft stage.

vLLM's DeepSeek-V4 layers read and write paged KV caches through GPU (or vLLM-CPU C++) kernels; the
draft instead attends over the proposer's ring, so attention, MoE dispatch and the hyper-connection
head are written here in plain torch. vLLM's own torch references are reused where they exist: the
mHC pre/post math (``kernels/mhc/torch.py``), the DeepSeek-V4 rotary embedding (with its inverse),
``RMSNorm`` and the clamped SwiGLU.

Tensor parallelism: every module holds only this rank's shard (see ``TensorParallelShard``) and
returns a partial sum where the full model all-reduces; the stage performs that reduction.
"""

from collections.abc import Callable

import torch
from torch import Tensor, nn

from vllm.model_executor.kernels.mhc.torch import mhc_post_torch, mhc_pre_delayed_torch
from vllm.model_executor.layers.activation import SiluAndMulWithClamp
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
    DeepseekV4ScalingRotaryEmbedding,
)

from .config import DeepSeekV4DSparkConfig, TensorParallelShard

AllReduce = Callable[[Tensor], Tensor]

# mHC post-mix multiplier of every DeepSeek-V4 layer (``hc_post_alpha``).
HC_POST_ALPHA = 2.0


def _empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class HyperConnection(nn.Module):
    """mHC mixing around one sub-block: ``pre`` collapses the n streams, ``post`` expands back."""

    def __init__(self, config: DeepSeekV4DSparkConfig) -> None:
        super().__init__()
        n, width = config.hc_mult, config.hc_mult * config.hidden_size
        self.fn = _empty((2 + n) * n, width, dtype=torch.float32)
        self.base = _empty((2 + n) * n, dtype=torch.float32)
        self.scale = _empty(3, dtype=torch.float32)
        self.rms_eps = config.rms_norm_eps
        self.hc_eps = config.hc_eps
        self.sinkhorn_iters = config.hc_sinkhorn_iters

    def pre(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """streams [T, n, H] -> (layer_input [T, H], post [T, n, 1], comb [T, n, n]).

        vLLM's torch reference returns ``(post, comb, ...)``; the order is fixed here once.
        """
        post, comb, _, pre = mhc_pre_delayed_torch(
            streams,
            self.fn,
            self.scale,
            self.base,
            rms_eps=self.rms_eps,
            hc_pre_eps=self.hc_eps,
            hc_sinkhorn_eps=self.hc_eps,
            hc_post_mult_value=HC_POST_ALPHA,
            sinkhorn_repeat=self.sinkhorn_iters,
        )
        layer_input = (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)
        return layer_input, post, comb

    @staticmethod
    def post(output: Tensor, streams: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        """out_j = post_j * output + sum_i comb[i, j] * streams_i."""
        return mhc_post_torch(output, streams, post, comb)


class HyperConnectionHead(nn.Module):
    """Collapses the n streams of the last stage into one hidden state (sigmoid-gated sum)."""

    def __init__(self, config: DeepSeekV4DSparkConfig) -> None:
        super().__init__()
        n = config.hc_mult
        self.fn = _empty(n, n * config.hidden_size, dtype=torch.float32)
        self.base = _empty(n, dtype=torch.float32)
        self.scale = _empty(1, dtype=torch.float32)
        self.rms_eps = config.rms_norm_eps
        self.hc_eps = config.hc_eps

    def forward(self, streams: Tensor) -> Tensor:
        flat = streams.flatten(-2).float()
        normed = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.rms_eps)
        gate = torch.sigmoid(normed @ self.fn.t() * self.scale + self.base) + self.hc_eps
        return (gate.unsqueeze(-1) * streams.float()).sum(dim=-2).to(streams.dtype)


class DSparkAttention(nn.Module):
    """MQA with a learned sink over [ring entries ; block keys], non-causal within the block.

    One shared ``head_dim``-wide KV head serves as both key and value; queries and keys carry
    interleaved RoPE on their last ``qk_rope_head_dim`` dims, and the output is rotated back by the
    query position before the grouped low-rank output projection.
    """

    def __init__(
        self,
        config: DeepSeekV4DSparkConfig,
        rotary: DeepseekV4ScalingRotaryEmbedding,
        shard: TensorParallelShard,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        head_start, head_end = shard.range(config.num_attention_heads, "num_attention_heads")
        group_start, group_end = shard.range(config.o_groups, "o_groups")
        self.num_heads = head_end - head_start
        self.num_groups = group_end - group_start
        self.head_dim = head_dim
        self.eps = config.rms_norm_eps
        self.scale = head_dim**-0.5
        self.rotary = rotary
        heads_per_group = config.num_attention_heads // config.o_groups

        self.wq_a = nn.Linear(hidden, config.q_lora_rank, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps, dtype=dtype)
        self.wq_b = nn.Linear(
            config.q_lora_rank, self.num_heads * head_dim, bias=False, dtype=dtype
        )
        self.wkv = nn.Linear(hidden, head_dim, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(head_dim, eps=config.rms_norm_eps, dtype=dtype)
        self.attn_sink = _empty(self.num_heads, dtype=torch.float32)
        self.wo_a = nn.Linear(
            heads_per_group * head_dim,
            self.num_groups * config.o_lora_rank,
            bias=False,
            dtype=dtype,
        )
        self.wo_b = nn.Linear(self.num_groups * config.o_lora_rank, hidden, bias=False, dtype=dtype)
        self.o_lora_rank = config.o_lora_rank

    def rope(self, x: Tensor, positions: Tensor, inverse: bool = False) -> Tensor:
        """x [..., heads, head_dim] rotated at positions [...] (last rope dims, interleaved)."""
        return self.rotary.forward_native(positions, x, inverse=inverse)[0]

    def kv(self, hidden: Tensor, positions: Tensor) -> Tensor:
        """hidden [..., H] -> RoPE(kv_norm(wkv(hidden))) [..., D]: a ring entry or block key."""
        kv = self.kv_norm(self.wkv(hidden))
        return self.rope(kv.unsqueeze(-2), positions).squeeze(-2)

    def forward(
        self, hidden: Tensor, positions: Tensor, context: Tensor, context_mask: Tensor
    ) -> Tensor:
        """hidden [B, n, H], positions [B, n], context [B, W, D], context_mask [B, W] -> [B, n, H]
        (this rank's partial sum)."""
        batch, block = hidden.shape[:2]
        q = self.wq_b(self.q_norm(self.wq_a(hidden))).view(batch, block, self.num_heads, -1)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)
        q = self.rope(q, positions)

        keys = torch.cat([context.to(q.dtype), self.kv(hidden, positions)], dim=1)
        visible = torch.cat([context_mask, context_mask.new_ones(batch, block)], dim=1)
        scores = torch.einsum("bqhd,bkd->bhqk", q.float(), keys.float()) * self.scale
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        sink = self.attn_sink.view(1, -1, 1, 1).expand(batch, -1, block, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out = torch.einsum("bhqk,bkd->bqhd", weights, keys.float()).to(q.dtype)
        out = self.rope(out, positions, inverse=True)
        return self.wo_b(self.grouped_wo_a(out))

    def grouped_wo_a(self, out: Tensor) -> Tensor:
        """out [B, n, heads, D] -> [B, n, groups * o_lora_rank]: group g's heads through wo_a[g]."""
        grouped = out.flatten(-2).unflatten(-1, (self.num_groups, -1))
        weight = self.wo_a.weight.view(self.num_groups, self.o_lora_rank, -1)
        return torch.einsum("bngk,grk->bngr", grouped, weight).flatten(-2)


class SharedExpert(nn.Module):
    """Dense SwiGLU expert; ``gate_up_proj`` stacks the checkpoint's w1 (gate) and w3 (up)."""

    def __init__(
        self, hidden: int, intermediate: int, activation: SiluAndMulWithClamp, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.activation.forward_native(self.gate_up_proj(x)))


class DSparkMoE(nn.Module):
    """DeepSeek-V4 non-hash MoE: sqrt(softplus) scores, bias-steered top-k, renormalised weights
    times ``routed_scaling_factor``, clamped SwiGLU experts, plus the shared expert."""

    def __init__(
        self, config: DeepSeekV4DSparkConfig, shard: TensorParallelShard, dtype: torch.dtype
    ) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.expert_start, expert_end = shard.range(config.n_routed_experts, "n_routed_experts")
        num_local = expert_end - self.expert_start
        shared_start, shared_end = shard.range(
            inter * config.n_shared_experts, "moe_intermediate_size * n_shared_experts"
        )
        self.top_k = config.num_experts_per_tok
        self.routed_scaling_factor = config.routed_scaling_factor
        self.activation = SiluAndMulWithClamp(config.swiglu_limit)

        self.gate = nn.Linear(hidden, config.n_routed_experts, bias=False, dtype=torch.float32)
        self.gate.e_score_correction_bias = _empty(config.n_routed_experts, dtype=torch.float32)
        self.experts = nn.Module()
        self.experts.w13_weight = _empty(num_local, 2 * inter, hidden, dtype=dtype)
        self.experts.w2_weight = _empty(num_local, hidden, inter, dtype=dtype)
        self.shared_experts = SharedExpert(
            hidden, shared_end - shared_start, self.activation, dtype
        )

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k]); the bias steers selection only."""
        scores = torch.sqrt(nn.functional.softplus(self.gate(x.float())))
        ids = torch.topk(scores + self.gate.e_score_correction_bias, self.top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        weights = weights / weights.sum(-1, keepdim=True) * self.routed_scaling_factor
        return weights, ids

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> [..., H] (this rank's partial sum: local experts + shared shard)."""
        x = hidden.reshape(-1, hidden.shape[-1])
        weights, ids = self.route(x)
        out = torch.zeros_like(x, dtype=torch.float32)
        local_ids = ids - self.expert_start
        for local in torch.unique(local_ids):
            expert = int(local)
            if not 0 <= expert < self.experts.w13_weight.shape[0]:
                continue  # owned by another tensor-parallel rank
            token, slot = torch.nonzero(local_ids == local, as_tuple=True)
            gate_up = x[token] @ self.experts.w13_weight[expert].t()
            y = self.activation.forward_native(gate_up) @ self.experts.w2_weight[expert].t()
            out.index_add_(0, token, y.float() * weights[token, slot, None])
        out += self.shared_experts(x).float()
        return out.to(hidden.dtype).view_as(hidden)


class DSparkStage(nn.Module):
    """One draft stage: mHC-wrapped attention then mHC-wrapped MoE over the n residual streams.

    Stage 0 also owns ``main_proj``/``main_norm`` (target features -> context hidden); the last
    stage owns the hyper-connection head and the final ``norm``.
    """

    def __init__(
        self,
        config: DeepSeekV4DSparkConfig,
        index: int,
        rotary: DeepseekV4ScalingRotaryEmbedding,
        shard: TensorParallelShard,
        all_reduce: AllReduce | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.all_reduce = all_reduce
        self.hc_attn = HyperConnection(config)
        self.hc_ffn = HyperConnection(config)
        self.attn_norm = RMSNorm(hidden, eps=eps, dtype=dtype)
        self.ffn_norm = RMSNorm(hidden, eps=eps, dtype=dtype)
        self.attn = DSparkAttention(config, rotary, shard, dtype)
        self.ffn = DSparkMoE(config, shard, dtype)
        if index == 0:
            self.main_proj = nn.Linear(config.feature_size, hidden, bias=False, dtype=dtype)
            self.main_norm = RMSNorm(hidden, eps=eps, dtype=dtype)
        if index == config.num_stages - 1:
            self.hc_head = HyperConnectionHead(config)
            self.norm = RMSNorm(hidden, eps=eps, dtype=dtype)

    def reduce(self, partial: Tensor) -> Tensor:
        return partial if self.all_reduce is None else self.all_reduce(partial)

    def forward(
        self, streams: Tensor, positions: Tensor, context: Tensor, context_mask: Tensor
    ) -> Tensor:
        """streams [B, n, hc, H] -> [B, n, hc, H]."""
        batch, block, hc, hidden = streams.shape
        flat = streams.reshape(batch * block, hc, hidden)

        u, post, comb = self.hc_attn.pre(flat)
        u = self.attn_norm(u).view(batch, block, hidden)
        o = self.reduce(self.attn(u, positions, context, context_mask))
        flat = self.hc_attn.post(o.reshape(batch * block, hidden), flat, post, comb)

        u, post, comb = self.hc_ffn.pre(flat)
        f = self.reduce(self.ffn(self.ffn_norm(u)))
        flat = self.hc_ffn.post(f, flat, post, comb)
        return flat.view(batch, block, hc, hidden)
