# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeepSeek-V4-Flash DSpark draft on vLLM's DeepSeek-V4 modules, and its strict loader.

Lazy: importing the package (or its torch-free ``config`` module) loads no V4 model code;
each name below imports its submodule on first use.
"""

import importlib

_SUBMODULE = {
    "DeepSeekV4DSparkBackbone": "backbone",
    "DeepSeekV4DSparkConfig": "config",
    "DSparkConfigError": "config",
    "build_deepseek_v4_draft_model": "draft",
    "load_deepseek_v4_draft": "draft",
    "CheckpointDraftTensors": "loader",
    "DSparkCheckpointError": "loader",
    "checkpoint_draft_tensors": "loader",
    "expected_draft_names": "loader",
}

__all__ = sorted(_SUBMODULE)


def __getattr__(name: str):
    if name not in _SUBMODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_SUBMODULE[name]}", __name__), name)
