"""The DeepSeek-V4 DSpark draft: the V4 backbone inside the shared ``DSparkDraftModel``."""

import types
from collections.abc import Iterable

import torch
from torch import Tensor
from transformers import PretrainedConfig

from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.v1.spec_decode.dspark.draft_model import DSparkDraftModel

from .backbone import DeepSeekV4DSparkBackbone
from .config import DeepSeekV4DSparkConfig, TensorParallelShard
from .layers import AllReduce
from .loader import deepseek_v4_draft_weights


def is_deepseek_v4_dspark(hf_config: PretrainedConfig) -> bool:
    """A DeepSeek-V4 target checkpoint whose ``mtp.*`` stages are a DSpark draft."""
    return getattr(hf_config, "model_type", None) in ("deepseek_v4", "deepseek_v4_dspark") and bool(
        getattr(hf_config, "dspark_block_size", None)
    )


def build_deepseek_v4_draft_model(
    hf_config: PretrainedConfig | dict,
    *,
    vocab_size: int,
    dtype: torch.dtype,
    shard: TensorParallelShard | None = None,
    prefix: str = "dspark",
) -> DSparkDraftModel:
    """Validates the config and builds the draft (construct inside ``set_current_vllm_config``).

    ``shard`` defaults to this process's place in vLLM's tensor-parallel group, with vLLM's
    all-reduce; an explicit shard gets no all-reduce (modules return their partial sums).
    The V4 confidence head reads ``[dense ; W1[prev]]`` (``H + r`` inputs) and has no bias.
    """
    config = DeepSeekV4DSparkConfig.from_hf_config(hf_config)
    all_reduce: AllReduce | None = None
    if shard is None:
        shard = TensorParallelShard(
            get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        )
        if shard.size > 1:
            all_reduce = tensor_model_parallel_all_reduce
    backbone = DeepSeekV4DSparkBackbone(config, dtype=dtype, shard=shard, all_reduce=all_reduce)
    heads_config = types.SimpleNamespace(
        enable_confidence_head=config.enable_confidence_head, confidence_head_with_markov=True
    )
    return DSparkDraftModel(
        heads_config,
        backbone,
        markov_rank=config.dspark_markov_rank,
        vocab_size=vocab_size,
        prefix=prefix,
        confidence_bias=False,
    )


def load_deepseek_v4_draft(model: DSparkDraftModel, weights: Iterable[tuple[str, Tensor]]) -> None:
    """Loads the draft from the whole target checkpoint's tensors, strictly."""
    assert isinstance(model.backbone, DeepSeekV4DSparkBackbone)
    model.load_weights(deepseek_v4_draft_weights(weights, model.backbone.config))
