"""A DSpark draft: one backbone plus the token-level heads around it.

The Markov and confidence heads are vLLM's own (``qwen3_dspark.py``), shared by
every DSpark checkpoint family; the input embedding and the lm_head are the
target's unless the checkpoint ships its own.
"""

import torch
from torch import nn
from transformers import PretrainedConfig

from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models.qwen3_dspark import (
    DSparkConfidenceHead,
    DSparkMarkovHead,
)
from vllm.v1.spec_decode.dspark.backbone import DSparkBackbone


class DSparkDraftModel(nn.Module):
    """Backbone, Markov head, optional confidence head; implements ``DraftHeads``."""

    def __init__(
        self,
        config: PretrainedConfig,
        backbone: DSparkBackbone,
        markov_rank: int,
        vocab_size: int,
        prefix: str = "",
        confidence_bias: bool = True,
    ) -> None:
        """``confidence_bias``: Qwen3 DSpark confidence heads carry a bias,
        DeepSeek-V4's not. The loader drops the confidence head when the
        checkpoint enables it without shipping its weights."""
        super().__init__()
        self.backbone = backbone
        self.markov_head = DSparkMarkovHead(
            vocab_size, vocab_size, markov_rank, prefix=f"{prefix}.markov_head"
        )
        self.markov_logits = LogitsProcessor(vocab_size)
        self.confidence_head: DSparkConfidenceHead | None = None
        if getattr(config, "enable_confidence_head", False):
            with_markov = getattr(config, "confidence_head_with_markov", False)
            self.confidence_head = DSparkConfidenceHead(
                backbone.hidden_size + (markov_rank if with_markov else 0),
                prefix=f"{prefix}.confidence_head",
                bias=confidence_bias,
                with_markov=with_markov,
            )
        self._target: nn.Module | None = None

    def share_target(self, target_model: nn.Module) -> None:
        """Use the target's input embedding and lm_head (DSpark checkpoints
        ship neither)."""
        self._target = target_model

    # DraftHeads -----------------------------------------------------------
    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        assert self._target is not None, "share_target() must run before drafting"
        return self._target.embed_input_ids(token_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self._target is not None, "share_target() must run before drafting"
        return self._target.compute_logits(hidden)

    def markov_embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_head.embed(token_ids)

    def markov_bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        return self.markov_head.bias(markov_embed, self.markov_logits)

    def confidence(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        if self.confidence_head is None:
            raise ValueError(
                "Confidence scheduling needs a draft with a confidence head "
                "(enable_confidence_head and confidence_head.* weights)."
            )
        return torch.sigmoid(self.confidence_head(hidden, markov_embed))
