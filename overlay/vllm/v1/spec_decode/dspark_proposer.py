"""DSpark speculative decoding on vLLM's V1 model runner: the entry point.

The runner patch calls ``make_dspark_proposer``; it picks the proposer of the
draft's family. The scheduler patch calls ``prefix_hit_recompute_tokens``.
"""

import torch

from vllm.config import ModelConfig, VllmConfig
from vllm.logger import init_logger
from vllm.v1.spec_decode.dspark.deepseek_v4 import DeepSeekV4DSparkConfig, is_deepseek_v4_dspark
from vllm.v1.spec_decode.dspark.options import (
    check_block_size,
    check_draft_flags,
    check_paged_draft_config,
    check_safetensors_files,
)

logger = init_logger(__name__)

_PAGED_ARCHITECTURES = {
    "Qwen3DSparkModel": "qwen3",
    "Qwen3DSparkForCausalLM": "qwen3",
    "Gemma4DSparkModel": "gemma4",
    "Gemma4DSparkForCausalLM": "gemma4",
}


def draft_family(draft_model_config: ModelConfig) -> str:
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


def make_dspark_proposer(vllm_config: VllmConfig, device: torch.device, runner=None):
    """The V1 DSpark proposer for the configured draft. A refusal is logged once more as
    one short line: vLLM's start-up failure buries it in a long traceback."""
    try:
        return _make_proposer(vllm_config, device, runner)
    except ValueError as error:
        logger.error("DSpark refused the configuration: %s", error)
        raise


def check_draft(vllm_config: VllmConfig, family: str) -> None:
    """The draft config's values and files, before anything is built."""
    draft_model_config = vllm_config.speculative_config.draft_model_config
    config = draft_model_config.hf_config
    check_block_size(config)
    check_draft_flags(config)
    if family != "deepseek_v4":
        check_paged_draft_config(
            config,
            target_vocab_size=vllm_config.model_config.get_vocab_size(),
            target_hidden_size=vllm_config.model_config.get_hidden_size(),
        )
    check_safetensors_files(draft_model_config.model)


def _make_proposer(vllm_config: VllmConfig, device: torch.device, runner):
    """Full-attention Qwen3 and Gemma-4 drafts keep their context in vLLM's paged
    KV cache (DFlash's machinery), DeepSeek-V4's sliding-window drafts in the
    proposer's own ring."""
    family = draft_family(vllm_config.speculative_config.draft_model_config)
    check_draft(vllm_config, family)
    if family != "deepseek_v4":
        from vllm.v1.spec_decode.dspark.paged_proposer import DSparkPagedProposer

        return DSparkPagedProposer(vllm_config, device, runner)
    from vllm.v1.spec_decode.dspark.ring_proposer import DSparkRingProposer

    return DSparkRingProposer(vllm_config, device, runner)


def prefix_hit_recompute_tokens(vllm_config: VllmConfig) -> int:
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
    return DeepSeekV4DSparkConfig.from_hf_config(draft_model_config.hf_config).sliding_window
