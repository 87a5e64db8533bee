"""DeepSeek-V4-Flash DSpark draft backbone and its strict checkpoint loader."""

from .backbone import DeepSeekV4DSparkBackbone
from .config import DeepSeekV4DSparkConfig, DSparkConfigError, TensorParallelShard
from .draft import build_deepseek_v4_draft_model, is_deepseek_v4_dspark, load_deepseek_v4_draft
from .loader import DSparkCheckpointError, deepseek_v4_draft_weights, expected_backbone_names

__all__ = [
    "DSparkCheckpointError",
    "DSparkConfigError",
    "DeepSeekV4DSparkBackbone",
    "DeepSeekV4DSparkConfig",
    "TensorParallelShard",
    "build_deepseek_v4_draft_model",
    "deepseek_v4_draft_weights",
    "expected_backbone_names",
    "is_deepseek_v4_dspark",
    "load_deepseek_v4_draft",
]
