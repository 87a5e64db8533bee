# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The contract between the DSpark drafter and a checkpoint family's draft network.

A ring-context DSpark draft reads, per request, a window of projected target
positions (the ring) and runs one non-causal forward over a block of query
tokens. The drafter's bookkeeping (``drafter.py``) is written against this
contract, not against the one network that implements it today, DeepSeek-V4's
(``deepseek_v4/backbone.py``, whose ring entry is one RoPE'd KV per stage).
Qwen3 and Gemma-4 drafts keep their context in vLLM's paged KV cache instead
(``paged_proposer.py``) and use no backbone.
"""

from abc import ABC, abstractmethod

import torch
from torch import nn

from vllm.model_executor.models.qwen3_dspark import DSparkConfidenceHead, DSparkMarkovHead


class DSparkBackbone(nn.Module, ABC):
    """Draft network of one checkpoint family.

    Subclasses set ``window`` (W, context positions the draft attends to),
    ``ring_entry_shape`` (shape of one position's ring entry),
    ``feature_size`` (width of a row of tapped target features),
    ``hidden_size`` and vLLM's token-level heads (``markov_head``, optional
    ``confidence_head``, where upstream's DSpark models keep them) before the
    drafter is built.
    """

    window: int
    ring_entry_shape: tuple[int, ...]
    feature_size: int
    hidden_size: int
    markov_head: DSparkMarkovHead
    confidence_head: DSparkConfidenceHead | None

    @abstractmethod
    def context_entries(
        self, target_features: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Project target rows into ring entries.

        ``target_features`` is ``[rows, F]`` (the tapped target layers,
        concatenated in config order) and ``positions`` ``[rows]`` their
        absolute positions; returns ``[rows, *ring_entry_shape]``.
        """

    @abstractmethod
    def block_hidden(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context: torch.Tensor,
        context_positions: torch.Tensor,
        context_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the block forward over each request's ring plus its block.

        ``block_embeds`` ``[B, n, H]``, ``block_positions`` ``[B, n]``,
        ``context`` ``[B, W, *ring_entry_shape]`` with ``context_positions``
        ``[B, W]`` (-1 = empty) and ``context_mask`` ``[B, W]`` (True =
        attend). Returns ``(logit_hidden, confidence_hidden)``, each
        ``[B, n, H]``: the first feeds the shared lm_head, the second the
        confidence head.
        """
