# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DSpark speculative decoding on vLLM's V1 model runner: the entry points.

vLLM's front end calls ``check_dspark_config`` once it has built the config (``EngineArgs``,
patched), so that every refusal that needs no weights comes before any process starts; the
runner patch calls ``make_dspark_proposer``, which picks the proposer of the draft's family
(``dspark/family.py``, which the scheduler patch imports alone).
"""

import torch

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.spec_decode.dspark import __version__
from vllm.v1.spec_decode.dspark.checks import (
    check_draft,
    check_speculative_fields,
    unsupported_fields,
)
from vllm.v1.spec_decode.dspark.family import draft_family
from vllm.v1.spec_decode.dspark.options import DSparkOptions
from vllm.v1.spec_decode.dspark.refusal import refuse

logger = init_logger(__name__)


def check_dspark_config(vllm_config: VllmConfig) -> None:
    """Refuse, in one line, what the V1 proposer could only refuse after the target loads: the
    draft's config and files and the speculative config's fields."""
    speculative_config = vllm_config.speculative_config
    try:
        family = draft_family(speculative_config.draft_model_config)
        check_draft(vllm_config, family)
        check_speculative_fields(
            speculative_config,
            async_scheduling=bool(vllm_config.scheduler_config.async_scheduling),
            target_tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
            unsupported=unsupported_fields(family),
        )
        DSparkOptions.from_config(speculative_config)  # the confidence pair checks itself
    except ValueError as error:
        raise ValueError(f"DSpark refused the configuration: {error}") from None


def make_dspark_proposer(vllm_config: VllmConfig, device: torch.device, runner=None):
    """The V1 DSpark proposer for the configured draft (``check_dspark_config`` passed). A
    refusal here or of the loaded draft (``records_refusal``) is logged once more as one short
    line, and recorded for the frontend to raise last (``dspark/refusal.py``): vLLM's start-up
    failure buries it in a long traceback."""
    try:
        return _make_proposer(vllm_config, device, runner)
    except ValueError as error:
        refuse(vllm_config.instance_id, error)
        raise


def _make_proposer(vllm_config: VllmConfig, device: torch.device, runner):
    """Full-attention Qwen3 and Gemma-4 drafts keep their context in vLLM's paged
    KV cache (DFlash's machinery), DeepSeek-V4's sliding-window drafts in the
    proposer's own ring."""
    family = draft_family(vllm_config.speculative_config.draft_model_config)
    logger.info("DSpark %s (dspark-vllm), %s draft.", __version__, family)
    if family != "deepseek_v4":
        from vllm.v1.spec_decode.dspark.paged_proposer import DSparkPagedProposer

        return DSparkPagedProposer(vllm_config, device, runner)
    from vllm.v1.spec_decode.dspark.ring_proposer import DSparkRingProposer

    return DSparkRingProposer(vllm_config, device, runner)
