# SPDX-License-Identifier: Apache-2.0
"""DeepSeek-V4-Flash DSpark draft backbone and its strict checkpoint loader."""

from .backbone import DeepSeekV4DSparkBackbone
from .config import DeepSeekV4DSparkConfig, DSparkConfigError, TensorParallelShard
from .loader import DSparkCheckpointError, expected_checkpoint_names, load_deepseek_v4_dspark

__all__ = [
    "DSparkCheckpointError",
    "DSparkConfigError",
    "DeepSeekV4DSparkBackbone",
    "DeepSeekV4DSparkConfig",
    "TensorParallelShard",
    "expected_checkpoint_names",
    "load_deepseek_v4_dspark",
]
