"""Bad DSpark configurations fail when the engine starts, saying what to fix."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_demo.engine import dspark_config, run_engine

pytestmark = pytest.mark.engine


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


def test_k_beyond_the_trained_block_is_refused(tiny):
    message = startup_error(tiny.random_target, dspark_config(tiny.random_draft, k=5))
    assert "exceeds the DSpark draft's trained block size 4" in message
    assert "num_speculative_tokens <= 4" in message


def test_target_layers_missing_from_the_target_are_refused(tiny, tmp_path):
    draft = copy_draft(
        tiny.random_draft,
        tmp_path / "draft",
        {"target_layer_ids": [0, 5]},
    )
    message = startup_error(tiny.random_target, dspark_config(draft))
    assert "target_layer_ids [0, 5]" in message
    assert "2-layer target" in message


def test_a_draft_without_target_layers_is_refused(tiny, tmp_path):
    draft = copy_draft(tiny.random_draft, tmp_path / "draft", {"target_layer_ids": None})
    message = startup_error(tiny.random_target, dspark_config(draft))
    assert "names no target layers" in message


def test_a_checkpoint_that_is_not_a_dspark_draft_is_refused(tiny):
    message = startup_error(tiny.random_target, dspark_config(tiny.random_target))
    assert "is not a DSpark draft the V1 proposer supports" in message


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


def test_unknown_and_invalid_options_are_refused(tiny):
    message = startup_error(tiny.random_target, dspark_config(tiny.random_draft, dspark_windw=64))
    assert "dspark_windw" in message
    assert "Unexpected keyword argument" in message
    message = startup_error(
        tiny.random_target,
        dspark_config(tiny.random_draft, dspark_confidence_scheduler="threshold"),
    )
    assert "dspark_confidence_threshold" in message


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


def test_bad_draft_values_and_files_stop_start_up_in_one_line(tiny, tmp_path):
    """Each was accepted at start-up (the first request then killed the server) or failed with
    a root cause that named nothing; now each engine start stops naming field and fix."""
    truncated = copy_draft(tiny.random_draft, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    cases = [
        (
            dspark_config(
                copy_draft(tiny.random_draft, tmp_path / "mask", {"mask_token_id": 10**6})
            ),
            "mask_token_id=1000000 is not a token id",
        ),
        (
            dspark_config(copy_draft(tiny.random_draft, tmp_path / "str", {"block_size": "4"})),
            "block_size='4' is not a positive integer",
        ),
        (
            dspark_config(copy_draft(tiny.random_draft, tmp_path / "zero", {"block_size": 0})),
            "block_size=0 is not a positive integer",
        ),
        (dspark_config(truncated), f"{weights}: truncated"),
        (
            dspark_config(tiny.random_draft, dspark_draft_log=str(log_dir)),
            f"dspark_draft_log='{log_dir}' is a directory",
        ),
    ]
    missed = []
    for config, expected in cases:
        try:
            message = startup_error(tiny.random_target, config)
        except pytest.fail.Exception:
            message = "(the engine started and served)"
        if expected not in message:
            missed.append(f"{expected!r}: got {message.splitlines()[-1][:200]!r}")
    assert not missed, "\n".join(missed)
