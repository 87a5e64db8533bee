# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The demo's tiny pair kept on disk (``--save DIR``), ready for ``vllm serve`` and for the
launcher's local mode.

The pair is built in a folder beside DIR (``.DIR.partial-PID``) and renamed to DIR only once
complete, so that Ctrl-C, a full disk or any other failure leaves no half-written pair: a
``config.json`` of 0 bytes, or a pair without the draft's tokenizer, would load or fail later,
far from the cause."""

import glob
import json
import os
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

from dspark_common.operator_input import describe, escaped

PARTIAL = ".partial-"
"""Infix of the folder a pair is built in: ``.DIR.partial-PID`` beside DIR."""
PAIR_FILES = (
    "target/config.json",
    "target/model.safetensors",
    "target/tokenizer.json",
    "target/tokenizer_config.json",
    "target/chat_template.jinja",
    "draft/config.json",
    "draft/model.safetensors",
    "draft/tokenizer.json",
    "draft/tokenizer_config.json",
)
"""The files of a saved pair (tests/dspark/test_demo.py checks them against a real save): a
folder with some of them missing or empty was left by an interrupted save of an earlier version,
which wrote in place."""

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


class SaveFailed(Exception):
    """The pair could not be saved; nothing was left behind. One line."""


def save_problem(destination: Path) -> str | None:
    """Why ``destination`` cannot take a saved pair, before anything is built, or None."""
    name = escaped(str(destination))
    parent = destination.parent
    kind = describe(parent)
    if kind != "is a directory":
        return f"{name}: its folder {escaped(str(parent))} {kind}; name a folder inside one"
    leftovers = sorted(parent.glob(f".{glob.escape(destination.name)}{PARTIAL}*"))
    if leftovers:
        left = escaped(str(leftovers[0]))
        return f"{left} is a folder left by an interrupted --save; delete it (rm -r {left})"
    kind = describe(destination)
    if kind == "does not exist":
        return None
    if kind != "is a directory":
        return f"{name} {kind}; name a new folder"
    entries = {entry.name for entry in destination.iterdir()}
    if not entries:
        return None
    if entries <= {"target", "draft"}:
        complete = all(
            (destination / file).is_file() and (destination / file).stat().st_size
            for file in PAIR_FILES
        )
        if complete:
            return f"{name} already holds a saved pair; serve it, or name a new folder"
        return (
            f"{name} holds an incomplete pair, left by an interrupted --save; delete it "
            f"(rm -r {name}) or name a new folder"
        )
    return f"{name}: the directory is not empty; name a new one"


def save_pair(destination: Path, build: Callable[[Path], tuple[Path, Path]]) -> tuple[Path, Path]:
    """``build(folder)`` in a new folder beside ``destination``, renamed to ``destination`` once
    it returns: the (target, draft) directories there. On any failure or interruption the folder
    is removed; an ``OSError`` becomes ``SaveFailed``."""
    partial = destination.with_name(f".{destination.name}{PARTIAL}{os.getpid()}")
    try:
        partial.mkdir()
    except OSError as error:
        raise _failed(destination, error) from None
    try:
        target, draft = build(partial)
        partial.rename(destination)  # replaces an empty folder; refuses anything else
    except BaseException as error:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(error, OSError):
            raise _failed(destination, error) from None
        raise
    return destination / target.relative_to(partial), destination / draft.relative_to(partial)


def _failed(destination: Path, error: OSError) -> SaveFailed:
    reason = escaped(error.strerror or str(error))
    return SaveFailed(f"--save {escaped(str(destination))}: {reason}; nothing was saved")
