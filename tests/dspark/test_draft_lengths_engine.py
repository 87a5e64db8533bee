# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Per-request draft lengths shrink the target's verify batch in vLLM's V1 engine (sync scheduling).

Custom proposers choose a different number of drafts per request, either by returning shorter
lists (plain vLLM) or through `take_draft_token_lengths()` (the runner patch DSpark uses). On a
real CPU engine the tests check that the scheduler schedules exactly `1 + length` rows per decoding
request, that the target's forward runs on exactly those rows, that vLLM's spec-decode counters
count the scheduled drafts, and that greedy output is unchanged. CPU vLLM always schedules
synchronously; DSpark refuses confidence scheduling with async scheduling
(`tests/dspark/test_options.py`).
"""

import pytest
import torch

from dspark_fixtures.checkpoints.qwen3 import build_qwen3_target
from dspark_fixtures.engine import EngineRun, run_engine

pytestmark = pytest.mark.engine

K = 4
PROMPTS = [" ".join(f"w{(7 * p + 3 * i) % 50 + 5}" for i in range(6 + p)) for p in range(4)]
MAX_TOKENS = 48


def pattern_length(last_token: int) -> int:
    """0..K, varying across requests and steps."""
    return last_token % (K + 1)


class ShortListProposer:
    """Returns only the drafts to verify: `pattern_length(last)` copies of the last token."""

    def __init__(self, vllm_config) -> None:
        assert vllm_config.speculative_config.num_speculative_tokens == K

    def load_model(self, target_model) -> None:
        """Nothing to load; vLLM's CPU runner calls this for every drafter."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        return [[ids[-1]] * pattern_length(ids[-1]) if ids else [] for ids in sampled_token_ids]


class LengthSchedulingProposer(ShortListProposer):
    """Returns all K drafts and reports the lengths apart, as the DSpark proposer does."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        self._lengths = torch.tensor(
            [pattern_length(ids[-1]) if ids else 0 for ids in sampled_token_ids], dtype=torch.int32
        )
        return [[ids[-1]] * K if ids else [] for ids in sampled_token_ids]

    def take_draft_token_lengths(self) -> torch.Tensor:
        lengths, self._lengths = self._lengths, None
        return lengths


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    return str(build_qwen3_target(tmp_path_factory.mktemp("tiny-qwen3")))


@pytest.fixture(scope="module")
def plain_outputs(tiny_qwen3) -> list[list[int]]:
    return run_engine(tiny_qwen3, PROMPTS, MAX_TOKENS, max_num_seqs=8).token_ids


def run_with(model: str, proposer: type) -> EngineRun:
    return run_engine(
        model,
        PROMPTS,
        MAX_TOKENS,
        {
            "method": "custom_class",
            "model": f"{__name__}.{proposer.__name__}",
            "num_speculative_tokens": K,
        },
        record=True,
        max_num_seqs=8,
    )


def assert_verify_rows_follow_the_lengths(
    run: EngineRun, plain_outputs: list[list[int]]
) -> list[int]:
    """Checks the rows against the scheduled drafts; returns each verification's draft count."""
    assert run.token_ids == plain_outputs  # Verification stays exact whatever the lengths.
    decode_steps = [(tokens, spec) for tokens, spec in run.steps if spec]
    lengths = [len(ids) for _, spec in decode_steps for ids in spec.values()]
    assert set(lengths) > {1, K}, lengths  # The lengths really vary across requests and steps.
    for tokens, spec in decode_steps:
        for req_id, ids in spec.items():
            assert tokens[req_id] == 1 + len(ids)  # One bonus row plus one row per draft.
            assert ids == [ids[0]] * pattern_length(ids[0])
    # The target's forward ran on exactly the scheduled rows, fewer than 1 + K per request.
    assert run.forward_rows == [sum(tokens.values()) for tokens, _ in run.steps if tokens]
    shrunk_rows = sum(sum(tokens.values()) for tokens, _ in decode_steps)
    full_rows = sum((1 + K) * len(tokens) for tokens, _ in decode_steps)
    assert shrunk_rows < full_rows
    # vLLM's spec-decode counters (Prometheus and logs) count the scheduled drafts.
    assert run.metrics["vllm:spec_decode_num_draft_tokens"] == sum(lengths)
    print(f"verify rows: {shrunk_rows} scheduled vs {full_rows} at full k={K}")
    return lengths


def test_shorter_draft_lists_shrink_the_verify_batch(tiny_qwen3, plain_outputs):
    """Plain vLLM: the scheduler schedules as many rows as it receives drafts."""
    assert_verify_rows_follow_the_lengths(run_with(tiny_qwen3, ShortListProposer), plain_outputs)


def test_reported_lengths_shrink_the_verify_batch(tiny_qwen3, plain_outputs):
    """Patched vLLM: the runner cuts the drafts to `take_draft_token_lengths()`."""
    run = run_with(tiny_qwen3, LengthSchedulingProposer)
    lengths = assert_verify_rows_follow_the_lengths(run, plain_outputs)
    # Patched metrics: how many verifications reached each draft position.
    per_position = run.metrics["vllm:spec_decode_verified_drafts_per_pos"]
    assert per_position == [sum(n > pos for n in lengths) for pos in range(K)]
    assert per_position[0] > per_position[K - 1] > 0
