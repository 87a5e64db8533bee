# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One DeepSeek-V4 DSpark draft stage, built from vLLM's own DeepSeek-V4 building blocks.

The MoE is the target's ``DeepseekV4MoE`` of the running platform (the class
``vllm.models.deepseek_v4`` selects: fused experts, FP4/FP8 as shipped, ``noaux_tc`` routing);
projections are vLLM's quantised linear layers, the hyper-connections vLLM's mHC custom ops, the
norms ``RMSNorm`` and the rotary DeepSeek-V4's own. Only the attention is ours: it reads the
proposer's ring instead of a paged KV cache.

Parameter names follow the checkpoint's ``mtp.{s}.*`` names with vLLM's renames (``fused_wqa_wkv``,
``gate_up_proj``, ``down_proj``, ``experts.w13_weight``, ``e_score_correction_bias``), so the loader
is a name map plus each parameter's own ``weight_loader``.
"""

import inspect
import sys

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.mhc import MHCPostOp, MHCPreOp
from vllm.models.deepseek_v4 import DeepseekV4ForCausalLM
from vllm.models.deepseek_v4.common.rope import build_deepseek_v4_rope
from vllm.platforms import current_platform

# mHC post-mix multiplier of every DeepSeek-V4 layer (``hc_post_alpha``).
HC_POST_ALPHA = 2.0


def platform_moe_class() -> type[nn.Module]:
    """``DeepseekV4MoE`` of the platform implementation ``vllm.models.deepseek_v4`` selected."""
    return sys.modules[DeepseekV4ForCausalLM.__module__].DeepseekV4MoE


def num_hash_layers(config: PretrainedConfig) -> int:
    """Leading hash-routed MoE layers of the target, as vLLM's NVIDIA model counts them
    (0.33.0: ``mlp_layer_types``; 0.32.0: ``num_hash_layers``)."""
    layer_types = getattr(config, "mlp_layer_types", None)
    if layer_types is not None:
        return list(layer_types).count("hash_moe")
    return getattr(config, "num_hash_layers", 0) or 0


def moe_kwargs(signature: inspect.Signature, config: PretrainedConfig) -> dict[str, object]:
    """The platform-specific arguments of a ``DeepseekV4MoE`` constructor with ``signature``.

    NVIDIA's takes a required keyword ``num_hash_layers`` (the draft's virtual layer ids lie past
    it, so it routes with ``noaux_tc``) and ``use_sequence_parallel``: the draft's block is not
    token-sharded, so False (``refuse_sequence_parallel`` stops the configurations that would
    need it). The AMD, XPU and CPU classes take ``(vllm_config, prefix)`` with defaults only.
    """
    kwargs: dict[str, object] = {}
    if "num_hash_layers" in signature.parameters:
        kwargs["num_hash_layers"] = num_hash_layers(config)
    if "use_sequence_parallel" in signature.parameters:
        kwargs["use_sequence_parallel"] = False
    return kwargs


def refuse_sequence_parallel(vllm_config: VllmConfig) -> None:
    """vLLM's NVIDIA DeepSeek-V4 shards the MoE's tokens across the TP group with expert parallel
    at TP > 1 and DP > 1 or a MegaMoE backend; the draft's stages do not shard their block."""
    use_sequence_parallel = getattr(
        sys.modules[DeepseekV4ForCausalLM.__module__], "_use_sequence_parallel", None
    )
    if use_sequence_parallel is not None and use_sequence_parallel(vllm_config):
        raise ValueError(
            "DeepSeek-V4 DSpark drafts do not run a sequence-parallel MoE, which this target "
            "uses (enable_expert_parallel with tensor_parallel_size > 1 and data_parallel_size "
            "> 1 or a MegaMoE moe_backend): drop enable_expert_parallel or the MegaMoE backend."
        )


def build_platform_moe(vllm_config: VllmConfig, prefix: str) -> nn.Module:
    """The running platform's ``DeepseekV4MoE``, called with the arguments it takes."""
    moe_class = platform_moe_class()
    config = vllm_config.model_config.hf_config
    return moe_class(vllm_config, prefix=prefix, **moe_kwargs(inspect.signature(moe_class), config))


def fp32_parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


