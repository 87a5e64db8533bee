# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Upstream's speculative-config fields on the V1 DSpark path, honoured: each test fails when the
proposer ignores its field. The fields refused at start-up are tested on vLLM's own config
(tests/dspark/test_options.py, tests/dspark/test_startup_checks.py)."""

from pathlib import Path
from typing import Any

import pytest
import torch

from dspark_fixtures.engine import TinyEngine, dspark_config, read_draft_log, run_engine

PROMPTS = ["w12 w7 w300 w41 w5", "w900 w901 w902 w903", "w1 w2 w3", "w500 w42 w7 w8 w9 w10"]
MAX_TOKENS = 24


def run_recording_rejection(
    target: Path, speculative_config: dict[str, Any], temperature: float
) -> tuple[list[list[int]], list[dict[str, torch.Tensor | None]]]:
    """Generate, recording what vLLM's rejection sampler receives at every verify step."""
    calls: list[dict[str, torch.Tensor | None]] = []
    with TinyEngine(target, speculative_config) as engine:
        sampler = engine.model_runner.rejection_sampler
        forward = sampler.forward

        def recording_forward(metadata, draft_probs, logits, sampling_metadata):
            calls.append(
                {
                    "draft_token_ids": metadata.draft_token_ids.clone(),
                    "draft_probs": None if draft_probs is None else draft_probs.clone(),
                }
            )
            return forward(metadata, draft_probs, logits, sampling_metadata)

        sampler.forward = recording_forward
        return engine.generate(PROMPTS, MAX_TOKENS, temperature).token_ids, calls


@pytest.fixture(scope="module")
def plain(tiny):
    """The bigram target's greedy output without speculative decoding."""
    return run_engine(tiny.bigram_target, PROMPTS, MAX_TOKENS)


# --- draft_sample_method --------------------------------------------------------------------------


def test_probabilistic_drafts_stay_token_exact_for_greedy_requests(tiny, plain):
    run = run_engine(
        tiny.bigram_target,
        PROMPTS,
        MAX_TOKENS,
        dspark_config(tiny.bigram_draft, draft_sample_method="probabilistic"),
    )
    assert run.token_ids == plain.token_ids
    accepted = run.accepted_per_position
    assert accepted[0] > 0 and accepted[-1] < run.metrics["vllm:spec_decode_num_drafts"]


def test_probabilistic_drafts_are_sampled_and_their_probabilities_reach_rejection_sampling(tiny):
    _, calls = run_recording_rejection(
        tiny.bigram_target,
        dspark_config(tiny.bigram_draft, draft_sample_method="probabilistic"),
        temperature=1.0,
    )
    # Steps whose requests all verify no drafts (e.g. right after the prefills) pass none.
    calls = [call for call in calls if call["draft_token_ids"].numel() > 0]
    assert calls
    not_argmax = 0
    for call in calls:
        probs, drafts = call["draft_probs"], call["draft_token_ids"]
        assert probs is not None, "the rejection sampler got no draft probabilities"
        assert probs.shape[0] == drafts.shape[0]
        torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[0]))
        # Each draft was drawn from its row: it has positive probability there.
        assert (probs.gather(1, drafts.long()[:, None]) > 0).all()
        not_argmax += int((probs.argmax(-1) != drafts).sum())
    # Drawn, not the argmax: at temperature 1 some drafts are not their row's mode.
    assert not_argmax > 0


def test_greedy_method_passes_no_probabilities(tiny):
    _, calls = run_recording_rejection(
        tiny.bigram_target, dspark_config(tiny.bigram_draft), temperature=1.0
    )
    assert calls and all(call["draft_probs"] is None for call in calls)


def drafts_by_step(log: Path) -> dict[str, dict[int, list[int]]]:
    return {
        request: {anchor: record["drafts"] for anchor, record in steps.items()}
        for request, steps in read_draft_log(log).items()
    }


# --- dspark_draft_topk ----------------------------------------------------------------------------


def test_draft_topk_restricts_the_markov_chain_to_the_top_base_logits(tiny, tmp_path):
    """The bigram draft's backbone predicts the target only at the anchor's slot (the noise
    slots' base logits carry no information); its Markov head does the rest. With top-1 the
    chain can only pick each slot's base argmax, so nothing past the first draft is accepted;
    with the whole vocabulary as candidates the drafts equal the full chain's."""
    logs = {}
    runs = {}
    for name, fields in {
        "full": {},
        "top-1": {"dspark_draft_topk": 1},
        "top-vocab": {"dspark_draft_topk": 1000},
    }.items():
        logs[name] = tmp_path / f"{name}.jsonl"
        runs[name] = run_engine(
            tiny.bigram_target,
            PROMPTS,
            MAX_TOKENS,
            dspark_config(tiny.bigram_draft, dspark_draft_log=str(logs[name]), **fields),
        )
    assert runs["top-1"].token_ids == runs["full"].token_ids == runs["top-vocab"].token_ids
    assert sum(runs["full"].accepted_per_position[1:]) > 0
    assert runs["top-1"].accepted_per_position[1:] == [0, 0, 0]
    assert drafts_by_step(logs["top-vocab"]) == drafts_by_step(logs["full"])


def test_draft_config_fields_reach_the_paged_qwen3_draft(tiny, plain):
    """Full-attention drafts run through vLLM's own draft config, as DFlash does: a field that
    config carries (here the attention backend) starts the engine and stays lossless. The ring
    proposer (DeepSeek-V4) refuses it (tests/dspark/test_options.py)."""
    run = run_engine(
        tiny.bigram_target,
        PROMPTS,
        MAX_TOKENS,
        dspark_config(tiny.bigram_draft, attention_backend="CPU_ATTN"),
    )
    assert run.token_ids == plain.token_ids
    assert run.drafts > 0
