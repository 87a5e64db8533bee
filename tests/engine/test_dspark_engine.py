"""DSpark on vLLM's V1 runner, end to end in the real CPU engine."""

import random
from pathlib import Path

import pytest
from engine_harness import dspark_config, read_draft_log, run_engine

pytestmark = pytest.mark.engine

K = 4


def varied_prompts(count: int, seed: int = 0) -> list[str]:
    """Prompts from 3 to ~90 words; two share a 64-word prefix so that the
    second one starts from a prefix-cache hit."""
    rng = random.Random(seed)
    lengths = [3, 9, 17, 30, 45, 60, 5, 24, 70, 12, 38, 52][:count]
    prompts = [" ".join(f"w{rng.randrange(990)}" for _ in range(n)) for n in lengths]
    shared = " ".join(f"w{rng.randrange(990)}" for _ in range(64))
    return [*prompts[:-2], f"{shared} w1 w2 w3", f"{shared} w7 w8 w9 w10 w11"]


# Four sequences at a time, 48-token steps (prefills are chunked and mixed with
# decodes) and prefix caching on.
CHURN = dict(max_num_seqs=4, max_num_batched_tokens=48, enable_prefix_caching=True)


def test_greedy_output_is_lossless_with_partial_acceptance(tiny):
    prompts = varied_prompts(10)
    max_tokens = [40, 25, 60, 33, 20, 50, 45, 30, 22, 55]
    plain = run_engine(tiny.bigram_target, prompts, max_tokens, **CHURN)
    dspark = run_engine(
        tiny.bigram_target, prompts, max_tokens, dspark_config(tiny.bigram_draft), **CHURN
    )

    assert dspark.token_ids == plain.token_ids
    # The comparison means something only if drafts were both accepted and
    # rejected, at every position, and the prefix cache and chunking were hit.
    accepted = dspark.accepted_per_position
    drafts = dspark.metrics["vllm:spec_decode_num_drafts"]
    assert all(0 < n < drafts for n in accepted), accepted
    assert dspark.metrics["vllm:prefix_cache_hits"] > 0
    assert len({tuple(t) for t in plain.token_ids}) == len(prompts)


def test_oracle_draft_is_always_accepted(tiny):
    prompts = varied_prompts(4)
    run = run_engine(
        tiny.zero_lm_head_target, prompts, 32, dspark_config(tiny.oracle_draft), max_num_seqs=4
    )
    drafts = run.metrics["vllm:spec_decode_num_drafts"]
    assert drafts > 0
    assert run.accepted_per_position == [drafts] * K
    assert run.metrics["vllm:spec_decode_num_accepted_tokens"] == drafts * K
    assert all(set(tokens) == {0} for tokens in run.token_ids)


def test_temperature_sampling_returns_valid_tokens(tiny):
    run = run_engine(
        tiny.random_target,
        varied_prompts(4),
        24,
        dspark_config(tiny.random_draft),
        temperature=0.8,
        max_num_seqs=4,
    )
    assert [len(tokens) for tokens in run.token_ids] == [24] * 4
    assert all(0 <= t < 1000 for tokens in run.token_ids for t in tokens)
    assert run.metrics["vllm:spec_decode_num_drafts"] > 0


# --- No cross-request contamination -----------------------------------------

CONTAMINATION_PROMPTS = varied_prompts(8, seed=1)
# Request 5 finishes early, so V1 condenses still-running requests into its row.
CONTAMINATION_MAX_TOKENS = [40, 25, 60, 33, 20, 8, 45, 70]
# 10 KV blocks of 32 tokens cannot hold four growing sequences: the scheduler
# preempts and later resumes requests, on top of staggered finishes. Prefix
# caching is off because a cache hit legitimately gives a request fewer ring
# entries than it has alone (it never saw the cached positions); that path is
# covered by the lossless test.
CROWDED = dict(
    max_num_seqs=4,
    max_num_batched_tokens=48,
    num_gpu_blocks_override=10,
    enable_prefix_caching=False,
)
ALONE = dict(max_num_seqs=4, enable_prefix_caching=False)


def drafts_alone_and_crowded(tiny, tmp_path: Path):
    crowded_log = tmp_path / "crowded.jsonl"
    crowded = run_engine(
        tiny.random_target,
        CONTAMINATION_PROMPTS,
        CONTAMINATION_MAX_TOKENS,
        dspark_config(tiny.random_draft, dspark_draft_log=str(crowded_log)),
        **CROWDED,
    )
    assert crowded.metrics["vllm:num_preemptions"] > 0, "the crowded run must preempt"
    crowded_drafts = read_draft_log(crowded_log)
    alone_drafts = {}
    for index, (prompt, max_tokens) in enumerate(
        zip(CONTAMINATION_PROMPTS, CONTAMINATION_MAX_TOKENS, strict=True)
    ):
        log = tmp_path / f"alone-{index}.jsonl"
        run_engine(
            tiny.random_target,
            [prompt],
            max_tokens,
            dspark_config(tiny.random_draft, dspark_draft_log=str(log)),
            **ALONE,
        )
        alone_drafts[str(index)] = read_draft_log(log)["0"]
    return alone_drafts, crowded_drafts


def mismatched_requests(alone, crowded) -> list[str]:
    """Requests whose drafts differ at an anchor both runs drafted from."""
    return [
        request
        for request, by_anchor in alone.items()
        if any(
            by_anchor[anchor]["drafts"] != crowded[request][anchor]["drafts"]
            for anchor in by_anchor.keys() & crowded[request].keys()
        )
    ]


def test_drafts_are_the_same_alone_and_among_churning_requests(tiny, tmp_path):
    alone, crowded = drafts_alone_and_crowded(tiny, tmp_path)
    for request, by_anchor in alone.items():
        # Random drafts are rejected, so decode steps happen at the same anchors
        # in both runs: nearly every anchor must be comparable.
        common = by_anchor.keys() & crowded[request].keys()
        assert len(common) >= len(by_anchor) - 1, (request, len(common), len(by_anchor))
    assert mismatched_requests(alone, crowded) == []


class RowIndexedSlots:
    """What the reference recipe did before its fix: the batch row is the slot."""

    def __init__(self, capacity: int) -> None:
        from vllm.v1.spec_decode.dspark.slot_table import SlotTable

        self._table = SlotTable(capacity)
        self.capacity = capacity
        self.scratch_slot = self._table.scratch_slot
        self.req_id_to_slot: dict[str, int] = {}
        self.free_slots = self._table.free_slots

    def assign(self, req_ids):
        from vllm.v1.spec_decode.dspark.slot_table import SlotAssignment

        self.req_id_to_slot = {req_id: row for row, req_id in enumerate(req_ids)}
        return SlotAssignment(slots=list(range(len(req_ids))), fresh=[])

    def release(self, req_id: str) -> None:
        pass

    def reconcile(self, live_req_ids) -> None:
        pass


def test_contamination_check_fails_with_row_indexed_slots(tiny, tmp_path, monkeypatch):
    """The check above has teeth: with row indexing, requests read each
    other's windows as soon as rows move, and their drafts change."""
    import vllm.v1.spec_decode.dspark.ring_proposer as proposer_module

    monkeypatch.setattr(proposer_module, "SlotTable", RowIndexedSlots)
    alone, crowded = drafts_alone_and_crowded(tiny, tmp_path)
    assert len(mismatched_requests(alone, crowded)) >= 2
