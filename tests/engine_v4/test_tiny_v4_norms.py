# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The tiny V4 checkpoints look trained: every norm weight is non-unit and differs from every
other norm of its shape, and the draft has several stages (V4-Flash ships 3).

Unit or shared norms let a norm applied with the wrong layer's weight (or not at all) pass every
test; the engine tests run on these checkpoints."""

import itertools

import pytest
import torch

from dspark_fixtures.checkpoints import deepseek_v4 as tiny_v4

CHECKPOINTS = {
    "random": tiny_v4.random_v4_checkpoint,
    "oracle": tiny_v4.oracle_v4_checkpoint,
    "noisy": lambda: tiny_v4.oracle_v4_checkpoint(target_noise=0.3),
}


def norm_problems(checkpoint: dict[str, torch.Tensor]) -> list[str]:
    """Names of unit norms and of pairs of identical norms, as saved (bf16)."""
    norms = {
        name: tensor.to(torch.bfloat16)
        for name, tensor in checkpoint.items()
        if name.endswith("norm.weight")
    }
    problems = [f"{name} is all ones" for name, w in norms.items() if torch.all(w == 1)]
    for (a, wa), (b, wb) in itertools.combinations(norms.items(), 2):
        if wa.shape == wb.shape and torch.equal(wa, wb):
            problems.append(f"{a} equals {b}")
    return problems


@pytest.mark.parametrize("kind", CHECKPOINTS)
def test_every_norm_is_non_unit_and_its_own(kind):
    checkpoint = CHECKPOINTS[kind]()
    assert norm_problems(checkpoint) == []
    stages = {name.split(".")[1] for name in checkpoint if name.startswith("mtp.")}
    assert len(stages) == len(tiny_v4.TINY_V4_CONFIG["dspark_target_layer_ids"]) >= 2
    for stage in stages:
        assert f"mtp.{stage}.attn_norm.weight" in checkpoint


def test_the_check_names_unit_and_shared_norms():
    checkpoint = tiny_v4.random_v4_checkpoint()
    checkpoint["mtp.1.ffn_norm.weight"] = torch.ones_like(checkpoint["mtp.1.ffn_norm.weight"])
    checkpoint["mtp.0.attn.q_norm.weight"] = checkpoint["mtp.1.attn.q_norm.weight"]
    assert norm_problems(checkpoint) == [
        "mtp.1.ffn_norm.weight is all ones",
        "mtp.0.attn.q_norm.weight equals mtp.1.attn.q_norm.weight",
    ]
