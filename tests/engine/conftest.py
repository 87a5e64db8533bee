"""Fixtures for real vLLM CPU engines over tiny local models.

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): about 3 s to
start instead of 15, and the model runner lives in the test process, which the
row-indexing test relies on. The environment must be set before vllm is
imported anywhere in the session.
"""

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.update(
    HF_HUB_OFFLINE="1",
    VLLM_CPU_KVCACHE_SPACE="1",
    VLLM_USE_V2_MODEL_RUNNER="0",
    VLLM_ENABLE_V1_MULTIPROCESSING="0",
)

from dspark_demo import tiny_models


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
    root = tmp_path_factory.mktemp("tiny-models")
    spec = tiny_models.DSparkDraftSpec()
    bigram_spec = tiny_models.DSparkDraftSpec(markov_rank=tiny_models.HIDDEN_SIZE)
    bigram_target = tiny_models.build_qwen3_target(root / "bigram-target", kind="bigram")
    return TinyModels(
        random_target=tiny_models.build_qwen3_target(root / "random-target"),
        zero_lm_head_target=tiny_models.build_qwen3_target(
            root / "zero-lm-head-target", kind="zero-lm-head"
        ),
        bigram_target=bigram_target,
        random_draft=tiny_models.save_dspark_draft(root / "random-draft", spec),
        oracle_draft=tiny_models.save_dspark_draft(
            root / "oracle-draft", spec, tiny_models.oracle_dspark_weights(spec)
        ),
        bigram_draft=tiny_models.save_dspark_draft(
            root / "bigram-draft",
            bigram_spec,
            tiny_models.bigram_dspark_weights(bigram_spec, bigram_target),
        ),
        root=root,
    )


@pytest.fixture
def draft_log(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "drafts.jsonl"
    yield path
