"""Fixtures for real vLLM CPU engines over tiny local models (see dspark_demo/engine.py).

The engine environment must be set before vllm is imported anywhere in the session.
"""

from dataclasses import dataclass
from pathlib import Path

import pytest

from dspark_demo.engine import use_engine_env

use_engine_env()

from dspark_demo import tiny_models  # noqa: E402


@dataclass
class TinyModels:
    random_target: Path
    zero_lm_head_target: Path
    bigram_target: Path
    random_draft: Path
    oracle_draft: Path
    bigram_draft: Path
    root: Path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """Targets and DeepSpec-layout drafts (shipping the target's embedding and head)."""
    root = tmp_path_factory.mktemp("tiny-models")
    spec = tiny_models.DSparkDraftSpec()
    bigram_spec = tiny_models.DSparkDraftSpec(markov_rank=tiny_models.HIDDEN_SIZE)
    random_target = tiny_models.build_qwen3_target(root / "random-target")
    zero_target = tiny_models.build_qwen3_target(root / "zero-lm-head-target", kind="zero-lm-head")
    bigram_target = tiny_models.build_qwen3_target(root / "bigram-target", kind="bigram")
    return TinyModels(
        random_target=random_target,
        zero_lm_head_target=zero_target,
        bigram_target=bigram_target,
        random_draft=tiny_models.save_dspark_draft(
            root / "random-draft", spec, target=random_target
        ),
        oracle_draft=tiny_models.save_dspark_draft(
            root / "oracle-draft", spec, tiny_models.oracle_dspark_weights(spec), zero_target
        ),
        bigram_draft=tiny_models.save_dspark_draft(
            root / "bigram-draft",
            bigram_spec,
            tiny_models.bigram_dspark_weights(bigram_spec, bigram_target),
            bigram_target,
        ),
        root=root,
    )
