"""Confidence schedulers: configuration, the four rules, exhaustive search, determinism."""

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.v1.spec_decode.dspark.scheduling import (
    ConfidenceScheduleConfig,
    StepRateCurve,
    hardware_lengths,
    schedule_lengths,
    survival,
    survival_threshold_lengths,
    threshold_lengths,
)

# Dyadic confidences and integer rates keep every product, sum and E * f exact in float32 and
# float64, so the exhaustive search and the scheduler agree bit for bit, not within a tolerance.
DYADIC = [0.0, 0.25, 0.5, 0.75, 1.0]


def conf_tensor(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def expected_throughput(conf: list[list[float]], lengths: list[int], curve: StepRateCurve) -> float:
    """`E * f(batch_tokens)` straight from the definition, independently of the module."""
    expected = float(len(conf))
    for row, length in zip(conf, lengths, strict=True):
        reach = 1.0
        for c in row[:length]:
            reach *= c
            expected += reach
    return expected * curve.rate(len(conf) + sum(lengths))


def brute_force(conf: list[list[float]], curve: StepRateCurve) -> tuple[float, list[tuple]]:
    """Best throughput over every length vector, and all vectors that reach it."""
    k = len(conf[0])
    values = {
        lengths: expected_throughput(conf, list(lengths), curve)
        for lengths in itertools.product(range(k + 1), repeat=len(conf))
    }
    best = max(values.values())
    return best, [lengths for lengths, value in values.items() if value == best]


# --- configuration -------------------------------------------------------------------------------
# Types and ranges of the dspark_confidence_* fields are checked by pydantic in SpeculativeConfig
# (tests/dspark/test_options.py); here: the rules that span fields.


def from_fields(**fields) -> ConfidenceScheduleConfig:
    return ConfidenceScheduleConfig.from_fields(**fields)


def test_default_is_off_and_needs_no_confidence():
    config = from_fields()
    assert config == ConfidenceScheduleConfig()
    assert config.scheduler == "off"
    assert not config.needs_confidence


@pytest.mark.parametrize("scheduler", ["threshold", "survival_threshold"])
def test_threshold_schedulers_read_tau(scheduler):
    config = from_fields(scheduler=scheduler, threshold=0.3)
    assert config.scheduler == scheduler
    assert config.threshold == 0.3
    assert config.needs_confidence


@pytest.mark.parametrize(
    "curve",
    [
        "1:40,8:35,32:20",
        " 32:20 , 1:40,8:35 ",
        {"1": 40, "8": 35.0, "32": 20},
        {32: 20, 1: 40, 8: 35},
    ],
)
def test_hardware_options_accept_string_and_mapping_curves(curve):
    config = from_fields(scheduler="hardware", step_rate_curve=curve, early_stop=False)
    assert config.step_rate_curve == StepRateCurve(((1, 40.0), (8, 35.0), (32, 20.0)))
    assert config.early_stop is False
    assert from_fields(scheduler="hardware", step_rate_curve=curve).early_stop


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ConfidenceScheduleConfig().scheduler = "threshold"  # type: ignore[misc]


HW = {"scheduler": "hardware"}


INVALID_OPTIONS = [
    ({"scheduler": "auto"}, "dspark_confidence_scheduler = 'auto'.*'off', 'threshold'"),
    ({"threshold": 0.3}, "only applies with dspark_confidence_scheduler='threshold' or"),
    ({"scheduler": "threshold"}, "'threshold' needs dspark_confidence_threshold"),
    ({"scheduler": "survival_threshold"}, "needs dspark_confidence_threshold"),
    (
        {"scheduler": "threshold", "threshold": 1.5},
        r"dspark_confidence_threshold = 1.5 is invalid: expected a number in \[0, 1\]",
    ),
    (HW, "'hardware' needs dspark_step_rate_curve, e.g. '1:40"),
    ({"step_rate_curve": "1:40"}, "only applies with dspark_confidence_scheduler='hardware'"),
    ({**HW, "step_rate_curve": "1:40,1:30"}, "= '1:40,1:30' is invalid.*each token count once"),
    ({**HW, "step_rate_curve": "1:0"}, "= '1:0' is invalid.*rates > 0"),
    ({**HW, "step_rate_curve": "1:nan"}, "= '1:nan' is invalid.*finite rates"),
    ({**HW, "step_rate_curve": "0:40"}, "= '0:40' is invalid.*token counts >= 1"),
    ({**HW, "step_rate_curve": "-1:40"}, "= '-1:40' is invalid"),
    ({**HW, "step_rate_curve": "1:40;8:35"}, "= '1:40;8:35' is invalid"),
    ({**HW, "step_rate_curve": ""}, "= '' is invalid"),
    ({**HW, "step_rate_curve": {}}, "= {} is invalid.*at least one"),
    ({**HW, "step_rate_curve": {"1.5": 40}}, r"= \{'1.5': 40\} is invalid"),
    ({**HW, "step_rate_curve": [[1, 40]]}, r"= \[\[1, 40\]\] is invalid"),
    ({"early_stop": False}, "dspark_hardware_early_stop only applies with"),
]


@pytest.mark.parametrize(
    ("options", "message"),
    INVALID_OPTIONS,
    ids=[",".join(f"{key}={value}" for key, value in o.items()) for o, _ in INVALID_OPTIONS],
)
def test_invalid_options_are_rejected_with_the_field_and_value(options, message):
    with pytest.raises(ValueError, match=message):
        from_fields(**options)


def test_step_rate_curve_lookup():
    curve = StepRateCurve.parse("1:40,8:35,32:20")
    tokens = [0, 1, 7, 8, 9, 31, 32, 1000]
    expected = [40.0, 40.0, 40.0, 35.0, 35.0, 35.0, 20.0, 20.0]
    assert [curve.rate(n) for n in tokens] == expected
    assert curve.rates(torch.tensor(tokens)).tolist() == expected
    # Below the first point the first rate applies.
    assert StepRateCurve.parse("4:10,8:5").rate(2) == 10.0


# --- survival and the threshold rule -----------------------------------------------------------


def test_survival_is_the_sequential_float32_product():
    conf = torch.rand(64, 7, generator=torch.Generator().manual_seed(0))
    expected = np.empty((64, 7), dtype=np.float32)
    for b, row in enumerate(conf.numpy()):
        reach = np.float32(1.0)
        for j, c in enumerate(row):
            reach = np.float32(reach * c)
            expected[b, j] = reach
    assert torch.equal(survival(conf), torch.from_numpy(expected))
    reference = conf.double().cumprod(dim=1)
    torch.testing.assert_close(survival(conf).double(), reference, rtol=1e-6, atol=0)


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
    assert survival_threshold_lengths(conf, 0.4).tolist() == [1, 1, 1]
    # tau = 0 verifies everything, as DeepSpec's "threshold <= 0: full block".
    assert threshold_lengths(conf, 0.0).tolist() == [4, 4, 4]


def reference_survival_threshold(row: list[float], tau: float) -> int:
    """Largest n with S_j >= tau for all j < n (float32 arithmetic, as the module)."""
    reach, n = np.float32(1.0), 0
    for c in row:
        reach = np.float32(reach * np.float32(c))
        if reach < np.float32(tau):
            break
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(conf=CONFIDENCE_ROWS, tau=st.floats(0.0, 1.0))
def test_survival_threshold_matches_the_definition(conf, tau):
    lengths = survival_threshold_lengths(conf_tensor(conf), tau)
    assert lengths.dtype == torch.int32
    assert lengths.tolist() == [reference_survival_threshold(row, tau) for row in conf]


def test_survival_threshold_edges():
    conf = conf_tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.5, 0.5, 1.0], [1.0, 0.999, 1.0]])
    # tau = 0: every survival is >= 0, so every request verifies all k drafts, zeros included.
    assert survival_threshold_lengths(conf, 0.0).tolist() == [3, 3, 3, 3]
    # tau = 1: only positions reached with certainty.
    assert survival_threshold_lengths(conf, 1.0).tolist() == [3, 0, 0, 1]
    # A survival equal to tau is kept; the first one below stops the request.
    assert survival_threshold_lengths(conf, 0.25).tolist() == [3, 0, 3, 3]
    assert survival_threshold_lengths(conf, 0.5).tolist() == [3, 0, 1, 3]
    # Zero confidence at position 0 verifies nothing for any tau > 0.
    assert survival_threshold_lengths(conf_tensor([[0.0, 1.0]]), 1e-9).tolist() == [0]


