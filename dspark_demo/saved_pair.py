# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The demo's tiny pair kept on disk (``--save DIR``), ready for ``vllm serve`` and for the
launcher's local mode."""

import json
import shlex
from pathlib import Path

CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ message['content'] }}"
    "{%- if not loop.last %} {% endif %}{%- endfor %}"
)
"""Every message's words in order: the tiny tokenizer knows only ``w0`` .. ``w995``, so a
chat request's messages are such words, and ``/v1/chat/completions`` needs a template."""


def add_chat_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(model_dir))


def serve_command(target: Path, draft: Path, k: int) -> str:
    """The ``vllm serve`` command line for the saved pair on a CPU."""
    speculative = {"method": "dspark", "model": str(draft), "num_speculative_tokens": k}
    return (
        "VLLM_USE_V2_MODEL_RUNNER=0 VLLM_CPU_KVCACHE_SPACE=1 vllm serve "
        f"{shlex.quote(str(target))} --served-model-name tiny --dtype float32 --max-model-len 256 "
        f"--speculative-config {shlex.quote(json.dumps(speculative))}"
    )
