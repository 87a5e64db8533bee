"""The proposer's start-up checks of the draft's config values, log path and weight files
(pure logic; tests/engine/test_dspark_config_errors.py shows the engine runs them)."""

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig

from vllm.v1.spec_decode.dspark.options import (
    check_block_size,
    check_draft_flags,
    check_draft_log,
    check_paged_draft_config,
    check_safetensors_files,
)

VOCAB, HIDDEN = 1000, 64


def qwen3_draft(**values) -> PretrainedConfig:
    base = {"mask_token_id": 5, "target_layer_ids": [-1, 0], "hidden_size": HIDDEN}
    return PretrainedConfig(**{**base, **values})


def check(config: PretrainedConfig) -> None:
    check_block_size(config)
    check_draft_flags(config)
    check_paged_draft_config(config, target_vocab_size=VOCAB, target_hidden_size=HIDDEN)


def test_a_valid_config_passes():
    check(qwen3_draft(block_size=7, markov_rank=8, sample_from_anchor=False))  # -1: embeddings
    check(qwen3_draft(dflash_config={"mask_token_id": VOCAB - 1, "target_layer_ids": [1]}))
    check(qwen3_draft(mask_token_id=None, target_hidden_size=HIDDEN, hidden_size=32))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"block_size": 0}, "block_size=0 is not a positive integer"),
        ({"block_size": -2}, "block_size=-2 is not a positive integer"),
        ({"block_size": "4"}, "block_size='4' is not a positive integer"),
        ({"block_size": True}, "block_size=True is not a positive integer"),
        ({"dspark_block_size": 0}, "dspark_block_size=0"),
        ({"mask_token_id": VOCAB}, f"mask_token_id={VOCAB} is not a token id"),
        ({"mask_token_id": -1}, "mask_token_id=-1 is not a token id"),
        ({"mask_token_id": "5"}, "mask_token_id='5'"),
        ({"dflash_config": {"mask_token_id": 10**6}}, "mask_token_id=1000000"),
        ({"target_layer_ids": ["0", 1]}, "target_layer_ids=['0', 1] is not a list of integer"),
        ({"target_layer_ids": 3}, "target_layer_ids=3 is not a list"),
        ({"hidden_size": 32}, "target features of width 32"),
        ({"sample_from_anchor": "false"}, "sample_from_anchor='false' is not a boolean"),
        ({"enable_confidence_head": 1}, "enable_confidence_head=1 is not a boolean"),
        ({"confidence_head_with_markov": "yes"}, "confidence_head_with_markov='yes'"),
        ({"markov_rank": 0}, "markov_rank=0 is not a positive integer"),
        ({"markov_rank": 2.5}, "markov_rank=2.5 is not a positive integer"),
        ({"target_hidden_size": 128}, "target features of width 128"),
    ],
)
def test_bad_values_are_refused_naming_field_value_and_fix(values, message):
    with pytest.raises(ValueError, match=r"Set it|List the|Use the|Write true") as caught:
        check(qwen3_draft(**values))
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_draft_log_must_be_an_appendable_file(tmp_path):
    check_draft_log(None)
    check_draft_log(str(tmp_path / "drafts.jsonl"))
    (start,) = [json.loads(line) for line in (tmp_path / "drafts.jsonl").read_text().splitlines()]
    assert start["event"] == "start" and start["pid"] == os.getpid()
    with pytest.raises(ValueError, match=r"is a directory\. Name a file"):
        check_draft_log(str(tmp_path))
    with pytest.raises(ValueError, match=r"does not exist\. Create it first"):
        check_draft_log(str(tmp_path / "missing" / "drafts.jsonl"))
    with pytest.raises(ValueError, match=r"cannot be appended to \(No such file"):
        check_draft_log("/proc/self/dspark-drafts.jsonl")
    # Opens, but takes no write: only writing at start-up finds that.
    with pytest.raises(ValueError, match=r"cannot be appended to \(No space left on device\)"):
        check_draft_log("/dev/full")


def test_not_writable_is_refused_for_a_non_root_user(tmp_path):
    if os.getuid() == 0:
        pytest.skip("root may write anywhere; /proc covers the refusal above")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="cannot be appended to"):
        check_draft_log(str(locked / "drafts.jsonl"))


def test_truncated_safetensors_files_are_named(tmp_path):
    save_file({"w": torch.ones(64, 64)}, str(tmp_path / "model-00001.safetensors"))
    save_file({"v": torch.ones(8)}, str(tmp_path / "model-00002.safetensors"))
    check_safetensors_files(str(tmp_path))
    check_safetensors_files("org/hub-id")  # not a local directory: vLLM verifies downloads
    data = (tmp_path / "model-00002.safetensors").read_bytes()
    (tmp_path / "model-00002.safetensors").write_bytes(data[:-5])
    with pytest.raises(ValueError, match=r"model-00002\.safetensors: truncated: \d+ bytes"):
        check_safetensors_files(str(tmp_path))
    (tmp_path / "model-00002.safetensors").write_bytes(data[:6])
    with pytest.raises(ValueError, match="not even its header is complete"):
        check_safetensors_files(str(tmp_path))
    header = b"not json"
    (tmp_path / "model-00002.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ValueError, match="header is not valid safetensors JSON"):
        check_safetensors_files(str(tmp_path))
    header = json.dumps([1]).encode()
    (tmp_path / "model-00002.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ValueError, match="header is not valid safetensors JSON"):
        check_safetensors_files(str(tmp_path))
