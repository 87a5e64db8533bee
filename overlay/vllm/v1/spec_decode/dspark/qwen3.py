"""Draft backbone for DeepSpec-format Qwen3 DSpark checkpoints (``Qwen3DSparkModel``).

Same network as upstream vLLM's ``qwen3_dspark.py`` / ``qwen3_dflash.py``:
target features -> ``fc`` -> ``hidden_norm`` give the context states; each draft
layer projects them to K (``k_norm``, RoPE at the context position) and V; the
block runs through standard Qwen3 decoder layers whose attention covers the
context plus every block position. The difference is where context K/V live:
upstream keeps them in the paged KV cache (Model Runner V2 only), here they are
ring entries of shape ``[num_layers, 2, kv_heads, head_dim]`` owned by the
proposer, so the draft needs no attention backend or KV-cache group of its own.

Linear layers are vLLM's tensor-parallel ones, so heads and MLP shard like the
target's and quantized checkpoints load through the usual quant methods.
"""

import collections
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.qwen2 import Qwen2MLP
from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention
from vllm.transformers_utils.config import set_default_rope_theta
from vllm.v1.spec_decode.dspark.backbone import DSparkBackbone

# Checkpoint tensors that vLLM stores fused: (fused name, checkpoint name, shard).
_STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
_FUSED_SHARDS: dict[str, set[str | int]] = collections.defaultdict(set)
for _fused, _, _shard in _STACKED_PARAMS:
    _FUSED_SHARDS[_fused].add(_shard)


def qwen3_target_layer_ids(config: PretrainedConfig) -> list[int]:
    """Tapped target layers, in feature-concatenation order."""
    dflash_config = getattr(config, "dflash_config", None) or {}
    layer_ids = dflash_config.get("target_layer_ids") or getattr(
        config, "dspark_target_layer_ids", None
    )
    if not layer_ids:
        raise ValueError(
            "The DSpark draft config names no target layers: set "
            "dflash_config.target_layer_ids in the draft's config.json."
        )
    return list(layer_ids)


