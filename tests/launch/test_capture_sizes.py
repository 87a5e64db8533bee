# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Every shipped profile's target captures its widest speculative decode batch,
``max_num_seqs * (k + 1)`` tokens, in every cudagraph mode: the rendered ``vllm serve``
arguments read by vLLM's own parser, sized by vLLM's own functions
(``dspark_fixtures/cuda_graphs.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark_launch.profile import PROFILES_DIR, load_profile

pytest.importorskip("vllm")

from dspark_fixtures.checkpoints import deepseek_v4 as tiny_v4
from dspark_fixtures.cuda_graphs import profile_sizing_args, rendered_serve_args, size_as_on_cuda
from tools.dry_start.capture_plan import capture_plan, resolved_as_by_the_runner
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backend import AttentionCGSupport

MODES = (
    CUDAGraphMode.FULL_AND_PIECEWISE,
    CUDAGraphMode.FULL,
    CUDAGraphMode.FULL_DECODE_ONLY,
    CUDAGraphMode.PIECEWISE,
)


@pytest.fixture(scope="module")
def tiny_v4_dir(tmp_path_factory) -> Path:
    """A tiny DeepSeek-V4 target whose DSpark head takes any k a profile asks for."""
    config = {**tiny_v4.TINY_V4_CONFIG, "dspark_block_size": 16}
    root = tmp_path_factory.mktemp("tiny-v4")
    return tiny_v4.save_v4_target(root, tiny_v4.random_v4_checkpoint(config), config)


def widest_batch_in_every_pass(args: tuple[str, ...], model: Path) -> dict[str, bool]:
    """Per cudagraph mode: whether every capture pass of the target captures the widest
    decode batch, and the draft plan covers ``max_num_seqs``."""
    sizing = profile_sizing_args(args, model)
    k = sizing.num_speculative_tokens
    widest = sizing.max_num_seqs * (k + 1)
    covered = {}
    for mode in MODES:
        vllm_config = sizing.tiny_v4_config(model)
        size_as_on_cuda(vllm_config, mode, sizing.max_capture_size, sizing.capture_sizes)
        plan = capture_plan(resolved_as_by_the_runner(vllm_config, AttentionCGSupport.ALWAYS))
        covered[mode.name] = bool(plan.target) and all(widest in sizes for _, sizes in plan.target)
        if k:
            covered[mode.name] &= plan.draft_requests[-1] == sizing.max_num_seqs
    return covered


@pytest.mark.parametrize("profile_path", sorted(PROFILES_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_profile_captures_its_widest_decode_batch(profile_path, tiny_v4_dir, tmp_path):
    args = rendered_serve_args(profile_path.stem, tmp_path)
    if not load_profile(profile_path).cuda_graphs:
        assert "--enforce-eager" in args
        return
    assert "--max-cudagraph-capture-size" not in args
    covered = widest_batch_in_every_pass(args, tiny_v4_dir)
    assert covered == {mode.name: True for mode in MODES}


def test_a_capture_size_of_max_num_seqs_times_k_plus_1_loses_it(tiny_v4_dir, tmp_path):
    """Control: what the launcher passed before, `--max-cudagraph-capture-size 36` for 6
    requests of k = 5: vLLM cuts 36 to 32 on its grid, and the modes that round the sizes to
    multiples of 6 keep [6, 12, 18, 24]."""
    args = rendered_serve_args("deepseek-v4-flash-2x-spark", tmp_path)
    old_flag = ("--max-cudagraph-capture-size", "36")
    covered = widest_batch_in_every_pass((*args, *old_flag), tiny_v4_dir)
    assert covered["FULL_AND_PIECEWISE"] is False
    assert covered["FULL_DECODE_ONLY"] is False
