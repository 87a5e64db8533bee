# SPDX-License-Identifier: Apache-2.0
"""Interface between the DSpark proposer and a model-specific draft backbone.

TEMPORARY COPY of the lead's protocol (main has not landed it yet); main's file replaces it.
"""

import abc

import torch
from torch import Tensor


class DSparkBackbone(torch.nn.Module, abc.ABC):
    """Turns target features into ring entries and runs one draft block over them."""

    window: int
    ring_entry_shape: tuple[int, ...]
    hidden_size: int

    @abc.abstractmethod
    def context_entries(self, target_features: Tensor, positions: Tensor) -> Tensor:
        """[rows, F] target features + [rows] positions -> [rows, *ring_entry_shape]."""

    @abc.abstractmethod
    def block_hidden(
        self,
        block_embeds: Tensor,
        block_positions: Tensor,
        context: Tensor,
        context_positions: Tensor,
        context_mask: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Returns (logit_hidden [B, n, H], confidence_hidden [B, n, H])."""