class Qwen3DSparkAttention(nn.Module):
    """Qwen3 attention whose keys are the request's ring plus the block."""

    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        dflash_config = getattr(config, "dflash_config", None) or {}
        if dflash_config.get("attention_sink_bias"):
            raise ValueError(
                "Qwen3 DSpark drafts with attention_sink_bias are not supported by "
                "the V1 DSpark proposer."
            )
        self.v_scale: float | None = dflash_config.get("attention_value_scale")
        self.sliding_window, self.causal = _resolve_layer_attention(config, layer_idx)

        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            is_neox_style=getattr(config, "is_neox_style", True),
            rope_parameters=config.rope_parameters,
        )
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _scaled_values(self, v: torch.Tensor) -> torch.Tensor:
        return v if self.v_scale is None else v * self.v_scale

    def context_kv(self, context_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[rows, H]`` normed context states -> ``[rows, 2, kv_heads, head_dim]``."""
        qkv, _ = self.qkv_proj(context_states)
        _, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).reshape(k.shape)
        k, _ = self.rotary_emb(positions, k)
        return torch.stack(
            [
                k.reshape(-1, self.num_kv_heads, self.head_dim),
                self._scaled_values(v).reshape(-1, self.num_kv_heads, self.head_dim),
            ],
            dim=1,
        )

    def _attention_mask(
        self,
        block_positions: torch.Tensor,
        context_positions: torch.Tensor,
        context_mask: torch.Tensor,
    ) -> torch.Tensor:
        """``[B, n, W + n]`` boolean mask: True where a block query may attend."""
        num_queries = block_positions.shape[1]
        context_visible = context_mask.unsqueeze(1).expand(-1, num_queries, -1)
        if self.sliding_window is not None:
            context_visible = context_visible & (
                context_positions.unsqueeze(1) > block_positions.unsqueeze(2) - self.sliding_window
            )
        block_visible = torch.ones(
            num_queries, num_queries, dtype=torch.bool, device=block_positions.device
        )
        if self.causal:
            block_visible = block_visible.tril()
        block_visible = block_visible.expand(block_positions.shape[0], -1, -1)
        return torch.cat([context_visible, block_visible], dim=2)

    def forward(
        self,
        hidden: torch.Tensor,
        block_positions: torch.Tensor,
        context_kv: torch.Tensor,
        context_positions: torch.Tensor,
        context_mask: torch.Tensor,
    ) -> torch.Tensor:
        """``hidden`` ``[B, n, H]``; ``context_kv`` ``[B, W, 2, kv_heads, head_dim]``."""
        batch, num_queries, _ = hidden.shape
        qkv, _ = self.qkv_proj(hidden.reshape(batch * num_queries, -1))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).reshape(q.shape)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).reshape(k.shape)
        q, k = self.rotary_emb(block_positions.reshape(-1), q, k)
        v = self._scaled_values(v)

        def heads(x: torch.Tensor, num: int) -> torch.Tensor:
            return x.reshape(batch, num_queries, num, self.head_dim)

        keys = torch.cat([context_kv[:, :, 0], heads(k, self.num_kv_heads)], dim=1)
        values = torch.cat([context_kv[:, :, 1], heads(v, self.num_kv_heads)], dim=1)
        mask = self._attention_mask(block_positions, context_positions, context_mask)
        out = F.scaled_dot_product_attention(
            heads(q, self.num_heads).transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask.unsqueeze(1),
            scale=self.scaling,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        out = out.transpose(1, 2).reshape(batch * num_queries, self.q_size)
        out, _ = self.o_proj(out)
        return out.reshape(batch, num_queries, -1)


class Qwen3DSparkDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.self_attn = Qwen3DSparkAttention(
            config, layer_idx, quant_config, prefix=f"{prefix}.self_attn"
        )
        self.mlp = Qwen2MLP(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            quant_config=quant_config,
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        block_positions: torch.Tensor,
        context_kv: torch.Tensor,
        context_positions: torch.Tensor,
        context_mask: torch.Tensor,
    ) -> torch.Tensor:
        attn_out = self.self_attn(
            self.input_layernorm(hidden),
            block_positions,
            context_kv,
            context_positions,
            context_mask,
        )
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3DSparkBackbone(DSparkBackbone):
    """Qwen3 DSpark draft layers plus the target-feature projection."""

    def __init__(
        self,
        config: PretrainedConfig,
        window: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        set_default_rope_theta(config, default_theta=1000000)
        self.window = window
        self.hidden_size = config.hidden_size
        self.layers = nn.ModuleList(
            Qwen3DSparkDecoderLayer(config, i, quant_config, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        attn = self.layers[0].self_attn
        self.ring_entry_shape = (len(self.layers), 2, attn.num_kv_heads, attn.head_dim)
        target_hidden_size = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.fc = ReplicatedLinear(
            target_hidden_size * len(qwen3_target_layer_ids(config)),
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.fc",
            return_bias=False,
        )
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def context_entries(
        self, target_features: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        context_states = self.hidden_norm(self.fc(target_features))
        return torch.stack(
            [layer.self_attn.context_kv(context_states, positions) for layer in self.layers],
            dim=1,
        )

    def block_hidden(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context: torch.Tensor,
        context_positions: torch.Tensor,
        context_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = block_embeds
        for i, layer in enumerate(self.layers):
            hidden = layer(
                hidden, block_positions, context[:, :, i], context_positions, context_mask
            )
        normed = self.norm(hidden)
        # Upstream's confidence head reads the same normed hidden as the lm_head.
        return normed, normed

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors named as in the file (``layers.0.self_attn.q_proj.weight``)
        and return the parameters that were completely filled (a fused parameter
        counts only once all its shards arrived). Unknown names are an error: a
        silently skipped tensor leaves a random draft that only shows up as low
        acceptance."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        fused_shards: dict[str, set[str | int]] = collections.defaultdict(set)
        for name, tensor in weights:
            param_name, shard = _vllm_param_name(name)
            param = params.get(param_name)
            if param is None:
                raise ValueError(
                    f"Unexpected tensor '{name}' in the Qwen3 DSpark checkpoint: it "
                    "matches no draft parameter. Is this a Qwen3DSparkModel checkpoint "
                    "for this target?"
                )
            if shard is None:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(param_name)
            else:
                param.weight_loader(param, tensor, shard)
                fused_shards[param_name].add(shard)
        for param_name, shards in fused_shards.items():
            if shards == _FUSED_SHARDS[param_name.split(".")[-2]]:
                loaded.add(param_name)
        return loaded


def _vllm_param_name(checkpoint_name: str) -> tuple[str, str | int | None]:
    """The parameter a checkpoint tensor loads into, and its shard if fused."""
    for fused, original, shard in _STACKED_PARAMS:
        if f".{original}." in checkpoint_name:
            return checkpoint_name.replace(f".{original}.", f".{fused}."), shard
    return checkpoint_name, None
