# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Confidence scheduling: configuration, DeepSpec's threshold rule, determinism."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.v1.spec_decode.dspark.scheduling import (
    ConfidenceScheduleConfig,
    schedule_lengths,
    threshold_lengths,
)


def conf_tensor(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# --- configuration -------------------------------------------------------------------------------
# Types and ranges of the dspark_confidence_* fields are checked by pydantic in SpeculativeConfig
# (tests/dspark/test_options.py); here: the rules that span fields.


def test_default_is_off_and_needs_no_confidence():
    config = ConfidenceScheduleConfig()
    assert config.scheduler == "off"
    assert not config.needs_confidence


def test_threshold_reads_tau():
    config = ConfidenceScheduleConfig(scheduler="threshold", threshold=0.3)
    assert config.threshold == 0.3
    assert config.needs_confidence


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ConfidenceScheduleConfig().scheduler = "threshold"  # type: ignore[misc]


INVALID_OPTIONS = [
    (
        {"scheduler": "hardware"},
        r"^dspark_confidence_scheduler='hardware' is not supported: expected one of "
        r"\('off', 'threshold'\)\.$",
    ),
    ({"threshold": 0.3}, "only applies with dspark_confidence_scheduler='threshold', but"),
    ({"scheduler": "threshold"}, "'threshold' needs dspark_confidence_threshold"),
    (
        {"scheduler": "threshold", "threshold": 1.5},
        r"dspark_confidence_threshold=1.5 is not a number in \[0, 1\]",
    ),
]


@pytest.mark.parametrize(
    ("options", "message"),
    INVALID_OPTIONS,
    ids=[",".join(f"{key}={value}" for key, value in o.items()) for o, _ in INVALID_OPTIONS],
)
def test_invalid_options_are_rejected_with_the_field_and_value(options, message):
    with pytest.raises(ValueError, match=message):
        ConfidenceScheduleConfig(**options)


# --- the threshold rule --------------------------------------------------------------------------


# 1-5 requests, each with the same number (1-6) of float32 confidences.
CONFIDENCE_ROWS = st.integers(1, 6).flatmap(
    lambda k: st.lists(
        st.lists(st.floats(0.0, 1.0, width=32), min_size=k, max_size=k), min_size=1, max_size=5
    )
)


def reference_deepspec_threshold(row: list[float], tau: float) -> int:
    """DeepSpec's `_confident_prefix_length`: the index of the first confidence below tau."""
    below = [np.float32(c) < np.float32(tau) for c in row]
    return below.index(True) if any(below) else len(row)


@settings(max_examples=200, deadline=None)
@given(conf=CONFIDENCE_ROWS, tau=st.floats(0.0, 1.0))
def test_threshold_is_deepspecs_rule(conf, tau):
    lengths = threshold_lengths(conf_tensor(conf), tau)
    assert lengths.dtype == torch.int32
    assert lengths.tolist() == [reference_deepspec_threshold(row, tau) for row in conf]


def test_threshold_compares_each_confidence_not_the_product():
    # Every confidence is 0.6 >= 0.4: DeepSpec verifies all four; the running product
    # (0.6, 0.36, ...) falls below 0.4 at the second position.
    conf = conf_tensor([[0.6, 0.6, 0.6, 0.6], [0.9, 0.3, 1.0, 1.0], [0.4, 0.4, 0.39, 1.0]])
    assert threshold_lengths(conf, 0.4).tolist() == [4, 1, 2]
    # tau = 0 verifies everything, as DeepSpec's "threshold <= 0: full block".
    assert threshold_lengths(conf, 0.0).tolist() == [4, 4, 4]
    # A confidence equal to tau is kept; tau = 1 keeps only certain positions.
    assert threshold_lengths(conf, 0.6).tolist() == [4, 1, 0]
    assert threshold_lengths(conf_tensor([[1.0, 1.0, 0.999, 1.0]]), 1.0).tolist() == [2]


# --- determinism -------------------------------------------------------------------------------

THRESHOLD = ConfidenceScheduleConfig(scheduler="threshold", threshold=0.5)


def test_same_inputs_give_bitwise_same_lengths_for_any_thread_count():
    conf = 0.3 + 0.7 * torch.rand(4096, 8, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        results = []
        for num_threads in (1, 2, 4):
            torch.set_num_threads(num_threads)
            results.append(schedule_lengths(conf, THRESHOLD, 8))
    finally:
        torch.set_num_threads(threads)
    for lengths in results[1:]:
        assert torch.equal(lengths, results[0])
    # The case is not degenerate: the lengths vary across requests.
    assert len(set(results[0].tolist())) > 2


def test_lengths_follow_their_request_when_the_batch_is_reordered():
    generator = torch.Generator().manual_seed(2)
    conf = 0.3 + 0.7 * torch.rand(48, 5, generator=generator)
    lengths = schedule_lengths(conf, THRESHOLD, 5)
    perm = torch.randperm(48, generator=generator)
    assert torch.equal(schedule_lengths(conf[perm], THRESHOLD, 5), lengths[perm])
    assert len(set(lengths.tolist())) > 2


# --- the proposers' entry point ------------------------------------------------------------------


def test_schedule_lengths_dispatches_and_checks_its_inputs():
    conf = conf_tensor([[0.9, 0.8, 0.5], [0.2, 1.0, 1.0]])
    assert schedule_lengths(conf, THRESHOLD, 3).tolist() == [3, 0]
    off = schedule_lengths(conf, ConfidenceScheduleConfig(), 3)
    assert off.dtype == torch.int32 and off.tolist() == [3, 3]
    with pytest.raises(ValueError, match=r"\[num_reqs, k = 3\], got torch.float32 \[2, 2\]"):
        schedule_lengths(conf[:, :2], THRESHOLD, 3)
    with pytest.raises(ValueError, match="float tensor"):
        schedule_lengths(torch.ones(2, 3, dtype=torch.int64), THRESHOLD, 3)
