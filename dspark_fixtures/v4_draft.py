# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Build the DeepSeek-V4 DSpark draft exactly as the proposer does, outside an engine.

The draft needs a ``VllmConfig`` for the target (vLLM's MoE and linear layers read it) and vLLM's
tensor-parallel group; both are made here for a one-process group.
"""

import tempfile
from pathlib import Path

import torch

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import (
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.spec_decode.dspark.deepseek_v4 import build_deepseek_v4_draft_model
from vllm.v1.spec_decode.dspark.draft_model import DSparkRingDraft


def v4_vllm_config(model_dir: Path, k: int = 4) -> VllmConfig:
    return EngineArgs(
        model=str(model_dir),
        dtype="bfloat16",
        max_model_len=512,
        enforce_eager=True,
        skip_tokenizer_init=True,
        speculative_config={"method": "dspark", "num_speculative_tokens": k},
    ).create_engine_config()


def build_draft(vllm_config: VllmConfig, device: str = "cpu") -> DSparkRingDraft:
    """The draft's modules, unloaded, on ``device`` ("meta" builds without memory)."""
    with set_current_vllm_config(vllm_config):
        if not model_parallel_is_initialized():
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"file://{tempfile.mkstemp()[1]}",
                backend="gloo",
            )
            initialize_model_parallel(1)
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device(device):
            return build_deepseek_v4_draft_model(vllm_config)
