# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The paged (full-attention) proposer end to end in the real CPU engine, once per draft family
(Qwen3, Gemma-4; ``FAMILIES`` in conftest.py): lossless greedy output with partial acceptance,
the oracle draft always accepted, drafts after a prefix-cache hit equal drafts without the cache,
and drafts unchanged among churning requests, each check with a control that makes it fail.

The families differ only in the workload each test runs (``CASES``): Gemma-4's target has a
32-token sliding window, so its prompts are longer than the window, and its KV blocks are shared
by the sliding and full layers' groups.
"""

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest

from dspark_fixtures.engine import (
    TinyEngine,
    drafts_one_by_one,
    dspark_config,
    read_draft_log,
    run_engine,
)

K = 4  # the tiny drafts' trained block size


def varied_prompts(count: int, seed: int = 0) -> list[str]:
    """Prompts from 3 to ~90 words; two share a 64-word prefix so that the
    second one starts from a prefix-cache hit."""
    rng = random.Random(seed)
    lengths = [3, 9, 17, 30, 45, 60, 5, 24, 70, 12, 38, 52][:count]
    prompts = [" ".join(f"w{rng.randrange(990)}" for _ in range(n)) for n in lengths]
    shared = " ".join(f"w{rng.randrange(990)}" for _ in range(64))
    return [*prompts[:-2], f"{shared} w1 w2 w3", f"{shared} w7 w8 w9 w10 w11"]


def shared_prefix(words: int) -> str:
    return " ".join(f"w{(37 * i) % 990 + 5}" for i in range(words))


# Longer than the Gemma-4 target's 32-token sliding window.
GEMMA4_PROMPTS = [
    " ".join(f"w{(7 * i) % 900 + 10}" for i in range(40)),
    "w5 w6 w7 w8 w5 w6",
    " ".join(f"w{(13 * i) % 500 + 300}" for i in range(60)),
]
# The last Gemma-4 prompt waits for a free sequence slot and starts from a prefix-cache hit.
GEMMA4_LOSSLESS = [*GEMMA4_PROMPTS, f"{shared_prefix(100)} w1 w2", f"{shared_prefix(100)} w7 w8 w9"]
# Four sequences at a time, 48-token steps (prefills are chunked and mixed with decodes) and
# prefix caching on.
CHURN = dict(max_num_seqs=4, max_num_batched_tokens=48, enable_prefix_caching=True)


@dataclasses.dataclass(frozen=True)
class Case:
    """One family's workload for each test of this file."""

    lossless: tuple[list[str], list[int]]
    every_position_partial: bool
    """Whether the bigram pair's drafts are both accepted and rejected at every position (at
    the first one for Gemma-4, whose soft-capped logits the Markov head does not always beat)."""
    oracle: tuple[list[str], int]
    turns: list[str]
    """Two prompts that share a prefix: the second starts from a prefix-cache hit."""
    turn_tokens: tuple[int, int]
    min_prefix_hits: int
    min_cached_drafts: int
    churn: tuple[list[str], list[int]]
    """Prompts and lengths in which a request finishes early, so V1 condenses still-running
    requests into its row."""
    crowded: dict[str, Any]
    """Engine arguments under which the scheduler preempts and later resumes requests."""
    alone: dict[str, Any]


