# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The DeepSeek-V4 DSpark draft: the V4 backbone inside the shared ``DSparkRingDraft``."""

from collections.abc import Mapping

from torch import Tensor
from transformers import PretrainedConfig

from vllm.config import VllmConfig
from vllm.v1.spec_decode.dspark.draft_model import DSparkRingDraft

from .backbone import DeepSeekV4DSparkBackbone
from .layers import refuse_sequence_parallel
from .loader import load_draft_weights


def build_deepseek_v4_draft_model(
    vllm_config: VllmConfig, prefix: str = "dspark"
) -> DSparkRingDraft:
    """Validates the config and builds the draft (inside ``set_current_vllm_config``, on the
    target device, with vLLM's tensor-parallel group initialised)."""
    refuse_sequence_parallel(vllm_config)
    backbone = DeepSeekV4DSparkBackbone(vllm_config, prefix=prefix)
    return DSparkRingDraft(backbone, vocab_size=backbone.config.vocab_size)


def load_deepseek_v4_draft(
    model: DSparkRingDraft, weights: Mapping[str, Tensor], hf_config: PretrainedConfig
) -> None:
    """Loads the draft from the target checkpoint's tensors by name, strictly, as shipped."""
    assert isinstance(model.backbone, DeepSeekV4DSparkBackbone)
    load_draft_weights(
        model, model.backbone.config, weights, getattr(hf_config, "expert_dtype", "fp4")
    )
