# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The checkpoints the shipped profiles serve, as an offline Hugging Face cache of their
`config.json` files, for a dry start on a host that has not downloaded them.

The configs are the published ones (DeepSeek-V4-Flash-0731's from `dspark_fixtures`; Qwen3-8B's and
DeepSpec's `dspark_qwen3_8b_block7`, which DeepSpec's `build_draft_config` derives from it with
the release's draft arguments). The tokenizer is a stand-in holding the special tokens vLLM's
reasoning and tool parsers look up; a dry start never tokenizes text. Preflight reads the node's
real snapshot instead.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from dspark_fixtures.deepseek_v4_flash import V4_FLASH_CONFIG

QWEN3_8B_CONFIG: dict = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def dspark_qwen3_draft_config(target: dict, target_layer_ids: list[int]) -> dict:
    """DeepSpec's `build_draft_config` for a Qwen3 target with its release draft arguments
    (block 7, five draft layers, Markov rank 256, confidence head with the Markov features)."""
    draft = copy.deepcopy(target)
    num_draft_layers = len(target_layer_ids)
    draft.update(
        architectures=["Qwen3DSparkModel"],
        num_target_layers=target["num_hidden_layers"],
        num_hidden_layers=num_draft_layers,
        block_size=7,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * num_draft_layers,
        mask_token_id=151669,
        target_layer_ids=target_layer_ids,
        num_anchors=512,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        markov_rank=256,
        markov_head_type="vanilla",
    )
    return draft


# Hub id -> config.json.
CONFIGS: dict[str, dict] = {
    "deepseek-ai/DeepSeek-V4-Flash-0731": V4_FLASH_CONFIG,
    "Qwen/Qwen3-8B": QWEN3_8B_CONFIG,
    "deepseek-ai/dspark_qwen3_8b_block7": dspark_qwen3_draft_config(
        QWEN3_8B_CONFIG, [1, 9, 17, 25, 33]
    ),
}
# Special tokens vLLM's DeepSeek and Qwen3 reasoning and tool parsers look up.
SPECIAL_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
# A snapshot without a pinned revision sits under this commit (what `refs/main` names).
UNPINNED_REVISION = "0" * 40


def write_offline_cache(hf_home: Path, models: dict[str, str | None]) -> None:
    """An offline cache under `hf_home` holding each `model -> revision`'s config.json and a
    stand-in tokenizer. Raises KeyError naming a model whose config the project lacks."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers import models as token_models

    for model, revision in models.items():
        if model not in CONFIGS:
            raise KeyError(
                f"no config.json for {model}: a dry start on a table device knows "
                f"{', '.join(sorted(CONFIGS))} (preflight reads any snapshot on the node)"
            )
        repo = hf_home / "hub" / ("models--" + model.replace("/", "--"))
        commit = revision or UNPINNED_REVISION
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
        (snapshot / "config.json").write_text(json.dumps(CONFIGS[model]))
        tokenizer = Tokenizer(token_models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
        tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL_TOKENS])
        tokenizer.save(str(snapshot / "tokenizer.json"))
        (snapshot / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"})
        )
