# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A ring-attention DSpark draft: one backbone (with its heads) plus the target's embedding and
lm_head.

Laid out and hooked as upstream's DeepSeek-V4 DSpark draft (``DSparkDeepseekV4ForCausalLM``:
``model`` holds the layers and heads, ``logits_processor`` applies the Markov bias), whose hook
methods it reuses: they read only those attributes. Upstream's class itself cannot be the base:
its constructor builds paged-attention layers of the NVIDIA platform, where this draft reads the
proposer's ring.
"""

import torch
from torch import nn

from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models.qwen3_dspark import DSparkConfidenceHead, DSparkMarkovHead
from vllm.models.deepseek_v4.nvidia.dspark import DSparkDeepseekV4ForCausalLM
from vllm.v1.spec_decode.dspark.backbone import DSparkBackbone


class DSparkRingDraft(nn.Module):
    """Backbone with Markov and optional confidence head; implements ``DraftHeads``."""

    markov_embed = DSparkDeepseekV4ForCausalLM.markov_embed
    markov_bias = DSparkDeepseekV4ForCausalLM.markov_bias
    compute_confidence = DSparkDeepseekV4ForCausalLM.compute_confidence

    def __init__(self, model: DSparkBackbone, vocab_size: int) -> None:
        super().__init__()
        self.model = model
        self.logits_processor = LogitsProcessor(vocab_size)
        self._target: nn.Module | None = None

    @property
    def backbone(self) -> DSparkBackbone:
        return self.model

    @property
    def markov_head(self) -> DSparkMarkovHead:
        return self.model.markov_head

    @property
    def confidence_head(self) -> DSparkConfidenceHead | None:
        return self.model.confidence_head

    def share_target(self, target_model: nn.Module) -> None:
        """Use the target's input embedding and lm_head (DSpark checkpoints
        ship neither)."""
        self._target = target_model

    # DraftHeads (upstream's hook names) -----------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self._target is not None, "share_target() must run before drafting"
        return self._target.embed_input_ids(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self._target is not None, "share_target() must run before drafting"
        return self._target.compute_logits(hidden)
