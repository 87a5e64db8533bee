# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Confidence-scheduled verification with the real DSpark proposer and engine.

Two confidence heads whose lengths are known in advance: a constant one (zero weight, bias b:
every confidence is sigmoid(b)), checked against vLLM's own spec-decode counters, and one that
reads the previous token, checked against the verify lists vLLM's scheduler sends. CPU vLLM
schedules synchronously, so the lengths apply to the same step.
"""

import json
import math

import pytest
import torch

from dspark_fixtures.checkpoints import qwen3
from dspark_fixtures.engine import TinyEngine, dspark_config, run_engine
from dspark_fixtures.host_syncs import step_reads

K = 4
CONFIDENCE = 0.5  # sigmoid(0)


@pytest.fixture(scope="module")
def confident_draft(tiny, tmp_path_factory):
    """The bigram draft plus a confidence head that always says CONFIDENCE."""
    spec = qwen3.DSparkDraftSpec(
        markov_rank=qwen3.HIDDEN_SIZE, confidence_head=True, confidence_with_markov=True
    )
    weights = qwen3.bigram_dspark_weights(spec, tiny.bigram_target)
    weights["confidence_head.proj.weight"].zero_()
    weights["confidence_head.proj.bias"] = torch.tensor([math.log(CONFIDENCE / (1 - CONFIDENCE))])
    return qwen3.save_dspark_draft(
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
        # DeepSpec's rule: every confidence is 0.5, so all drafts or none.
        ({"dspark_confidence_scheduler": "threshold", "dspark_confidence_threshold": 0.2}, K),
        ({"dspark_confidence_scheduler": "threshold", "dspark_confidence_threshold": 0.5}, K),
        ({"dspark_confidence_scheduler": "threshold", "dspark_confidence_threshold": 0.6}, 0),
    ],
    ids=["off", "threshold-0.2", "threshold-0.5", "threshold-0.6"],
)
def test_lengths_follow_the_confidence_and_output_is_lossless(
    tiny, confident_draft, plain, options, length
):
    """Also: every step that verifies drafts reads from the device only where vLLM's rejection
    sampler parses its output, as for every method: the lengths reach the host in the pinned
    copy made with the drafts. Control (with scheduling): a ``.tolist()`` of the device
    lengths planted in the runner's ``take_draft_token_ids`` is counted."""
    config = dspark_config(confident_draft, **options)
    with TinyEngine(tiny.bigram_target, config, max_num_seqs=4) as engine:
        with step_reads(engine.model_runner) as steps:
            run = engine.generate(PROMPTS, MAX_TOKENS)
        if options and length:
            planted = planted_length_reads(engine)
            assert planted and all(read.startswith("tolist at ") for read in planted)
    assert run.token_ids == plain.token_ids
    for step in steps:
        if step.decoding:
            assert {read.split(" at ")[1].split(":")[0] for read in step.reads} == {
                "rejection_sampler.py"
            }, step.reads
            assert step.syncs == [], step.syncs
    drafts = run.drafts
    verified = run.metrics["vllm:spec_decode_num_draft_tokens"]
    per_position = run.metrics["vllm:spec_decode_verified_drafts_per_pos"]
    if length == 0:
        assert verified == 0
        return
    assert drafts > 0
    assert verified == drafts * length
    assert per_position == [drafts] * length + [0] * (K - length)
    assert run.accepted_per_position[length:] == [0] * (K - length)


def planted_length_reads(engine: TinyEngine) -> list[str]:
    """The device reads recorded in steps whose ``take_draft_token_ids`` reads the device
    lengths with ``.tolist()`` (what the runner did before the pinned copy)."""
    runner = engine.model_runner
    take = runner.take_draft_token_ids

    def planted_tolist():
        runner._draft_token_lengths.tolist()
        return take()

    runner.take_draft_token_ids = planted_tolist
    try:
        with step_reads(runner) as steps:
            engine.generate(PROMPTS[:1], 6)
    finally:
        del runner.take_draft_token_ids
    return [read for step in steps for read in step.reads if "planted_tolist" in read]


@pytest.fixture(scope="module")
def token_confident_draft(tiny, tmp_path_factory):
    """The bigram draft plus a confidence head that reads only the Markov embedding of each
    position's previous token: confidence(t) = sigmoid(v . W1[t] + b), with b placed in a gap of
    the scores so that about 40% of the tokens fall below 0.5 and none lies near it. Returns the
    draft and, per token id, whether its successor position is confident at tau = 0.5."""
    spec = qwen3.DSparkDraftSpec(
        markov_rank=qwen3.HIDDEN_SIZE, confidence_head=True, confidence_with_markov=True
    )
    weights = qwen3.bigram_dspark_weights(spec, tiny.bigram_target)
    v = torch.randn(qwen3.HIDDEN_SIZE, generator=torch.Generator().manual_seed(3))
    scores = weights["markov_head.markov_w1.weight"] @ v
    ordered = scores.sort().values
    low = int(0.4 * len(ordered))
    gap = low + int((ordered[low + 1 : low + 50] - ordered[low : low + 49]).argmax())
    assert ordered[gap + 1] - ordered[gap] > 1e-3
    bias = -float(ordered[gap] + ordered[gap + 1]) / 2
    weights["confidence_head.proj.weight"] = torch.cat([torch.zeros(qwen3.HIDDEN_SIZE), v])[None]
    weights["confidence_head.proj.bias"] = torch.tensor([bias])
    draft = qwen3.save_dspark_draft(
        tmp_path_factory.mktemp("token-confident") / "draft", spec, weights, tiny.bigram_target
    )
    return draft, (scores + bias >= 0).tolist()


def test_threshold_cuts_inside_the_block_and_the_verify_batch_holds_exactly_that(
    tiny, token_confident_draft, plain, tmp_path
):
    """Every verification the scheduler sends holds the drafts before the first position whose
    confidence is below tau, as computed here from the weights (position j's confidence reads
    the token before it: the block's start token for j = 0, else draft j - 1)."""
    draft, confident = token_confident_draft
    log = tmp_path / "drafts.jsonl"
    options = {"dspark_confidence_scheduler": "threshold", "dspark_confidence_threshold": 0.5}
    with TinyEngine(
        tiny.bigram_target,
        dspark_config(draft, dspark_draft_log=str(log), **options),
        record=True,
        max_num_seqs=4,
    ) as engine:
        run = engine.generate(PROMPTS, MAX_TOKENS)
    assert run.token_ids == plain.token_ids
    proposed: dict[str, list[list[int]]] = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "start":
            continue
        previous = [record["anchor_token"], *record["drafts"][:-1]]
        length = next((j for j, token in enumerate(previous) if not confident[token]), K)
        assert record["verify"] == length, record
        proposed.setdefault(record["req_id"], []).append(record["drafts"][:length])
    lengths = [len(drafts) for lists in proposed.values() for drafts in lists]
    assert {0, K} < set(lengths), "the case is degenerate: no block is cut inside"
    for req_id, lists in proposed.items():
        verified = [specs[req_id] for _, specs in run.steps if specs.get(req_id)]
        expected = [drafts for drafts in lists if drafts]
        # Every proposal is verified in the next step but perhaps the last (its request ended).
        assert verified in (expected, expected[:-1]), req_id
    assert run.metrics["vllm:spec_decode_num_draft_tokens"] == sum(
        len(drafts) for _, specs in run.steps for drafts in specs.values()
    )
