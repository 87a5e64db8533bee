"""The V1 DSpark proposer's settings, read from vLLM's ``SpeculativeConfig``.

Upstream's fields are honoured where they mean something for DSpark
(``draft_sample_method``, ``dspark_draft_topk``, ...) and refused at start-up,
naming the field, where a proposer cannot honour them. The proposer's own
settings are typed ``dspark_*`` fields that this project's patch adds to
``SpeculativeConfig`` (pydantic checks their types and ranges); the rules that
span several fields are checked here.
"""

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm.v1.spec_decode.dspark.scheduling import ConfidenceScheduleConfig

RING_PROPOSER_UNSUPPORTED: Mapping[str, str] = {
    "attention_backend": "the draft attends over its own context ring, not through a vLLM "
    "attention backend",
    "kv_cache_dtype": "the draft keeps its context in a ring of the draft's dtype, not in "
    "vLLM's paged KV cache",
    "use_local_argmax_reduction": "the Markov chain corrects the full-vocabulary logits of "
    "every position, so there is no vocab-parallel argmax to reduce",
    "moe_backend": "DSpark drafts do not run vLLM's fused MoE layers",
    "max_model_len": "the draft's context ring covers the target's max_model_len",
}
"""Upstream fields the ring proposer refuses when set, with the reason."""

PAGED_PROPOSER_UNSUPPORTED: Mapping[str, str] = {
    "use_local_argmax_reduction": RING_PROPOSER_UNSUPPORTED["use_local_argmax_reduction"],
}
"""Upstream fields the paged (full-attention) proposer refuses; the rest reach its draft
through vLLM's own draft config (attention backend, KV-cache dtype, MoE backend, eager)."""

DEEPSEEK_V4_UNSUPPORTED: Mapping[str, str] = {
    "quantization": "the DeepSeek-V4 draft layers are built with the target's quantization, "
    "in which the checkpoint ships their mtp.* tensors",
}
"""Further fields refused for DeepSeek-V4 drafts (Qwen3 drafts honour ``quantization``)."""

TARGET_INHERITED_FIELDS = ("quantization",)
"""Fields vLLM copies from the target when unset (``SpeculativeConfig.__post_init__``): set to
the target's own value they are no choice of the user's, and are not refused."""


OTHER_METHODS_FIELDS = (
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
)
"""Settings of the suffix proposer: refused when they differ from their default. (vLLM resets
``prompt_lookup_*`` to 0 for every other method before any proposer sees them.)"""


def refuse_other_methods_fields(speculative_config) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(speculative_config)}
    for name in OTHER_METHODS_FIELDS:
        value = getattr(speculative_config, name)
        if value != defaults[name]:
            raise ValueError(
                f"speculative_config.{name}={value!r} belongs to another speculative method "
                f"and has no effect with method='dspark'. Remove {name}."
            )


def refuse_unsupported_fields(speculative_config, unsupported: Mapping[str, str]) -> None:
    """Raise naming the first field of ``unsupported`` that is set (not None, False or "auto")."""
    target = getattr(speculative_config, "target_model_config", None)
    for name, why in unsupported.items():
        value = getattr(speculative_config, name, None)
        inherited = getattr(target, name, None) if name in TARGET_INHERITED_FIELDS else None
        if value not in (None, False, "auto", inherited):
            raise ValueError(
                f"speculative_config.{name}={value!r} is not supported by DSpark on vLLM's "
                f"V1 model runner: {why}. Remove {name}."
            )


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
    def from_config(
        cls,
        speculative_config,
        *,
        async_scheduling: bool,
        target_tensor_parallel_size: int,
        unsupported: Mapping[str, str] = RING_PROPOSER_UNSUPPORTED,
    ) -> "DSparkOptions":
        """Read and cross-check the fields; raise naming the field on conflict."""
        refuse_unsupported_fields(speculative_config, unsupported)
        refuse_other_methods_fields(speculative_config)
        if (
            speculative_config.draft_sample_method == "probabilistic"
            and speculative_config.rejection_sample_method != "standard"
        ):
            raise ValueError(
                "speculative_config.draft_sample_method='probabilistic' needs "
                "rejection_sample_method='standard' (the only one that reads draft "
                f"probabilities), got {speculative_config.rejection_sample_method!r}. "
                "Use draft_sample_method='greedy' or rejection_sample_method='standard'."
            )
        draft_tp = speculative_config.draft_tensor_parallel_size
        if draft_tp is not None and draft_tp != target_tensor_parallel_size:
            raise ValueError(
                f"speculative_config.draft_tensor_parallel_size={draft_tp} is not supported by "
                f"DSpark on V1: the draft shards over the target's tensor-parallel group "
                f"({target_tensor_parallel_size}). Remove draft_tensor_parallel_size."
            )
        scheduling = ConfidenceScheduleConfig.from_fields(
            scheduler=speculative_config.dspark_confidence_scheduler,
            threshold=speculative_config.dspark_confidence_threshold,
            step_rate_curve=speculative_config.dspark_step_rate_curve,
            early_stop=speculative_config.dspark_hardware_early_stop,
        )
        if scheduling.needs_confidence and async_scheduling:
            raise ValueError(
                f"dspark_confidence_scheduler={scheduling.scheduler!r} does not work with async "
                "scheduling: the next step is scheduled before this step's confidences exist, "
                "so its lengths would cut drafts they never scored. Serve with "
                "--no-async-scheduling, or set dspark_confidence_scheduler='off'."
            )
        draft_log = speculative_config.dspark_draft_log
        if draft_log is not None and not draft_log:
            raise ValueError("dspark_draft_log must be a file path; remove it or name a file.")
        # Read from the draft's config, where upstream puts the field's value
        # (or the checkpoint's own dspark_draft_topk) after validating it.
        draft_topk = getattr(
            speculative_config.draft_model_config.hf_config, "dspark_draft_topk", None
        )
        return cls(
            probabilistic=speculative_config.draft_sample_method == "probabilistic",
            draft_topk=draft_topk,
            draft_log=draft_log,
            scheduling=scheduling,
        )
