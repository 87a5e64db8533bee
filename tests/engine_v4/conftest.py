# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Fixtures for the real vLLM CPU engine serving a tiny DeepSeek-V4 target with its ``mtp.*`` draft.

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the tests can change the
proposer's module state. Once per session, the Triton stand-ins (``standins.py``) are installed
where Triton cannot run, and the C++ stand-ins (``cpp_standins.py``) for the DeepSeek-V4 ops this
host's vLLM extension lacks (all of them on AVX2-only CPUs, whose ``_C_AVX2`` has none).
"""

from dataclasses import dataclass
from pathlib import Path

import pytest

from dspark_fixtures.engine import use_engine_env

use_engine_env()

from dspark_fixtures import standins  # noqa: E402
from dspark_fixtures.checkpoints import deepseek_v4 as tiny_v4  # noqa: E402


@dataclass
class TinyV4:
    oracle: Path
    """Bigram target (``cycle_next``) with the ring-reading oracle draft."""
    noisy: Path
    """Context-dependent target that mostly follows the cycle, same draft: partial acceptance."""


@pytest.fixture(scope="session")
def tiny_v4_models(tmp_path_factory: pytest.TempPathFactory) -> TinyV4:
    standins.install_standins()
    root = tmp_path_factory.mktemp("tiny-v4")
    return TinyV4(
        oracle=tiny_v4.save_v4_target(root / "oracle", tiny_v4.oracle_v4_checkpoint()),
        noisy=tiny_v4.save_v4_target(
            root / "noisy", tiny_v4.oracle_v4_checkpoint(target_noise=0.3)
        ),
    )


@pytest.fixture
def gate_lifted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked prefill and prefix caching as asked: vLLM's CPU platform switches both off for
    DeepSeek-V4 unless the CPU has AMX tiles (``amx_mla_or_dsv4_enabled``), although its comment
    says the V4 CPU kernels support both (``test_v4_prefix_and_chunks.py`` checks the target)."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def keep_requested(cls, vllm_config) -> None:
        cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
        asked = (
            cache.enable_prefix_caching,
            scheduler.enable_chunked_prefill,
            scheduler.max_num_batched_tokens,
        )
        original(cls, vllm_config)
        (
            cache.enable_prefix_caching,
            scheduler.enable_chunked_prefill,
            scheduler.max_num_batched_tokens,
        ) = asked

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(keep_requested))
