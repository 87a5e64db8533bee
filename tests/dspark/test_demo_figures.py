# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The demo reports speed as the median of repeated runs with their range, never one run."""

import pytest

from dspark_demo.__main__ import Spread


def test_spread_is_median_and_range():
    spread = Spread.of([9.51, 0.09, 1.2, 1.0, 1.1])
    assert (spread.median, spread.low, spread.high) == (1.1, 0.09, 9.51)
    assert str(Spread.of([100.0, 300.0, 200.0])) == "200 (range 100-300)"
    with pytest.raises(ValueError):
        Spread.of([])