def test_survival_threshold_never_resumes_after_a_low_position():
    # Non-anticipating: a confident position after a rejected one is not verified.
    assert survival_threshold_lengths(conf_tensor([[0.9, 0.2, 1.0, 1.0]]), 0.5).tolist() == [1]


# --- the hardware rule -------------------------------------------------------------------------


@pytest.mark.parametrize("early_stop", [True, False])
def test_hardware_with_a_constant_curve_verifies_every_reachable_draft(early_stop):
    curve = StepRateCurve.parse("1:30")
    conf = conf_tensor([[0.9, 0.1, 0.05], [1.0, 1.0, 1.0], [0.3, 0.0, 1.0], [0.0, 0.5, 0.5]])
    # Every slot with positive survival raises E at the same rate; zero survival never helps.
    assert hardware_lengths(conf, curve, early_stop).tolist() == [3, 3, 1, 0]


def test_hardware_stops_where_a_slower_step_costs_more_than_it_gains():
    conf = conf_tensor([[0.9, 0.8, 0.5, 0.2], [1.0, 1.0, 1.0, 1.0], [0.1, 1.0, 1.0, 1.0]])
    curve = StepRateCurve.parse("1:40,8:35,32:20")
    # Admitting the four certain slots reaches 7 tokens at 40 steps/s (E = 7, 280/s); the next
    # slot (0.9) would cost the drop to 35 steps/s: 7.9 * 35 = 276.5 < 280.
    assert hardware_lengths(conf, curve, early_stop=True).tolist() == [0, 4, 0]
    # Without the early stop the scan finds that all 12 drafts (E = 9.452 at 35/s) pay.
    assert hardware_lengths(conf, curve, early_stop=False).tolist() == [4, 4, 4]


