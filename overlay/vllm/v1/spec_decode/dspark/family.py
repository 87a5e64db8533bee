# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which DSpark draft a config names, and what the scheduler needs to know of it.

The scheduler's patch imports this module when speculative decoding is DSpark, so it
imports neither torch nor any draft code: a V4 draft's config module is read only when
a V4 draft is configured.
"""

from typing import Any

_PAGED_ARCHITECTURES = {
    "Qwen3DSparkModel": "qwen3",
    "Qwen3DSparkForCausalLM": "qwen3",
    "Gemma4DSparkModel": "gemma4",
    "Gemma4DSparkForCausalLM": "gemma4",
}


def is_deepseek_v4_dspark(hf_config: Any) -> bool:
    """A DeepSeek-V4 target checkpoint whose ``mtp.*`` stages are a DSpark draft."""
    return getattr(hf_config, "model_type", None) in ("deepseek_v4", "deepseek_v4_dspark") and bool(
        getattr(hf_config, "dspark_block_size", None)
    )


def draft_family(draft_model_config: Any) -> str:
    """``"deepseek_v4"``, ``"qwen3"`` or ``"gemma4"``; anything else is not a
    DSpark draft this proposer can run."""
    config = draft_model_config.hf_config
    if is_deepseek_v4_dspark(config):
        return "deepseek_v4"
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in _PAGED_ARCHITECTURES:
            return _PAGED_ARCHITECTURES[arch]
    raise ValueError(
        f"'{draft_model_config.model}' is not a DSpark draft the V1 proposer supports: "
        f"it declares {architectures}. Use a DeepSeek-V4 DSpark checkpoint or a Qwen3 or "
        f"Gemma-4 DSpark draft ({', '.join(_PAGED_ARCHITECTURES)})."
    )


def prefix_hit_recompute_tokens(vllm_config: Any) -> int:
    """How many tokens a prefix-cache hit must leave the target to recompute.

    A DeepSeek-V4 draft's ring holds the target features of the last
    ``sliding_window`` positions, and a request that starts from a hit fills it
    from the recomputed tokens alone. V1's own margin (the last token, one hash
    block more for EAGLE-family methods) can be shorter: with a tiny V4 target
    on CPU, 448 of 540 prompt tokens hit, 92 recomputed for a window of 128.
    Everything else keeps vLLM's 1."""
    speculative_config = vllm_config.speculative_config
    if speculative_config is None or not speculative_config.use_dspark():
        return 1
    draft_model_config = speculative_config.draft_model_config
    if draft_family(draft_model_config) != "deepseek_v4":
        return 1
    from vllm.v1.spec_decode.dspark.deepseek_v4.config import DeepSeekV4DSparkConfig

    return DeepSeekV4DSparkConfig.from_hf_config(draft_model_config.hf_config).sliding_window
