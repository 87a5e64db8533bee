# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The V1 runner taps a DeepSeek-V4 target at the draft's ``dspark_target_layer_ids``.

DeepSeek-V4 checkpoints name their taps only in ``dspark_target_layer_ids`` (no ``dflash_config``),
so without the pinned runner patch the V1 runner would fall back to EAGLE-3's default layers.
vLLM's DeepSeek-V4 model emits, for aux id i + 1, the mean over the hyper-connection streams after
decoder layer i (``models/deepseek_v4/{nvidia,cpu}/model.py``).
"""

import types

from vllm.v1.worker.gpu_model_runner import GPUModelRunner


def runner_with_draft_config(**fields) -> types.SimpleNamespace:
    draft_model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(**fields))
    return types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(draft_model_config=draft_model_config)
    )


def test_dspark_target_layer_ids_become_aux_layers():
    runner = runner_with_draft_config(dspark_target_layer_ids=[40, 41, 42])
    assert GPUModelRunner._get_eagle3_aux_layers_from_config(runner) == (41, 42, 43)


def test_dflash_config_still_wins_for_qwen3_drafts():
    runner = runner_with_draft_config(
        dflash_config={"target_layer_ids": [1, 5]}, dspark_target_layer_ids=[7]
    )
    assert GPUModelRunner._get_eagle3_aux_layers_from_config(runner) == (2, 6)
