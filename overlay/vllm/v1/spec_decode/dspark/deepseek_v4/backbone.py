"""The DeepSeek-V4-Flash DSpark draft (``mtp.0..N-1`` of the target checkpoint) as a backbone."""

import torch
from torch import Tensor, nn

from vllm.config import VllmConfig

from ..backbone import DSparkBackbone
from .config import DeepSeekV4DSparkConfig
from .layers import DSparkStage


class DeepSeekV4DSparkBackbone(DSparkBackbone):
    """``len(dspark_target_layer_ids)`` chained stages over ``hc_mult`` hyper-connection streams.

    A ring entry holds, per stage, that stage's RoPE'd KV of one target position:
    ``ring_entry_shape = (num_stages, head_dim)``. Embedding and lm_head belong to the target.
    Construct inside ``set_current_vllm_config`` on the target device.
    """

    def __init__(self, vllm_config: VllmConfig, prefix: str = "dspark") -> None:
        super().__init__()
        hf_config = vllm_config.speculative_config.draft_model_config.hf_config
        self.config = DeepSeekV4DSparkConfig.from_hf_config(hf_config)
        self.window = self.config.sliding_window
        self.ring_entry_shape = (self.config.num_stages, self.config.head_dim)
        self.hidden_size = self.config.hidden_size
        self.feature_size = self.config.feature_size
        # Virtual layer ids past the target's, as upstream numbers its draft layers: they lie
        # beyond num_hash_layers, so the MoE routes with noaux_tc.
        first_id = max(self.config.num_hidden_layers, self.config.dspark_target_layer_ids[-1] + 1)
        self.stages = nn.ModuleList(
            DSparkStage(vllm_config, hf_config, index, prefix=f"{prefix}.layers.{first_id + index}")
            for index in range(self.config.num_stages)
        )

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
        """Runs the block through every stage; returns (norm(dense), dense), each [B, n, H].

        ``context_positions`` is not needed: entries already carry their RoPE.
        """
        batch, block, hidden = block_embeds.shape
        streams = block_embeds.flatten(0, 1).unsqueeze(1).repeat(1, self.config.hc_mult, 1)
        for index, stage in enumerate(self.stages):
            streams = stage(streams, block_positions, context[:, :, index], context_mask)
        last = self.stages[-1]
        dense = last.hc_head(streams).view(batch, block, hidden)
        return last.norm(dense), dense
