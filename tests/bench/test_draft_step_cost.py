# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The draft-step cost model's launch mapping and shapes, without an engine."""

import contextlib

import pytest
import torch

from benchmarks import draft_step_cost as cost
from benchmarks.draft_step_model import GEOMETRIES, markov_w2_bytes, step_cost


def launches_of(module: torch.nn.Module, *inputs: torch.Tensor) -> tuple[int, int]:
    """(launches, ops) of one call, its IR ops run as the eager engine runs them (vLLM's
    native implementation, no torch op around it)."""
    from vllm import ir

    counter = cost.StepCounter(set(), set(), set())
    with ir.enable_torch_wrap(False), counter, cost.custom_ops_as_one_launch(counter, module):
        module(*inputs)
    return counter.cost.total("launches"), counter.cost.total("ops")


def test_an_rms_norm_is_one_launch_however_many_ops_it_dispatches():
    """vLLM's RMSNorm (plain and with its fused residual add) runs several aten ops on this CPU
    and is one launch; a plain linear layer outside any custom op stays one op, one launch.
    Control: without the mapping, the RMSNorm counts one launch per op."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    config = VllmConfig()
    config.kernel_config.ir_op_priority.set_default()
    with set_current_vllm_config(config):
        norm = RMSNorm(64)
    x = torch.randn(3, 64)
    launches, ops = launches_of(norm, x)
    assert (launches, ops > 1) == (1, True)
    assert launches_of(norm, x, torch.randn(3, 64))[0] == 1
    assert launches_of(torch.nn.Linear(64, 8), x) == (1, 1)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(cost, "custom_ops_as_one_launch", lambda *_: contextlib.nullcontext())
        assert launches_of(norm, x) == (ops, ops)


def test_w2_is_read_once_per_position_at_real_size():
    """Qwen3-8B's Markov head: W2 is 256 x 151936 bf16, about 78 MB, read at each of k
    positions; pruning to 64 candidates reads only their columns."""
    qwen3 = GEOMETRIES["paged"]
    assert round(markov_w2_bytes(qwen3, 1) / 1e6) == 78
    full, base = (step_cost(qwen3, 7, 1, d, False, False, 2048) for d in (True, False))
    pruned = step_cost(qwen3, 7, 1, True, False, False, 2048, topk=64)
    assert full.weight_bytes - base.weight_bytes > markov_w2_bytes(qwen3, 7)
    assert pruned.weight_bytes < base.weight_bytes + markov_w2_bytes(qwen3, 1) / 100


def test_w2_is_read_once_per_tile_of_requests():
    """The fused kernels take up to 32 requests a program: W2 is read once per position up to
    batch 32, twice from batch 33, beside one W1 row per request and position."""
    qwen3 = GEOMETRIES["paged"]
    w2 = markov_w2_bytes(qwen3, 4)

    def markov_bytes(batch: int) -> float:
        full, base = (step_cost(qwen3, 4, batch, d, False, False, 2048) for d in (True, False))
        return full.weight_bytes - base.weight_bytes

    for batch, reads in ((1, 1), (32, 1), (33, 2), (64, 2), (65, 3)):
        w1_rows = 4 * batch * qwen3.markov_rank * 2
        assert markov_bytes(batch) == pytest.approx(reads * w2 + w1_rows, rel=1e-3), batch
