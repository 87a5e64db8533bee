# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which DSpark draft a config names, and what the scheduler needs to know of it.

The scheduler's patch imports this module when speculative decoding is DSpark; it imports
no draft code itself.
"""

from typing import Any, Literal

DraftFamily = Literal["deepseek_v4", "qwen3", "gemma4"]

_PAGED_ARCHITECTURES: dict[str, DraftFamily] = {
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


def draft_family(draft_model_config: Any) -> DraftFamily:
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
