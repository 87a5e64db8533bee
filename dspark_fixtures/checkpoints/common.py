# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What every tiny checkpoint shares: the word-level tokenizer, the sizes of the Qwen3 and Gemma-4
families, and norm weights that look trained.

Sizes follow what vLLM's CPU attention backend accepts (head_dim 32). Like trained checkpoints,
every model has several layers and per-layer norm weights that differ from one and from each
other layer's (``trained_norm``): a kernel that applies one layer's norm to another cannot go
unnoticed.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB_SIZE = 1000
HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 128
HEAD_DIM = 32
NUM_HEADS = 2
NUM_KV_HEADS = 1
MAX_POSITIONS = 512
NOISE_TOKEN_ID = 4
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]


def build_tokenizer(model_dir: Path) -> None:
    """A whitespace word-level tokenizer: `<unk> <s> </s> <pad> w0 .. w995`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL_TOKENS + [f"w{i}" for i in range(VOCAB_SIZE - len(SPECIAL_TOKENS))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tokenizer.save_pretrained(str(model_dir))


def trained_norm(size: int, generator: torch.Generator) -> torch.Tensor:
    """An RMSNorm weight as training leaves it: values spread over [0.5, 1.5]."""
    return 0.5 + torch.rand(size, generator=generator)
