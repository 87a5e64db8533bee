# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The paged proposer's draft families as the engine suite and the benchmarks build them: one
`Family` per family, over the tiny checkpoint builders of this package."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_fixtures.checkpoints import gemma4, qwen3


@dataclass(frozen=True)
class Family:
    """How ``dspark_fixtures.checkpoints`` builds one family's targets and drafts."""

    spec: Callable[..., Any]
    build_target: Callable[..., Path]
    zero_kind: str
    save_draft: Callable[..., Path]
    """``(model_dir, spec, target, weights)``"""
    oracle_weights: Callable[..., dict]
    bigram_weights: Callable[..., dict]


FAMILIES = {
    "qwen3": Family(
        spec=qwen3.DSparkDraftSpec,
        build_target=qwen3.build_qwen3_target,
        zero_kind="zero-lm-head",
        save_draft=lambda model_dir, spec, target, weights=None: qwen3.save_dspark_draft(
            model_dir, spec, weights, target
        ),
        oracle_weights=qwen3.oracle_dspark_weights,
        bigram_weights=qwen3.bigram_dspark_weights,
    ),
    "gemma4": Family(
        spec=gemma4.Gemma4DraftSpec,
        build_target=gemma4.build_gemma4_target,
        zero_kind="zero-norm",
        save_draft=gemma4.save_gemma4_draft,
        oracle_weights=gemma4.oracle_gemma4_draft_weights,
        bigram_weights=gemma4.bigram_gemma4_draft_weights,
    ),
}