def test_hardware_empty_batch():
    curve = StepRateCurve.parse("1:30")
    assert hardware_lengths(torch.empty(0, 4), curve).tolist() == []


DYADIC_CONF = st.integers(1, 3).flatmap(
    lambda k: st.lists(
        st.lists(st.sampled_from(DYADIC), min_size=k, max_size=k), min_size=1, max_size=3
    )
)


@st.composite
def non_increasing_curves(draw) -> StepRateCurve:
    tokens = sorted(draw(st.sets(st.integers(1, 13), min_size=1, max_size=5)))
    rates = sorted(draw(st.lists(st.integers(1, 64), min_size=len(tokens), max_size=len(tokens))))
    return StepRateCurve(tuple(zip(tokens, map(float, reversed(rates)), strict=True)))


@settings(max_examples=400, deadline=None)
@given(conf=DYADIC_CONF, curve=non_increasing_curves())
def test_full_scan_equals_brute_force_for_non_increasing_curves(conf, curve):
    best, optima = brute_force(conf, curve)
    lengths = hardware_lengths(conf_tensor(conf), curve, early_stop=False).tolist()
    assert expected_throughput(conf, lengths, curve) == best
    assert tuple(lengths) in optima
    # Among equally good schedules the scan keeps the one with the fewest tokens.
    assert sum(lengths) == min(map(sum, optima))
    early = hardware_lengths(conf_tensor(conf), curve, early_stop=True).tolist()
    assert expected_throughput(conf, early, curve) <= best


@settings(max_examples=200, deadline=None)
@given(conf=DYADIC_CONF, rate=st.integers(1, 64))
def test_early_stop_equals_brute_force_for_a_constant_curve(conf, rate):
    curve = StepRateCurve(((1, float(rate)),))
    best, optima = brute_force(conf, curve)
    lengths = hardware_lengths(conf_tensor(conf), curve, early_stop=True).tolist()
    assert tuple(lengths) in optima
    assert expected_throughput(conf, lengths, curve) == best


# Where greedy admission is not optimal. Each id carries the throughput lost against exhaustive
# search; the test asserts the exact schedules and the gap, so a change in behaviour shows here.
@pytest.mark.parametrize(
    ("conf", "curve", "early_stop", "greedy", "optimum", "gap"),
    [
        pytest.param(
            [[1.0, 1.0, 1.0]], "1:10,2:4", True, [0], (3,), 0.375,
            id="early-stop-at-a-rate-step-1req-gap-37.5pct",
        ),
        pytest.param(
            [[0.75, 0.75, 0.75], [0.5, 0.5, 0.5]], "2:40,4:32,6:28", True, [1, 0], (3, 3),
            1 - 110 / 129.0625,
            id="early-stop-at-a-graph-bucket-2req-gap-14.8pct",
        ),
        pytest.param(
            [[1.0, 0.0, 0.0]], "1:1,4:100", False, [1], (3,), 0.99,
            id="rising-curve-pays-for-zero-survival-drafts-gap-99pct",
        ),
    ],
)  # fmt: skip
def test_documented_cases_where_greedy_is_not_optimal(
    conf, curve, early_stop, greedy, optimum, gap
):
    step_rate_curve = StepRateCurve.parse(curve)
    lengths = hardware_lengths(conf_tensor(conf), step_rate_curve, early_stop).tolist()
    best, optima = brute_force(conf, step_rate_curve)
    achieved = expected_throughput(conf, lengths, step_rate_curve)
    assert (lengths, optima) == (greedy, [optimum])
    assert 1 - achieved / best == pytest.approx(gap), (
        f"greedy {lengths} reaches {achieved}/s, exhaustive search {optimum} reaches {best}/s"
    )


