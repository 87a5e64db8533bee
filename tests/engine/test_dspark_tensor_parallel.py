# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Tensor parallelism (TP = 2, two CPU worker processes) on the paged Qwen3 DSpark path.

Every rank runs the draft and the confidence scheduler; only rank 0's drafts and lengths reach
the scheduler, so a rank that computed other lengths would silently work from other drafts. Every
rank writes ``dspark_draft_log`` (records carry the rank and the scheduled length ``verify``),
so the test compares, request by request and step by step, rank 0 with rank 1 and TP = 2 with
TP = 1. The draft's confidence head is random, so the lengths vary with the context.
"""

import pytest

from dspark_fixtures.checkpoints import qwen3
from dspark_fixtures.engine import draft_steps, dspark_config, run_engine

pytestmark = pytest.mark.multiproc

K = 4
PROMPTS = ["w12 w7 w300 w41 w5", "w900 w901 w902 w903", "w1 w2 w3", "w500 w42 w7 w8 w9 w10"]
MAX_TOKENS = [40, 33, 47, 28]
CONFIDENCE = {"dspark_confidence_scheduler": "threshold", "dspark_confidence_threshold": 0.5}


@pytest.fixture(scope="module")
def scored_draft(tiny, tmp_path_factory):
    """The bigram draft plus a random confidence head (inputs: hidden state and Markov embed)."""
    spec = qwen3.DSparkDraftSpec(
        markov_rank=qwen3.HIDDEN_SIZE, confidence_head=True, confidence_with_markov=True
    )
    weights = qwen3.bigram_dspark_weights(spec, tiny.bigram_target)
    weights["confidence_head.proj.weight"].mul_(40.0)
    return qwen3.save_dspark_draft(
        tmp_path_factory.mktemp("scored") / "draft", spec, weights, tiny.bigram_target
    )


def test_ranks_draft_and_schedule_alike_and_match_tp1(tiny, scored_draft, tmp_path):
    plain = run_engine(tiny.bigram_target, PROMPTS, MAX_TOKENS, max_num_seqs=4)
    runs, logs = {}, {}
    for tp in (1, 2):
        log = tmp_path / f"tp{tp}.jsonl"
        config = dspark_config(scored_draft, K, dspark_draft_log=str(log), **CONFIDENCE)
        runs[tp] = run_engine(
            tiny.bigram_target,
            PROMPTS,
            MAX_TOKENS,
            config,
            max_num_seqs=4,
            tensor_parallel_size=tp,
        )
        logs[tp] = log

    assert runs[1].token_ids == plain.token_ids
    assert runs[2].token_ids == plain.token_ids
    rank0 = draft_steps(logs[2], rank=0)
    assert draft_steps(logs[2], rank=1) == rank0
    assert draft_steps(logs[1]) == rank0
    lengths = [r["verify"] for records in rank0.values() for r in records.values()]
    assert len(lengths) >= 40
    assert len(set(lengths)) >= 3, f"the confidence head should vary the lengths: {set(lengths)}"
    # The lengths the scheduler verified are rank 0's.
    assert runs[2].metrics["vllm:spec_decode_num_draft_tokens"] <= sum(lengths)
    assert (
        runs[2].metrics["vllm:spec_decode_num_draft_tokens"]
        == (runs[1].metrics["vllm:spec_decode_num_draft_tokens"])
    )
