# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Every way vLLM's parser and config rules stop the dry start ends in a verdict: `--help` in
`serve_args` (the parser prints and exits 0), an exit inside start-up, a rank outside the world
size and a tensor-parallel size the model cannot divide, each refused with the field that
caused it, exit status 2 and the reason as the last line and in `--json`. In-process, up to
vLLM's config (no engine starts): vLLM's own parser and config on the published Qwen3-8B
config.json."""

from __future__ import annotations

import json
import logging

import pytest

from tools.dry_start import engine
from tools.dry_start.checkpoints import QWEN3_8B_CONFIG


@pytest.fixture
def model(tmp_path, monkeypatch):
    """A model directory holding Qwen3-8B's config.json (32 attention heads); vLLM's log
    handlers restored afterwards (`engine.run` restores what its `dry_device` replaced)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "handlers", list(vllm_logger.handlers))
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B_CONFIG))
    return [str(tmp_path), "--max-model-len", "256", "--dtype", "bfloat16"]


def replaceable() -> tuple:
    """What `engine.dry_device` replaces for a run on the host's own device."""
    import torch.distributed as dist

    import vllm.platforms
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm.model_executor.models import registry

    return (
        vllm.platforms.current_platform,
        dist.new_group,
        MessageQueue.create_from_process_group,
        registry._run_in_subprocess,
    )


def verdict(capsys, serve_args: list[str], rank: int = 0) -> tuple[int, str, dict]:
    """The exit status, the last line of the text report and the `--json` report; each run
    leaves what its `dry_device` replaced as it found it."""
    before = replaceable()
    status = engine.report_and_exit(lambda: engine.run(serve_args, rank), as_json=False)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert engine.report_and_exit(lambda: engine.run(serve_args, rank), as_json=True) == status
    assert replaceable() == before
    return status, last, json.loads(capsys.readouterr().out)


def test_help_in_serve_args_is_a_refusal_not_a_success(model, capsys):
    status, last, report = verdict(capsys, [*model, "--help"])
    assert status == 2 and not report["ok"]
    assert report["refusal"]["step"] == "arguments"
    assert "vLLM's serve parser printed its help and exited (status 0)" in last
    assert last.startswith("REFUSED at arguments: ") and "fix: remove --help" in last


def test_an_argument_the_parser_cannot_read_is_its_last_line(model, capsys):
    status, last, report = verdict(capsys, [*model, "--version"])
    assert status == 2
    assert "exited with status 2: vllm serve: error: unrecognized arguments: --version" in last
    assert report["refusal"]["message"] in last


def test_a_mistyped_flag_is_named_with_vllms_closest_one(model, capsys):
    """As on a node, where the rank's dry start runs without the launcher."""
    status, last, _ = verdict(capsys, [*model, "--enable-prefix-cacheing"])
    assert status == 2
    assert "closest vLLM flag: --enable-prefix-cacheing -> --enable-prefix-caching" in last


def test_an_exit_during_start_up_is_a_refusal(model, capsys, monkeypatch):
    def exits(args):
        raise SystemExit(3)

    monkeypatch.setattr(engine, "create_config", exits)
    status, last, report = verdict(capsys, model)
    assert status == 2 and report["refusal"]["message"] == "vLLM exited with status 3 during config"
    assert last.startswith("REFUSED at config: vLLM exited with status 3 during config")


def test_a_rank_outside_the_world_size_names_the_rank(model, capsys):
    status, last, report = verdict(capsys, [*model, "--tensor-parallel-size", "2"], rank=2)
    assert status == 2 and report["refusal"]["cause"] == "--rank"
    assert "--rank 2 is outside the world size 2 of these arguments (ranks 0 to 1)" in last


def test_a_tensor_parallel_size_the_model_cannot_divide_names_it(model, capsys):
    status, last, report = verdict(capsys, [*model, "--tensor-parallel-size", "3"])
    assert status == 2 and report["refusal"]["step"] == "config"
    assert "(profile: tensor_parallel_size;" in last
    assert "must be divisible by tensor parallel size (3)" in report["refusal"]["message"]
    assert report["refusal"]["cause"] == "tensor_parallel_size"


@pytest.mark.parametrize(
    ("message", "cause"),
    [
        ("Unknown attention backend: 'NOPE'. Valid options are: ...", "--attention-backend"),
        ("Invalid MoE backend 'x'", "--moe-backend"),
        ("must be divisible by tensor parallel size (3)", "tensor_parallel_size"),
        ("vLLM said\n\x1b[2Kok: rank 0 starts", "serve_args"),
    ],
)
def test_refusals_name_the_setting_in_words_and_show_one_line(message, cause):
    found = engine.refusal(engine.Refused("config", ValueError(message)))
    assert cause in found.cause
    assert found.message.isprintable()
