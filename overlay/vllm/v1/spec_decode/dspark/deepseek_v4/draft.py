"""The DeepSeek-V4 DSpark draft: the V4 backbone inside the shared ``DSparkDraftModel``."""

import types
from collections.abc import Mapping

from torch import Tensor
from transformers import PretrainedConfig

from vllm.config import VllmConfig
from vllm.v1.spec_decode.dspark.draft_model import DSparkDraftModel

from .backbone import DeepSeekV4DSparkBackbone
from .layers import refuse_sequence_parallel
from .loader import load_draft_weights


def build_deepseek_v4_draft_model(
    vllm_config: VllmConfig, prefix: str = "dspark"
) -> DSparkDraftModel:
    """Validates the config and builds the draft (inside ``set_current_vllm_config``, on the
    target device, with vLLM's tensor-parallel group initialised). The V4 confidence head reads
    ``[dense ; W1[prev]]`` (``H + r`` inputs) and has no bias."""
    refuse_sequence_parallel(vllm_config)
    backbone = DeepSeekV4DSparkBackbone(vllm_config, prefix=prefix)
    config = backbone.config
    heads_config = types.SimpleNamespace(
        enable_confidence_head=config.enable_confidence_head, confidence_head_with_markov=True
    )
    return DSparkDraftModel(
        heads_config,
        backbone,
        markov_rank=config.dspark_markov_rank,
        vocab_size=vllm_config.model_config.get_vocab_size(),
        prefix=prefix,
        confidence_bias=False,
    )


def load_deepseek_v4_draft(
    model: DSparkDraftModel, weights: Mapping[str, Tensor], hf_config: PretrainedConfig
) -> None:
    """Loads the draft from the target checkpoint's tensors by name, strictly, as shipped."""
    assert isinstance(model.backbone, DeepSeekV4DSparkBackbone)
    load_draft_weights(
        model, model.backbone.config, weights, getattr(hf_config, "expert_dtype", "fp4")
    )
