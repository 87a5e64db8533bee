# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The DSpark draft as vLLM's front end validated it: decided once, read everywhere after.

``check_dspark_config`` (``dspark_proposer.py``, called while ``VllmConfig`` validates, in
vLLM's front end) builds a ``DSparkDraftSpec`` from the draft's config, the target's and the
speculative config's fields, refusing what cannot run, and keeps it on the speculative config
(``SpeculativeConfig.dspark_draft``, a field this project's patch adds), which travels with the
config to every engine process. vLLM's lookahead, the scheduler hook, the proposer factory and
the proposers read it from there (``draft_spec``).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.spec_decode.dspark.family import DraftFamily
from vllm.v1.spec_decode.dspark.options import DSparkOptions

if TYPE_CHECKING:
    from vllm.v1.spec_decode.dspark.deepseek_v4.config import DeepSeekV4DSparkConfig


@dataclass(frozen=True)
class DSparkDraftSpec:
    """What the V1 DSpark proposer drafts with."""

    family: DraftFamily
    """The proposer: ``deepseek_v4`` runs the ring proposer, the others the paged one."""
    num_drafts: int
    """k, the drafts verified per step (``num_speculative_tokens``)."""
    trained_block_size: int | None
    """The block the draft was trained on (DeepSpec's ``block_size``), None when unstated."""
    samples_from_anchor: bool
    """DeepSpec's layout: the anchor's own slot predicts the first draft. False: DFlash's
    fill-in layout, a bonus slot first."""
    target_layer_ids: tuple[int, ...]
    """The target layers whose hidden states the draft reads (its taps)."""
    mask_token_id: int | None
    """The token the block's draft slots hold (DeepSeek-V4: its noise token)."""
    options: DSparkOptions
    """The proposer's settings from the speculative config."""
    deepseek_v4: "DeepSeekV4DSparkConfig | None" = None
    """The DeepSeek-V4 draft's validated geometry; None for the paged families."""

    @property
    def num_block_drafts(self) -> int:
        """Drafts per block: the whole trained block, never fewer than k. A block attends
        bidirectionally, so drafting only k of a longer trained block would change the first
        k drafts."""
        return max(self.num_drafts, self.trained_block_size or self.num_drafts)

    @property
    def num_queries(self) -> int:
        """Query slots per request: the block's drafts, plus the bonus slot of the fill-in
        layout (the KV slots vLLM reserves ahead, ``VllmConfig.num_lookahead_tokens``)."""
        return self.num_block_drafts + (0 if self.samples_from_anchor else 1)

    @property
    def prefix_hit_recompute_tokens(self) -> int:
        """How many tokens a prefix-cache hit must leave the target to recompute.

        A DeepSeek-V4 draft's ring holds the target features of the last ``sliding_window``
        positions, and a request that starts from a hit fills it from the recomputed tokens
        alone. V1's own margin (the last token, one hash block more for EAGLE-family methods)
        can be shorter: with a tiny V4 target on CPU, 448 of 540 prompt tokens hit, 92
        recomputed for a window of 128. Everything else keeps vLLM's 1."""
        return self.deepseek_v4.sliding_window if self.deepseek_v4 is not None else 1


def draft_spec(vllm_config) -> DSparkDraftSpec:
    """The spec ``check_dspark_config`` kept on ``vllm_config``'s speculative config."""
    spec = vllm_config.speculative_config.dspark_draft
    assert spec is not None, "VllmConfig's validation builds the DSpark draft spec"
    return spec


def prefix_hit_recompute_tokens(vllm_config) -> int:
    """How many tokens a prefix-cache hit must leave the target to recompute (the scheduler's
    patch asks): the draft spec's answer for DSpark, vLLM's 1 otherwise."""
    speculative_config = vllm_config.speculative_config
    if speculative_config is None or not speculative_config.use_dspark():
        return 1
    return draft_spec(vllm_config).prefix_hit_recompute_tokens
