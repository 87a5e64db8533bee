# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The V1 DSpark proposer's settings, read from vLLM's ``SpeculativeConfig``.

Upstream's fields are honoured where they mean something for DSpark
(``draft_sample_method``, ``dspark_draft_topk``, ...) and refused by vLLM's front
end, naming the field, where a proposer cannot honour them (``checks.py``). The
proposer's own settings are typed ``dspark_*`` fields that this project's patch
adds to ``SpeculativeConfig`` (pydantic checks their types and ranges).
"""

from dataclasses import dataclass, field

from vllm.v1.spec_decode.dspark.scheduling import ConfidenceScheduleConfig


@dataclass(frozen=True)
class DSparkOptions:
    probabilistic: bool = False
    """``draft_sample_method="probabilistic"``: drafts drawn from the
    Markov-corrected distribution, their probabilities passed to rejection
    sampling as V1's other proposers do."""
    draft_topk: int | None = None
    """``dspark_draft_topk``: correct only the top-k base-logit candidates."""
    draft_log: str | None = None
    """``dspark_draft_log``, debug only: append every step's drafts per request
    to this JSONL file. Costs a device-to-host copy per step."""
    scheduling: ConfidenceScheduleConfig = field(default_factory=ConfidenceScheduleConfig)
    """``dspark_confidence_*``: confidence-scheduled verification (off by default)."""

    @classmethod
    def from_config(cls, speculative_config) -> "DSparkOptions":
        """Read the fields (``check_speculative_fields`` passed); the confidence pair raises
        naming the field when it cannot be honoured."""
        scheduling = ConfidenceScheduleConfig(
            scheduler=speculative_config.dspark_confidence_scheduler,
            threshold=speculative_config.dspark_confidence_threshold,
        )
        # Read from the draft's config, where upstream puts the field's value
        # (or the checkpoint's own dspark_draft_topk) after validating it.
        draft_topk = getattr(
            speculative_config.draft_model_config.hf_config, "dspark_draft_topk", None
        )
        return cls(
            probabilistic=speculative_config.draft_sample_method == "probabilistic",
            draft_topk=draft_topk,
            draft_log=speculative_config.dspark_draft_log,
            scheduling=scheduling,
        )
