"""DeepSeek-V4-Flash DSpark draft on vLLM's DeepSeek-V4 modules, and its strict loader."""

from .backbone import DeepSeekV4DSparkBackbone
from .config import DeepSeekV4DSparkConfig, DSparkConfigError
from .draft import build_deepseek_v4_draft_model, is_deepseek_v4_dspark, load_deepseek_v4_draft
from .loader import (
    CheckpointDraftTensors,
    DSparkCheckpointError,
    checkpoint_draft_tensors,
    expected_draft_names,
)

__all__ = [
    "CheckpointDraftTensors",
    "DSparkCheckpointError",
    "DSparkConfigError",
    "DeepSeekV4DSparkBackbone",
    "DeepSeekV4DSparkConfig",
    "build_deepseek_v4_draft_model",
    "checkpoint_draft_tensors",
    "expected_draft_names",
    "is_deepseek_v4_dspark",
    "load_deepseek_v4_draft",
]
