# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Fixtures for real vLLM CPU engines over tiny local models (see dspark_fixtures/engine.py).

The engine environment must be set before vllm is imported anywhere in the session.
"""

from dataclasses import dataclass
from pathlib import Path

import pytest

from dspark_fixtures.engine import use_engine_env

use_engine_env()

from dspark_fixtures.checkpoints import gemma4, qwen3  # noqa: E402
from dspark_fixtures.checkpoints.families import FAMILIES, Family  # noqa: E402


@dataclass
class TinyModels:
    """One family's tiny targets and DeepSpec-layout drafts (each shipping its target's
    embedding and head)."""

    spec: qwen3.DSparkDraftSpec | gemma4.Gemma4DraftSpec
    random_target: Path
    zero_target: Path
    """Greedy decoding emits token 0 forever: the acceptance oracle's target."""
    bigram_target: Path
    random_draft: Path
    oracle_draft: Path
    bigram_draft: Path
    root: Path


def build_family(family: Family, root: Path) -> TinyModels:
    spec = family.spec()
    bigram_spec = family.spec(markov_rank=qwen3.HIDDEN_SIZE)
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
