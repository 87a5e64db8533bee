# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Bad DSpark configurations fail when the engine starts, saying what to fix.

The checks of config values, files and fields run as ``VllmConfig`` validates, before anything
is built, and are tested there on vLLM's own config (tests/dspark/test_startup_checks.py,
tests/dspark/test_options.py); one engine start here shows that the engine runs them. The
refusals that need the loaded draft start an engine each."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_fixtures.engine import dspark_config, run_engine


def startup_error(target: Path, speculative_config: dict) -> str:
    """Every message along the exception chain of a failed engine start."""
    with pytest.raises(Exception) as caught:
        run_engine(target, ["w1 w2 w3"], 4, speculative_config)
    messages = []
    error: BaseException | None = caught.value
    while error is not None:
        messages.append(str(error))
        error = error.__cause__ or error.__context__
    return "\n".join(messages)


def copy_draft(
    source: Path, destination: Path, config_changes=None, drop_tensor=None, add_tensors=None
) -> Path:
    destination.mkdir()
    config = json.loads((source / "config.json").read_text())
    config.update(config_changes or {})
    (destination / "config.json").write_text(json.dumps(config))
    weights = load_file(str(source / "model.safetensors"))
    weights.pop(drop_tensor, None)
    weights.update(add_tensors or {})
    save_file(weights, str(destination / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (destination / name).write_bytes((source / name).read_bytes())
    return destination


def test_the_engine_start_runs_the_checks_and_stops_naming_the_fix(tiny):
    message = startup_error(tiny.random_target, dspark_config(tiny.random_draft, k=5))
    assert "exceeds the DSpark draft's trained block size 4" in message
    assert "num_speculative_tokens <= 4" in message


def test_a_missing_draft_tensor_is_named(tiny, tmp_path):
    draft = copy_draft(
        tiny.random_draft, tmp_path / "draft", drop_tensor="layers.0.mlp.up_proj.weight"
    )
    message = startup_error(tiny.random_target, dspark_config(draft))
    assert "missing draft weights: layers.0.mlp.gate_up_proj.weight." in message


def test_an_unexpected_draft_tensor_is_named(tiny, tmp_path):
    draft = copy_draft(
        tiny.random_draft,
        tmp_path / "draft",
        add_tensors={"layers.0.self_attn.extra_proj.weight": torch.zeros(4, 4)},
    )
    message = startup_error(tiny.random_target, dspark_config(draft))
    assert "layers.0.self_attn.extra_proj" in message


def test_confidence_scheduling_needs_a_confidence_head(tiny):
    message = startup_error(
        tiny.random_target,
        dspark_config(
            tiny.random_draft,
            dspark_confidence_scheduler="threshold",
            dspark_confidence_threshold=0.5,
        ),
    )
    assert "needs a draft with a confidence head" in message
