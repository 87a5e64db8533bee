# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Fixtures for real vLLM CPU engines over tiny local models (see dspark_demo/engine.py).

The engine environment must be set before vllm is imported anywhere in the session.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dspark_demo.engine import use_engine_env

use_engine_env()

from dspark_demo import tiny_models  # noqa: E402


@dataclass
class TinyModels:
    """One family's tiny targets and DeepSpec-layout drafts (each shipping its target's
    embedding and head)."""

    spec: tiny_models.DSparkDraftSpec | tiny_models.Gemma4DraftSpec
    random_target: Path
    zero_target: Path
    """Greedy decoding emits token 0 forever: the acceptance oracle's target."""
    bigram_target: Path
    random_draft: Path
    oracle_draft: Path
    bigram_draft: Path
    root: Path


@dataclass(frozen=True)
class Family:
    """How ``tiny_models`` builds one family's targets and drafts."""

    spec: Callable[..., Any]
    build_target: Callable[..., Path]
    zero_kind: str
    save_draft: Callable[..., Path]
    """``(model_dir, spec, target, weights)``"""
    oracle_weights: Callable[..., dict]
    bigram_weights: Callable[..., dict]


FAMILIES = {
    "qwen3": Family(
        spec=tiny_models.DSparkDraftSpec,
        build_target=tiny_models.build_qwen3_target,
        zero_kind="zero-lm-head",
        save_draft=lambda model_dir, spec, target, weights=None: tiny_models.save_dspark_draft(
            model_dir, spec, weights, target
        ),
        oracle_weights=tiny_models.oracle_dspark_weights,
        bigram_weights=tiny_models.bigram_dspark_weights,
    ),
    "gemma4": Family(
        spec=tiny_models.Gemma4DraftSpec,
        build_target=tiny_models.build_gemma4_target,
        zero_kind="zero-norm",
        save_draft=tiny_models.save_gemma4_draft,
        oracle_weights=tiny_models.oracle_gemma4_draft_weights,
        bigram_weights=tiny_models.bigram_gemma4_draft_weights,
    ),
}


def build_family(family: Family, root: Path) -> TinyModels:
    spec = family.spec()
    bigram_spec = family.spec(markov_rank=tiny_models.HIDDEN_SIZE)
    random_target = family.build_target(root / "random-target")
    zero_target = family.build_target(root / "zero-target", kind=family.zero_kind)
    bigram_target = family.build_target(root / "bigram-target", kind="bigram")
    return TinyModels(
        spec=spec,
        random_target=random_target,
        zero_target=zero_target,
        bigram_target=bigram_target,
        random_draft=family.save_draft(root / "random-draft", spec, random_target),
        oracle_draft=family.save_draft(
            root / "oracle-draft", spec, zero_target, family.oracle_weights(spec)
        ),
        bigram_draft=family.save_draft(
            root / "bigram-draft",
            bigram_spec,
            bigram_target,
            family.bigram_weights(bigram_spec, bigram_target),
        ),
        root=root,
    )


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_family(name)``: that family's models, built once a session."""
    built: dict[str, TinyModels] = {}

    def get(family: str) -> TinyModels:
        if family not in built:
            root = tmp_path_factory.mktemp(f"tiny-{family}")
            built[family] = build_family(FAMILIES[family], root)
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny(tiny_family) -> TinyModels:
    """The Qwen3 family."""
    return tiny_family("qwen3")


@pytest.fixture(scope="session")
def gemma(tiny_family) -> TinyModels:
    """The Gemma-4 family."""
    return tiny_family("gemma4")
