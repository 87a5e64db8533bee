"""The DeepSeek-V4-Flash DSpark draft (``mtp.0..N-1`` of the target checkpoint) as a backbone."""

import types
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from vllm.models.deepseek_v4.common.rope import build_deepseek_v4_rope

from ..backbone import DSparkBackbone
from .config import DeepSeekV4DSparkConfig, TensorParallelShard
from .layers import AllReduce, DSparkStage
from .loader import load_backbone_weights


class DeepSeekV4DSparkBackbone(DSparkBackbone):
    """``len(dspark_target_layer_ids)`` chained stages over ``hc_mult`` hyper-connection streams.

    A ring entry holds, per stage, that stage's RoPE'd KV of one target position:
    ``ring_entry_shape = (num_stages, head_dim)``. Embedding and lm_head belong to the target.
    """

    def __init__(
        self,
        config: DeepSeekV4DSparkConfig,
        *,
        dtype: torch.dtype = torch.bfloat16,
        shard: TensorParallelShard | None = None,
        all_reduce: AllReduce | None = None,
    ) -> None:
        """Construct inside ``set_current_vllm_config`` (vLLM's norms and activations need it).
        ``all_reduce`` sums the ranks' partial outputs; None leaves them partial (one rank)."""
        super().__init__()
        self.config = config
        self.shard = shard or TensorParallelShard()
        self.window = config.sliding_window
        self.ring_entry_shape = (config.num_stages, config.head_dim)
        self.hidden_size = config.hidden_size
        # Draft stages use the sliding-window rotary of the target (rope_theta, no YaRN): the
        # same builder vLLM's DeepSeek-V4 attention uses for layers with compress_ratio 1.
        rotary = build_deepseek_v4_rope(
            types.SimpleNamespace(
                rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
                rope_theta=config.rope_theta,
            ),
            head_dim=config.head_dim,
            rope_head_dim=config.qk_rope_head_dim,
            max_position_embeddings=config.max_position_embeddings,
            compress_ratio=1,
        )
        self.stages = nn.ModuleList(
            DSparkStage(config, index, rotary, self.shard, all_reduce, dtype)
            for index in range(config.num_stages)
        )
        self.requires_grad_(False)

    def context_entries(self, target_features: Tensor, positions: Tensor) -> Tensor:
        """[rows, nT*H] -> [rows, num_stages, head_dim]: per stage RoPE(kv_norm(W_kv^s main_x))."""
        first = self.stages[0]
        main_x = first.main_norm(first.main_proj(target_features))
        return torch.stack([stage.attn.kv(main_x, positions) for stage in self.stages], dim=1)

    def block_hidden(
        self,
        block_embeds: Tensor,
        block_positions: Tensor,
        context: Tensor,
        context_positions: Tensor,
        context_mask: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Runs the block through every stage; returns (norm(dense), dense).

        ``context_positions`` is not needed: entries already carry their RoPE.
        """
        streams = block_embeds.unsqueeze(-2).repeat(1, 1, self.config.hc_mult, 1)
        for index, stage in enumerate(self.stages):
            streams = stage(streams, block_positions, context[:, :, index], context_mask)
        last = self.stages[-1]
        dense = last.hc_head(streams)
        return last.norm(dense), dense

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Strict load of the ``mtp.*`` tensors (see ``loader.py``); returns the filled names."""
        return load_backbone_weights(self, weights)
