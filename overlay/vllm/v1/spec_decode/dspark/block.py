# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The query block of a full-attention DSpark draft, from its config alone.

Kept free of torch and model imports: vLLM's config reads it to reserve the KV
slots the block's queries write (``VllmConfig.num_lookahead_tokens``).
"""

from typing import Any


def check_block_size(config: Any) -> None:
    """DeepSpec's ``block_size`` (or ``dspark_block_size``), when present, is a positive int:
    0 would read as "unset" and "4" fail as a TypeError deep in the proposer."""
    for key in ("block_size", "dspark_block_size"):
        value = getattr(config, key, None)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(
                f"The DSpark draft config's {key}={value!r} is not a positive integer. Set it "
                "to the block size the draft was trained with (an integer, e.g. 7)."
            )


def trained_block_size(config: Any) -> int | None:
    """The block the draft was trained on (DeepSpec's ``block_size``), checked first: vLLM's
    config set-up asks for it before the proposer's own start-up checks run."""
    check_block_size(config)
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
