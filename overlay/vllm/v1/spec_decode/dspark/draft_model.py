"""A DSpark draft: one backbone plus the token-level heads around it.

The Markov and confidence heads are vLLM's own (``qwen3_dspark.py``), shared by
every DSpark checkpoint family; the input embedding and the lm_head are the
target's unless the checkpoint ships its own.
"""

from collections.abc import Iterable

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
        confidence_head_optional: bool = False,
    ) -> None:
        """``confidence_bias``: Qwen3 DSpark confidence heads carry a bias,
        DeepSeek-V4's not. ``confidence_head_optional``: a checkpoint may enable
        the head without shipping its weights (upstream accepts such Qwen3
        drafts and runs them without the head); otherwise its weights are
        required like any other."""
        super().__init__()
        self.confidence_head_optional = confidence_head_optional
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

    # Loading --------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load every draft parameter or fail naming what is missing."""
        head_params = {
            name: param
            for name, param in self.named_parameters()
            if not name.startswith("backbone.")
        }
        loaded: set[str] = set()

        def backbone_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name in head_params:
                    param = head_params[name]
                    getattr(param, "weight_loader", _copy_weight)(param, tensor)
                    loaded.add(name)
                elif name.startswith(("embed_tokens.", "lm_head.")):
                    raise ValueError(
                        f"The DSpark checkpoint ships its own '{name}'; only drafts that "
                        "share the target's embedding and lm_head are supported."
                    )
                else:
                    yield name, tensor

        loaded |= {f"backbone.{n}" for n in self.backbone.load_weights(backbone_weights())}
        if (
            self.confidence_head_optional
            and self.confidence_head is not None
            and not any(name.startswith("confidence_head.") for name in loaded)
        ):
            self.confidence_head = None
        missing = sorted(set(dict(self.named_parameters())) - loaded)
        if missing:
            raise ValueError(
                "The DSpark checkpoint is missing draft weights: "
                + ", ".join(missing)
                + ". Check that it matches the draft's config.json."
            )


def _copy_weight(param: torch.Tensor, tensor: torch.Tensor) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"Shape mismatch: parameter {tuple(param.shape)}, tensor {tuple(tensor.shape)}"
        )
    param.data.copy_(tensor)
