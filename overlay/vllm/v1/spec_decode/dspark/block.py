# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The query block of a full-attention DSpark draft, from its config alone.

Kept free of torch and model imports: vLLM's config reads it to reserve the KV
slots the block's queries write (``VllmConfig.num_lookahead_tokens``).
"""

from typing import Any


def trained_block_size(config: Any) -> int | None:
    """The block the draft was trained on (DeepSpec's ``block_size``)."""
    return getattr(config, "block_size", None) or getattr(config, "dspark_block_size", None)


def samples_from_anchor(config: Any) -> bool:
    """DeepSpec's layout (the default): the anchor's own slot predicts the
    first draft. ``False``: DFlash's fill-in layout, a bonus slot first."""
    return getattr(config, "sample_from_anchor", True)


def num_block_drafts(config: Any, k: int) -> int:
    """Drafts per block: the whole trained block, never fewer than k. A block
    attends bidirectionally, so drafting only k of a longer trained block
    would change the first k drafts."""
    return max(k, trained_block_size(config) or k)


def num_block_queries(config: Any, k: int) -> int:
    """Query slots per request: the block's drafts, plus the bonus slot of
    the fill-in layout."""
    return num_block_drafts(config, k) + (0 if samples_from_anchor(config) else 1)