# --- determinism -------------------------------------------------------------------------------


def test_ties_go_to_the_lower_request_then_the_lower_position():
    # One draft slot pays (2.5 * 10 > 2 * 10, but 3 * 8 < 2.5 * 10); both rows offer 0.5.
    curve = StepRateCurve.parse("2:10,4:8")
    assert hardware_lengths(conf_tensor([[0.5], [0.5]]), curve).tolist() == [1, 0]
    # Slots (0, 1) and (1, 0) tie at 0.5 and only one of them pays: (b, j) order admits (0, 1),
    # where (j, b) order would admit (1, 0).
    curve = StepRateCurve.parse("2:40,5:30")
    conf = conf_tensor([[1.0, 0.5], [0.5, 0.5]])
    assert hardware_lengths(conf, curve).tolist() == [2, 0]


@pytest.mark.parametrize("scheduler", ["threshold", "survival_threshold", "hardware"])
def test_same_inputs_give_bitwise_same_lengths_for_any_thread_count(scheduler):
    options: dict = {"scheduler": scheduler}
    if scheduler == "hardware":
        options["step_rate_curve"] = "1:900,4096:600,16384:400,32768:200"
    else:
        options["threshold"] = 0.3 if scheduler == "survival_threshold" else 0.5
    config = from_fields(**options)
    conf = torch.rand(4096, 8, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        results = []
        for num_threads in (1, 2, 4):
            torch.set_num_threads(num_threads)
            results.append((survival(conf), schedule_lengths(conf, config, 8)))
    finally:
        torch.set_num_threads(threads)
    for surv, lengths in results[1:]:
        assert torch.equal(surv, results[0][0])
        assert torch.equal(lengths, results[0][1])
    # The case is not degenerate: the lengths vary across requests.
    assert len(set(results[0][1].tolist())) > 2


@pytest.mark.parametrize("scheduler", ["threshold", "survival_threshold", "hardware"])
def test_lengths_follow_their_request_when_the_batch_is_reordered(scheduler):
    options: dict = {"scheduler": scheduler}
    if scheduler == "hardware":
        options["step_rate_curve"] = "1:100,100:90,200:80"
    else:
        options["threshold"] = 0.4 if scheduler == "survival_threshold" else 0.7
    config = from_fields(**options)
    generator = torch.Generator().manual_seed(2)
    conf = 0.5 + 0.5 * torch.rand(48, 5, generator=generator)
    # No two survivals tie, so the tie rule cannot decide anything here.
    assert survival(conf).unique().numel() == conf.numel()
    lengths = schedule_lengths(conf, config, 5)
    perm = torch.randperm(48, generator=generator)
    assert torch.equal(schedule_lengths(conf[perm], config, 5), lengths[perm])
    assert len(set(lengths.tolist())) > 2


# --- the proposer's entry point ----------------------------------------------------------------


def test_off_returns_full_length_without_confidences():
    lengths = schedule_lengths(None, ConfidenceScheduleConfig(), 5, num_reqs=3)
    assert lengths.dtype == torch.int32
    assert lengths.tolist() == [5, 5, 5]
    # Confidences, if the proposer has them anyway, change nothing.
    conf = torch.zeros(2, 5)
    assert schedule_lengths(conf, ConfidenceScheduleConfig(), 5).tolist() == [5, 5]
    with pytest.raises(ValueError, match="needs num_reqs"):
        schedule_lengths(None, ConfidenceScheduleConfig(), 5)


def test_schedule_lengths_dispatches_and_checks_its_inputs():
    conf = conf_tensor([[0.9, 0.8, 0.5], [0.2, 1.0, 1.0]])
    threshold = ConfidenceScheduleConfig(scheduler="threshold", threshold=0.5)
    assert schedule_lengths(conf, threshold, 3).tolist() == [3, 0]
    product = ConfidenceScheduleConfig(scheduler="survival_threshold", threshold=0.5)
    assert schedule_lengths(conf, product, 3).tolist() == [2, 0]
    curve = StepRateCurve.parse("1:40,4:30")
    hardware = ConfidenceScheduleConfig(scheduler="hardware", step_rate_curve=curve)
    assert schedule_lengths(conf, hardware, 3).tolist() == hardware_lengths(conf, curve).tolist()
    with pytest.raises(ValueError, match="'threshold' needs confidences"):
        schedule_lengths(None, threshold, 3, num_reqs=2)
    with pytest.raises(ValueError, match="2 positions, expected k = 3"):
        schedule_lengths(conf[:, :2], threshold, 3)
    with pytest.raises(ValueError, match="float tensor"):
        schedule_lengths(torch.ones(2, 3, dtype=torch.int64), threshold, 3)
