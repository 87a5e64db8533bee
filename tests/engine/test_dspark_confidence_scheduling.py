"""Confidence-scheduled verification with the real DSpark proposer and engine.

The draft's confidence head gets a zero weight and bias b, so every position's
confidence is sigmoid(b) and the survival of position j is sigmoid(b)^(j+1):
the lengths each scheduler must pick are known in advance, and vLLM's own
spec-decode counters show whether the target verified exactly that many drafts.
CPU vLLM schedules synchronously, so the lengths apply to the same step.
"""

import math

import pytest
import torch

from dspark_demo import tiny_models
from dspark_demo.engine import dspark_config, run_engine

pytestmark = pytest.mark.engine

K = 4
CONFIDENCE = 0.5  # sigmoid(0): survivals 0.5, 0.25, 0.125, 0.0625


@pytest.fixture(scope="module")
def confident_draft(tiny, tmp_path_factory):
    """The bigram draft plus a confidence head that always says CONFIDENCE."""
    spec = tiny_models.DSparkDraftSpec(
        markov_rank=tiny_models.HIDDEN_SIZE, confidence_head=True, confidence_with_markov=True
    )
    weights = tiny_models.bigram_dspark_weights(spec, tiny.bigram_target)
    weights["confidence_head.proj.weight"].zero_()
    weights["confidence_head.proj.bias"] = torch.tensor([math.log(CONFIDENCE / (1 - CONFIDENCE))])
    return tiny_models.save_dspark_draft(
        tmp_path_factory.mktemp("confident") / "draft", spec, weights, tiny.bigram_target
    )


PROMPTS = ["w12 w7 w300 w41 w5", "w900 w901 w902 w903", "w1 w2 w3", "w500 w42 w7 w8 w9 w10"]
MAX_TOKENS = [40, 33, 47, 28]


@pytest.fixture(scope="module")
def plain(tiny):
    return run_engine(tiny.bigram_target, PROMPTS, MAX_TOKENS, max_num_seqs=4)


@pytest.mark.parametrize(
    ("options", "length"),
    [
        ({}, K),  # off: every draft verified
        ({"confidence_scheduler": "threshold", "confidence_threshold": 0.2}, 2),
        ({"confidence_scheduler": "threshold", "confidence_threshold": 0.5}, 1),
        ({"confidence_scheduler": "threshold", "confidence_threshold": 0.9}, 0),
        # A flat step-rate curve: every draft with positive survival pays.
        ({"confidence_scheduler": "hardware", "step_rate_curve": "1:10"}, K),
    ],
    ids=["off", "threshold-0.2", "threshold-0.5", "threshold-0.9", "hardware-flat"],
)
def test_lengths_follow_the_confidence_and_output_is_lossless(
    tiny, confident_draft, plain, options, length
):
    run = run_engine(
        tiny.bigram_target,
        PROMPTS,
        MAX_TOKENS,
        dspark_config(confident_draft, **options),
        max_num_seqs=4,
    )
    assert run.token_ids == plain.token_ids
    drafts = run.drafts
    verified = run.metrics["vllm:spec_decode_num_draft_tokens"]
    per_position = run.metrics["vllm:spec_decode_num_draft_tokens_per_pos"]
    if length == 0:
        assert verified == 0
        return
    assert drafts > 0
    assert verified == drafts * length
    assert per_position == [drafts] * length + [0] * (K - length)
    assert run.accepted_per_position[length:] == [0] * (K - length)


def test_a_falling_step_rate_curve_shortens_hardware_lengths(tiny, confident_draft, plain):
    """Extra batch tokens cost more than the expected accepted tokens they buy
    once the rate halves past 4 tokens: fewer drafts are verified than k."""
    run = run_engine(
        tiny.bigram_target,
        PROMPTS,
        MAX_TOKENS,
        dspark_config(confident_draft, confidence_scheduler="hardware", step_rate_curve="1:10,5:5"),
        max_num_seqs=4,
    )
    assert run.token_ids == plain.token_ids
    drafts = run.metrics["vllm:spec_decode_num_drafts"]
    verified = run.metrics["vllm:spec_decode_num_draft_tokens"]
    assert 0 < verified < drafts * K