CASES = {
    "qwen3": Case(
        lossless=(varied_prompts(10), [40, 25, 60, 33, 20, 50, 45, 30, 22, 55]),
        every_position_partial=True,
        oracle=(varied_prompts(4), 32),
        # 190 shared words: five full 32-token KV blocks and a partial one (vLLM 0.32.0 drops
        # the last cached block for EAGLE-family drafters, so four are hit).
        turns=[f"{shared_prefix(190)} w11 w12 w13", f"{shared_prefix(190)} w21 w22 w23 w24 w25"],
        turn_tokens=(20, 30),
        min_prefix_hits=128,
        min_cached_drafts=25,
        churn=(varied_prompts(8, seed=1), [40, 25, 60, 33, 20, 8, 45, 70]),
        # 10 KV blocks of 32 tokens cannot hold four growing sequences.
        crowded=dict(max_num_seqs=4, max_num_batched_tokens=48, num_gpu_blocks_override=10),
        alone=dict(max_num_seqs=4),
    ),
    "gemma4": Case(
        lossless=(GEMMA4_LOSSLESS, [40, 25, 33, 30, 45]),
        every_position_partial=False,
        oracle=(GEMMA4_PROMPTS, 24),
        turns=[f"{shared_prefix(100)} w11 w12 w13", f"{shared_prefix(100)} w21 w22 w23 w24 w25"],
        turn_tokens=(12, 24),
        min_prefix_hits=64,
        min_cached_drafts=15,
        churn=(GEMMA4_LOSSLESS, [40, 8, 45, 30, 20]),
        # 12 KV blocks of 32 tokens, shared by the sliding and full layers' groups, cannot hold
        # four growing sequences (16 blocks, the fewest a 256-token model length takes, preempt
        # none; every request here fits in 160 tokens).
        crowded=dict(
            max_num_seqs=4, max_num_batched_tokens=48, max_model_len=160, num_gpu_blocks_override=12
        ),
        alone={},
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def models(family, tiny_family):
    return tiny_family(family)


@pytest.fixture(scope="module")
def case(family) -> Case:
    return CASES[family]


# --- Lossless, oracle -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_bigram(models, case):
    return run_engine(models.bigram_target, *case.lossless, **CHURN)


@pytest.mark.parametrize(
    "k", [pytest.param(K, id="k=block", marks=pytest.mark.each_vllm), pytest.param(2, id="k<block")]
)
def test_greedy_output_is_lossless_with_partial_acceptance(models, case, plain_bigram, k):
    dspark = run_engine(
        models.bigram_target, *case.lossless, dspark_config(models.bigram_draft, k=k), **CHURN
    )
    assert dspark.token_ids == plain_bigram.token_ids
    # The comparison means something only if drafts were both accepted and
    # rejected, and the prefix cache and chunking were hit.
    accepted = dspark.accepted_per_position
    assert len(accepted) == k
    partial = accepted if case.every_position_partial else accepted[:1]
    assert all(0 < n < dspark.drafts for n in partial), accepted
    assert dspark.metrics["vllm:prefix_cache_hits"] > 0
    assert len({tuple(t) for t in plain_bigram.token_ids}) == len(case.lossless[0])


@pytest.mark.parametrize("k", [K, 2])
def test_oracle_draft_is_always_accepted(models, case, k):
    prompts, max_tokens = case.oracle
    run = run_engine(
        models.zero_target,
        prompts,
        max_tokens,
        dspark_config(models.oracle_draft, k=k),
        max_num_seqs=len(prompts),
    )
    assert run.drafts > 0
    assert run.accepted_per_position == [run.drafts] * k
    assert all(set(tokens) == {0} for tokens in run.token_ids)


# --- Prefix caching keeps the draft's context ---------------------------------------------------


def second_turn_drafts(models, case, log: Path, caching: bool, between=None):
    """Drafts of the second turn by anchor, run after the first in the same engine."""
    with TinyEngine(
        models.random_target,
        dspark_config(models.random_draft, dspark_draft_log=str(log)),
        max_num_seqs=2,
        enable_prefix_caching=caching,
    ) as engine:
        engine.generate(case.turns[:1], case.turn_tokens[0])
        if between is not None:
            between(engine)
        log.unlink()
        second = engine.generate(case.turns[1:], case.turn_tokens[1])
    (records,) = read_draft_log(log).values()
    without_id = {a: {k: v for k, v in r.items() if k != "req_id"} for a, r in records.items()}
    return without_id, second


@pytest.fixture(scope="module")
def without_cache(models, case, tmp_path_factory):
    log = tmp_path_factory.mktemp("nocache") / "uncached.jsonl"
    return second_turn_drafts(models, case, log, caching=False)


def test_drafts_after_a_prefix_cache_hit_equal_drafts_without_the_cache(
    models, case, tmp_path, without_cache
):
    cached, hit = second_turn_drafts(models, case, tmp_path / "cached.jsonl", caching=True)
    uncached, miss = without_cache
    assert hit.metrics["vllm:prefix_cache_hits"] >= case.min_prefix_hits
    assert miss.metrics.get("vllm:prefix_cache_hits", 0) == 0
    assert hit.token_ids == miss.token_ids
    assert len(cached) >= case.min_cached_drafts
    assert cached == uncached


def test_prefix_cache_check_fails_when_cached_draft_context_is_lost(
    models, case, tmp_path, without_cache
):
    """The check above has teeth: wiping the draft layers' cached K/V between
    the turns (what a draft context outside the paged cache amounts to after a
    hit) changes the second turn's drafts."""

    def wipe(engine: TinyEngine) -> None:
        drafter = engine.model_runner.drafter
        contexts = engine.model_runner.compilation_config.static_forward_context
        for name in sorted(drafter._draft_attn_layer_names):
            cache = contexts[name].kv_cache
            (cache[0] if isinstance(cache, list) else cache).zero_()

    log = tmp_path / "wiped.jsonl"
    cached, hit = second_turn_drafts(models, case, log, caching=True, between=wipe)
    assert hit.metrics["vllm:prefix_cache_hits"] >= case.min_prefix_hits
    assert cached != without_cache[0]


# --- No cross-request contamination -------------------------------------------------------------


@pytest.fixture(scope="module")
def alone(models, case, tmp_path_factory) -> dict:
    """Each request's drafts served on its own; shared by the check and its control (whose
    fault needs two requests in a batch, so it cannot act here)."""
    log = tmp_path_factory.mktemp("alone") / "alone.jsonl"
    by_prompt = drafts_one_by_one(
        models.random_target, models.random_draft, *case.churn, log, **case.alone
    )
    return {str(index): records for index, records in enumerate(by_prompt)}


def mismatches_among_others(models, case, tmp_path: Path, alone: dict) -> dict[str, int]:
    """Per request, the anchors whose drafts differ between the crowded run and ``alone``."""
    crowded_log = tmp_path / "crowded.jsonl"
    crowded_run = run_engine(
        models.random_target,
        *case.churn,
        dspark_config(models.random_draft, dspark_draft_log=str(crowded_log)),
        **case.crowded,
    )
    assert crowded_run.metrics["vllm:num_preemptions"] > 0, "the crowded run must preempt"
    crowded = read_draft_log(crowded_log, first=True)
    for request, by_anchor in alone.items():
        # Random drafts are rejected, so decode steps happen at the same anchors
        # in both runs: nearly every anchor must be comparable.
        common = by_anchor.keys() & crowded[request].keys()
        assert len(common) >= len(by_anchor) - 1, (request, len(common), len(by_anchor))
    return {
        request: sum(
            by_anchor[anchor]["drafts"] != crowded[request][anchor]["drafts"]
            for anchor in by_anchor.keys() & crowded[request].keys()
        )
        for request, by_anchor in alone.items()
    }


def test_drafts_are_the_same_alone_and_among_churning_requests(models, case, tmp_path, alone):
    assert set(mismatches_among_others(models, case, tmp_path, alone).values()) == {0}


def test_contamination_check_fails_with_swapped_draft_block_tables(
    models, case, tmp_path, monkeypatch, alone
):
    """The check above has teeth: when the draft reads and writes its context
    through two requests' swapped block-table rows, their drafts change."""
    from vllm.v1.spec_decode.dspark.paged_proposer import DSparkPagedProposer

    set_inputs = DSparkPagedProposer.set_inputs_first_pass

    def swapped_rows(self, *args, cad, **kwargs):
        if cad.batch_size() >= 2:
            table = cad.block_table_tensor.clone()
            table[[0, 1]] = table[[1, 0]]
            cad = dataclasses.replace(cad, block_table_tensor=table)
        return set_inputs(self, *args, cad=cad, **kwargs)

    monkeypatch.setattr(DSparkPagedProposer, "set_inputs_first_pass", swapped_rows)
    mismatches = mismatches_among_others(models, case, tmp_path, alone)
    assert sum(n > 0 for n in mismatches.values()) >= 2, mismatches
