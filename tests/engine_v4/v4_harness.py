# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The tiny-engine harness's settings for a tiny DeepSeek-V4 target."""

from pathlib import Path
from typing import Any

from dspark_fixtures.engine import EngineRun, TinyEngine

# vLLM picks DeepSeek-V4's own KV block size (256); bf16 is what its CPU kernels take.
V4_ENGINE_ARGS: dict[str, Any] = dict(dtype="bfloat16", max_model_len=1024, block_size=None)


def dspark(k: int = 4, **fields: Any) -> dict[str, Any]:
    """DSpark with the draft read from the target checkpoint's own ``mtp.*`` tensors; ``fields``
    are further SpeculativeConfig fields."""
    return {"method": "dspark", "num_speculative_tokens": k, **fields}


def run_v4(
    target: Path,
    prompts: list[list[int]],
    max_tokens: list[int],
    speculative_config: dict[str, Any] | None = None,
    abort: dict[int, int] | None = None,
    **engine_args: Any,
) -> EngineRun:
    """Generate greedily with a fresh engine (see ``TinyEngine.generate_stepwise``)."""
    with TinyEngine(target, speculative_config, **{**V4_ENGINE_ARGS, **engine_args}) as engine:
        return engine.generate_stepwise(prompts, max_tokens, abort)