def mhc_warmup_registrations(
    vllm_config: VllmConfig, config: PretrainedConfig, include_pre_gemm_splits: bool
) -> list[tuple[str, tuple[object, ...], dict[str, object]]]:
    """``(kernel, args, kwargs)`` for ``register_warmup`` of every TileLang mHC kernel variant a
    draft stage calls (``kernel`` names an object of ``kernels/mhc/tilelang_kernels.py``).

    The target's layers warm the pre kernel with a fused norm weight only; the draft's
    ``MHCPreOp`` call has none (its norms are separate ``RMSNorm``), a variant that would
    otherwise JIT-compile at its first call, mid-profile or mid-serve.
    """
    hidden, n = config.hidden_size, config.hc_mult
    registrations: list[tuple[str, tuple[object, ...], dict[str, object]]] = [
        (
            "_MHC_PRE_BIG_FUSE_TILELANG_KERNEL",
            (vllm_config,),
            dict(
                hidden_size=hidden,
                hc_mult=n,
                use_norm_weight=False,
                include_pre_gemm_splits=include_pre_gemm_splits,
                include_broadcast_splits=False,
                rms_eps=config.rms_norm_eps,
                hc_pre_eps=config.hc_eps,
                hc_sinkhorn_eps=config.hc_eps,
                hc_post_mult_value=HC_POST_ALPHA,
                sinkhorn_repeat=config.hc_sinkhorn_iters,
                norm_eps=0.0,
            ),
        ),
        ("_MHC_POST_TILELANG_KERNEL", (), dict(hidden_size=hidden, hc_mult=n)),
        (
            "_HC_HEAD_FUSED_TILELANG_KERNEL",
            (),
            dict(hidden_size=hidden, hc_mult=n, rms_eps=config.rms_norm_eps, hc_eps=config.hc_eps),
        ),
    ]
    if not include_pre_gemm_splits:
        registrations.append(
            (
                "_HC_PRENORM_GEMM_TILELANG_KERNEL",
                (vllm_config,),
                dict(hidden_size=hidden, hc_mult=n, n_out=n * (2 + n)),
            )
        )
    return registrations


def register_mhc_warmup(vllm_config: VllmConfig, config: PretrainedConfig) -> None:
    """On CUDA (mHC is TileLang only there), queue the draft's mHC variants in the runner's JIT
    warm-up, as vLLM's DeepSeek-V4 layers do for theirs. Needs the runner's registry active."""
    if not (vllm_config.kernel_config.enable_jit_warmup and current_platform.is_cuda()):
        return
    from vllm.model_executor.kernels.mhc import tilelang_kernels
    from vllm.utils.deep_gemm import is_deep_gemm_supported

    for name, args, kwargs in mhc_warmup_registrations(
        vllm_config, config, is_deep_gemm_supported()
    ):
        getattr(tilelang_kernels, name).register_warmup(*args, **kwargs)


