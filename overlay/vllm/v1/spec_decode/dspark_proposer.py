# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DSpark speculative decoding on vLLM's V1 model runner: the entry points.

``VllmConfig`` calls ``check_dspark_config`` as it validates (patched), in vLLM's front end:
every refusal that needs no weights comes before any process starts, and what passes is the
draft's spec (``dspark/spec.py``), kept on the config for every engine process. The
runner patch calls ``make_dspark_proposer``, which builds the proposer of the spec's family.
"""

import torch

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.spec_decode.dspark import __version__
from vllm.v1.spec_decode.dspark.checks import (
    check_confidence_scheduling_without_async,
    checked_draft_spec,
)
from vllm.v1.spec_decode.dspark.field_errors import REFUSAL
from vllm.v1.spec_decode.dspark.spec import draft_spec

logger = init_logger(__name__)


def check_dspark_config(vllm_config: VllmConfig) -> None:
    """Refuse, in one line, what the V1 proposer could only refuse after the target loads: the
    draft's config and files and the speculative config's fields; keep the draft's spec on
    ``vllm_config.speculative_config.dspark_draft``."""
    try:
        spec = checked_draft_spec(vllm_config)
    except ValueError as error:
        raise ValueError(f"{REFUSAL}{error}") from None
    vllm_config.speculative_config.dspark_draft = spec
    block_size = spec.trained_block_size
    if block_size and spec.num_drafts < block_size:
        logger.info(
            "DSpark draft trained with block size %d: %s, verifying the first k=%d.",
            block_size,
            "drafting k per step" if spec.family == "deepseek_v4" else "drafting the full block",
            spec.num_drafts,
        )


def check_dspark_scheduling(vllm_config: VllmConfig) -> None:
    """Refuse confidence-scheduled lengths under async scheduling, once the platform has had
    the last word on it (``VllmConfig`` validates, patched, after ``check_dspark_config``)."""
    scheduler = draft_spec(vllm_config).options.scheduling.scheduler
    try:
        check_confidence_scheduling_without_async(
            scheduler, bool(vllm_config.scheduler_config.async_scheduling)
        )
    except ValueError as error:
        raise ValueError(f"{REFUSAL}{error}") from None


def make_dspark_proposer(vllm_config: VllmConfig, device: torch.device, runner=None):
    """The V1 DSpark proposer of the draft's family (``check_dspark_config`` passed):
    full-attention Qwen3 and Gemma-4 drafts keep their context in vLLM's paged KV cache
    (DFlash's machinery), DeepSeek-V4's sliding-window drafts in the proposer's own ring."""
    spec = draft_spec(vllm_config)
    logger.info("DSpark %s (dspark-vllm), %s draft.", __version__, spec.family)
    if spec.family != "deepseek_v4":
        from vllm.v1.spec_decode.dspark.paged_proposer import DSparkPagedProposer

        return DSparkPagedProposer(vllm_config, device, runner)
    from vllm.v1.spec_decode.dspark.ring_proposer import DSparkRingProposer

    return DSparkRingProposer(vllm_config, device, runner)
