# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The DeepSeek-V4-Flash DSpark draft (``mtp.0..N-1`` of the target checkpoint) as a backbone."""

import torch
from torch import Tensor, nn

from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.mhc import HCHeadOp
from vllm.model_executor.models.qwen3_dspark import DSparkConfidenceHead, DSparkMarkovHead
from vllm.models.deepseek_v4.nvidia.dspark import DSparkDeepseekV4Model

from ..backbone import DSparkBackbone
from ..spec import draft_spec
from .config import DeepSeekV4DSparkConfig
from .layers import DSparkStage, fp32_parameter


class DeepSeekV4DSparkBackbone(DSparkBackbone):
    """``len(dspark_target_layer_ids)`` chained stages over ``hc_mult`` hyper-connection streams.

    Laid out as upstream's ``DSparkDeepseekV4Model`` (``layers``, ``main_proj``, ``main_norm``,
    ``norm``, ``hc_head_*``, ``markov_head``, ``confidence_head``), so upstream's checkpoint remap
    names this module's parameters; only the stages' attention differs (it reads the ring).

    A ring entry holds, per stage, that stage's RoPE'd KV of one target position:
    ``ring_entry_shape = (num_stages, head_dim)``. Embedding and lm_head belong to the target.
    Construct inside ``set_current_vllm_config`` on the target device.
    """

    # Upstream's main_x = main_norm(main_proj(tapped target features)).
    combine_hidden_states = DSparkDeepseekV4Model.combine_hidden_states

    def __init__(self, vllm_config: VllmConfig, prefix: str = "dspark") -> None:
        super().__init__()
        hf_config = vllm_config.speculative_config.draft_model_config.hf_config
        config = draft_spec(vllm_config).deepseek_v4
        assert config is not None
        self.config: DeepSeekV4DSparkConfig = config
        hidden, eps, n = config.hidden_size, config.rms_norm_eps, config.hc_mult
        self.window = config.sliding_window
        self.ring_entry_shape = (config.num_stages, config.head_dim)
        self.hidden_size = hidden
        self.feature_size = config.feature_size
        # Virtual layer ids past the target's, as upstream numbers its draft layers: they lie
        # beyond num_hash_layers, so the MoE routes with noaux_tc.
        first_id = max(config.num_hidden_layers, config.dspark_target_layer_ids[-1] + 1)
        self.layers = nn.ModuleList(
            DSparkStage(vllm_config, hf_config, prefix=f"{prefix}.layers.{first_id + index}")
            for index in range(config.num_stages)
        )
        self.main_proj = ReplicatedLinear(
            config.feature_size,
            hidden,
            bias=False,
            quant_config=vllm_config.quant_config,
            return_bias=False,
            prefix=f"{prefix}.main_proj",
        )
        self.main_norm = RMSNorm(hidden, eps)
        self.norm = RMSNorm(hidden, eps)
        self.hc_head_fn = fp32_parameter(n, n * hidden)
        self.hc_head_base = fp32_parameter(n)
        self.hc_head_scale = fp32_parameter(1)
        self.hc_head_op = HCHeadOp()
        self.markov_head = DSparkMarkovHead(
            config.vocab_size,
            config.vocab_size,
            config.dspark_markov_rank,
            prefix=f"{prefix}.markov_head",
        )
        # As upstream's: reads [dense ; W1[prev]] (H + r inputs), no bias. The loader drops it
        # when config.json enables it without shipping its weights.
        self.confidence_head: DSparkConfidenceHead | None = None
        if config.enable_confidence_head:
            self.confidence_head = DSparkConfidenceHead(
                hidden + config.dspark_markov_rank, prefix=f"{prefix}.confidence_head"
            )

    def context_entries(self, target_features: Tensor, positions: Tensor) -> Tensor:
        """[rows, nT*H] -> [rows, num_stages, head_dim]: per stage RoPE(kv_norm(W_kv^s main_x))."""
        main_x = self.combine_hidden_states(target_features)
        return torch.stack([stage.attn.kv(main_x, positions) for stage in self.layers], dim=1)

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
        for index, stage in enumerate(self.layers):
            streams = stage(streams, block_positions, context[:, :, index], context_mask)
        # The sigmoid-gated sum of the hyper-connection streams: [T, hc, H] -> [T, H].
        dense = self.hc_head_op(
            streams,
            self.hc_head_fn,
            self.hc_head_scale,
            self.hc_head_base,
            self.config.rms_norm_eps,
            self.config.hc_eps,
        ).view(batch, block, hidden)
        return self.norm(dense), dense