class RingAttention(nn.Module):
    """MQA with a learned sink over [ring entries ; block keys], non-causal within the block.

    One shared ``head_dim``-wide KV head is both key and value; queries and keys carry interleaved
    RoPE on their last ``qk_rope_head_dim`` dims, the output is rotated back by the query position
    and projected by the grouped low-rank ``wo_a`` (one quantised linear per output group) and
    ``wo_b``. Heads, groups and the sink are split across tensor-parallel ranks.
    """

    def __init__(self, vllm_config: VllmConfig, config: PretrainedConfig, prefix: str) -> None:
        super().__init__()
        quant_config = vllm_config.quant_config
        tp_size = get_tensor_model_parallel_world_size()
        self.head_dim, self.rope_dim = config.head_dim, config.qk_rope_head_dim
        self.q_lora_rank = config.q_lora_rank
        self.num_heads = config.num_attention_heads // tp_size
        self.num_groups = config.o_groups // tp_size
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.fused_wqa_wkv = MergedColumnParallelLinear(
            config.hidden_size,
            [config.q_lora_rank, config.head_dim],
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.fused_wqa_wkv",
            disable_tp=True,
        )
        self.q_norm = RMSNorm(config.q_lora_rank, self.eps)
        self.wq_b = ColumnParallelLinear(
            config.q_lora_rank,
            config.num_attention_heads * self.head_dim,
            bias=False,
            quant_config=quant_config,
            return_bias=False,
            prefix=f"{prefix}.wq_b",
        )
        self.kv_norm = RMSNorm(self.head_dim, self.eps)
        self.attn_sink = fp32_parameter(self.num_heads)
        group_width = config.num_attention_heads // config.o_groups * self.head_dim
        first_group = get_tensor_model_parallel_rank() * self.num_groups
        self.wo_a = nn.ModuleList(
            ReplicatedLinear(
                group_width,
                config.o_lora_rank,
                bias=False,
                quant_config=quant_config,
                return_bias=False,
                prefix=f"{prefix}.wo_a.{first_group + g}",
            )
            for g in range(self.num_groups)
        )
        self.wo_b = RowParallelLinear(
            config.o_groups * config.o_lora_rank,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            return_bias=False,
            prefix=f"{prefix}.wo_b",
        )
        # Draft stages sit past the target's layers, where DeepSeek-V4 uses compress ratio 1.
        self.rotary_emb = build_deepseek_v4_rope(
            config,
            head_dim=self.head_dim,
            rope_head_dim=self.rope_dim,
            max_position_embeddings=config.max_position_embeddings,
            compress_ratio=1,
        )

    def rope(self, x: Tensor, positions: Tensor, inverse: bool = False) -> Tensor:
        """``x [T, heads, head_dim]`` rotated at ``positions [T]`` (last rope dims, interleaved)."""
        return self.rotary_emb.forward_native(positions, x, inverse=inverse)[0]

    def kv(self, hidden: Tensor, positions: Tensor) -> Tensor:
        """``[T, H] -> [T, head_dim]``: RoPE(kv_norm(wkv(hidden))), a ring entry or block key."""
        kv = self.fused_wqa_wkv(hidden)[0][..., self.q_lora_rank :]
        return self.rope(self.kv_norm(kv).unsqueeze(1), positions).squeeze(1)

    def forward(
        self, hidden: Tensor, positions: Tensor, context: Tensor, context_mask: Tensor
    ) -> Tensor:
        """``hidden [B, n, H]``, ``positions [B, n]``, ``context [B, W, D]``, ``context_mask
        [B, W]`` -> ``[B, n, H]``."""
        batch, block = hidden.shape[:2]
        flat_positions = positions.reshape(-1)
        qa, kv = self.fused_wqa_wkv(hidden.flatten(0, 1))[0].split(
            [self.q_lora_rank, self.head_dim], dim=-1
        )
        q = self.wq_b(self.q_norm(qa)).view(-1, self.num_heads, self.head_dim)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)
        q = self.rope(q, flat_positions).view(batch, block, self.num_heads, self.head_dim)
        block_keys = self.rope(self.kv_norm(kv).unsqueeze(1), flat_positions)
        keys = torch.cat([context.to(q.dtype), block_keys.view(batch, block, -1)], dim=1)

        visible = torch.cat([context_mask, context_mask.new_ones(batch, block)], dim=1)
        scores = torch.einsum("bqhd,bkd->bhqk", q.float(), keys.float()) * self.scale
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        sink = self.attn_sink.view(1, -1, 1, 1).expand(batch, -1, block, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out = torch.einsum("bhqk,bkd->bqhd", weights, keys.float()).to(q.dtype)
        out = self.rope(out.flatten(0, 1), flat_positions, inverse=True)

        # Group-major and contiguous per group: quantised linears take contiguous rows (the FP8
        # activation quantisation of a strided column chunk leaves its CUDA kernel).
        grouped = out.reshape(out.shape[0], self.num_groups, -1).transpose(0, 1).contiguous()
        low_rank = torch.cat([wo_a(x) for wo_a, x in zip(self.wo_a, grouped, strict=True)], -1)
        return self.wo_b(low_rank).view(batch, block, -1)


class DSparkStage(nn.Module):
    """One draft stage: mHC-wrapped ring attention, then the mHC-wrapped DeepSeek-V4 MoE.

    Named as upstream's ``DeepseekV4DecoderLayer`` of a DSpark draft, so that upstream's
    checkpoint remap lands here; the heads around the stages live in the model.
    """

    def __init__(self, vllm_config: VllmConfig, config: PretrainedConfig, prefix: str) -> None:
        super().__init__()
        hidden, eps, n = config.hidden_size, config.rms_norm_eps, config.hc_mult
        self.hc_mult, self.rms_eps, self.hc_eps = n, eps, config.hc_eps
        self.sinkhorn_iters = config.hc_sinkhorn_iters
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", fp32_parameter((2 + n) * n, n * hidden))
            setattr(self, f"hc_{part}_base", fp32_parameter((2 + n) * n))
            setattr(self, f"hc_{part}_scale", fp32_parameter(3))
        self.attn_norm = RMSNorm(hidden, eps)
        self.ffn_norm = RMSNorm(hidden, eps)
        self.attn = RingAttention(vllm_config, config, prefix=f"{prefix}.attn")
        self.ffn = build_platform_moe(vllm_config, prefix=f"{prefix}.ffn")
        self.mhc_pre = MHCPreOp()
        self.mhc_post = MHCPostOp()
        register_mhc_warmup(vllm_config, config)

    def _pre(self, streams: Tensor, part: str) -> tuple[Tensor, Tensor, Tensor]:
        post, comb, layer_input = self.mhc_pre(
            residual=streams,
            fn=getattr(self, f"hc_{part}_fn"),
            hc_scale=getattr(self, f"hc_{part}_scale"),
            hc_base=getattr(self, f"hc_{part}_base"),
            rms_eps=self.rms_eps,
            hc_pre_eps=self.hc_eps,
            hc_sinkhorn_eps=self.hc_eps,
            hc_post_mult_value=HC_POST_ALPHA,
            sinkhorn_repeat=self.sinkhorn_iters,
        )
        return layer_input, post, comb

    def forward(
        self,
        streams: Tensor,
        positions: Tensor,
        context: Tensor,
        context_mask: Tensor,
    ) -> Tensor:
        """``streams [B*n, hc, H]`` of the block at ``positions [B, n]`` -> the same shape."""
        batch, block = positions.shape
        u, post, comb = self._pre(streams, "attn")
        u = self.attn_norm(u).view(batch, block, -1)
        o = self.attn(u, positions, context, context_mask).flatten(0, 1)
        streams = self.mhc_post(o, streams, post, comb)
        u, post, comb = self._pre(streams, "ffn")
        # Draft stages lie past num_hash_layers: routing needs no token ids.
        f = self.ffn(self.ffn_norm(u))
        return self.mhc_post(f, streams, post, comb)
