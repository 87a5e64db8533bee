# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""DSpark with a DeepSeek-V4 target, end to end in the real vLLM CPU engine.

``LLM(<tiny V4 target>, speculative_config={"method": "dspark", "num_speculative_tokens": k})``:
the proposer reads the draft from the target checkpoint's own ``mtp.*`` tensors.
"""

import random

import pytest
import torch

from dspark_fixtures.checkpoints.deepseek_v4 import PERIOD, cycle_prompt
from dspark_fixtures.host_syncs import HostSyncRecorder
from tests.engine_v4.v4_harness import dspark, run_v4
from tests.helpers import RowIndexedSlots

K = 4


class StepSyncRecorder(HostSyncRecorder):
    """``HostSyncRecorder`` minus ``repeat_interleave`` by a constant (its output shape is known
    without reading the device; vLLM's rotary repeats cos/sin that way)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func == torch.ops.aten.repeat_interleave.self_int:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def cycle_prompts(lengths: list[int]) -> list[list[int]]:
    return [cycle_prompt(10 + PERIOD * i, n) for i, n in enumerate(lengths)]


def test_oracle_draft_reads_its_ring_and_every_draft_is_accepted(tiny_v4_models, monkeypatch):
    """The oracle's drafts are right only if slot j attends to the ring entry PERIOD positions
    before its own RoPE position (reference notes section 6.3): then every draft is accepted.
    The V4 draft step (ring write, draft, Markov chain) makes no host-syncing op."""
    from vllm.v1.spec_decode.dspark.drafter import BlockDrafter

    syncs: list[str] = []
    step = BlockDrafter.step

    def recorded_step(self, *args, **kwargs):
        with StepSyncRecorder() as recorder:
            output = step(self, *args, **kwargs)
        syncs.extend(recorder.syncs)
        return output

    prompts = cycle_prompts([40, 45, 64, 50])
    max_tokens = [24, 40, 17, 33]
    plain = run_v4(tiny_v4_models.oracle, prompts, max_tokens, max_num_seqs=4)
    monkeypatch.setattr(BlockDrafter, "step", recorded_step)
    run = run_v4(tiny_v4_models.oracle, prompts, max_tokens, dspark(K), max_num_seqs=4)

    assert run.token_ids == plain.token_ids
    assert run.metrics["vllm:spec_decode_num_draft_tokens"] >= 40
    assert (
        run.metrics["vllm:spec_decode_num_accepted_tokens"]
        == run.metrics["vllm:spec_decode_num_draft_tokens"]
    )
    drafts = run.metrics["vllm:spec_decode_num_drafts"]
    assert run.metrics["vllm:spec_decode_num_accepted_tokens_per_pos"] == [drafts] * K
    assert sorted(set(syncs)) == []


def test_wrong_rope_phase_gets_nothing_accepted(tiny_v4_models, monkeypatch):
    """Control: the same draft with its block one position lower (the phase of
    the public two-node DGX Spark recipe's V1 proposer)
    reads a token one cycle step off, so nothing it drafts is accepted, and output is unchanged."""
    from vllm.v1.spec_decode.dspark import drafter

    prompts = cycle_prompts([40, 45])
    monkeypatch.setattr(drafter, "BLOCK_START_OFFSET", drafter.BLOCK_START_OFFSET - 1)
    run = run_v4(tiny_v4_models.oracle, prompts, [20, 20], dspark(K), max_num_seqs=2)

    assert run.token_ids == [
        cycle_prompt(prompts[0][-1], 21)[1:],
        cycle_prompt(prompts[1][-1], 21)[1:],
    ]
    assert (
        run.metrics["vllm:spec_decode_num_draft_tokens"] > 0
        and run.metrics["vllm:spec_decode_num_accepted_tokens"] == 0
    )


# With vLLM's CPU gate lifted (conftest ``gate_lifted``): prompts prefilled in chunks of at most
# 96 tokens, and preempted requests resuming from their own cached blocks.
CHUNKED_AND_CACHED = dict(
    enable_chunked_prefill=True, max_num_batched_tokens=96, enable_prefix_caching=True
)


@pytest.mark.parametrize("features", [{}, CHUNKED_AND_CACHED], ids=["plain", "chunked-cached"])
def test_greedy_output_is_lossless_under_churn(tiny_v4_models, request, features):
    """A context-dependent target with drafts both accepted and rejected, more requests than
    max_num_seqs (slots reused), mixed lengths, a preemption and an abort mid-flight; also with
    chunked prefill and prefix caching."""
    if features:
        request.getfixturevalue("gate_lifted")
    rng = random.Random(0)
    lengths = [240, 245, 7, 250, 12, 236, 150]
    prompts = [
        cycle_prompt(10 + PERIOD * i, n)
        if i % 2 == 0
        else [rng.randrange(5, 1000) for _ in range(n)]
        for i, n in enumerate(lengths)
    ]
    max_tokens = [30, 40, 24, 36, 40, 28, 25]
    churn = dict(
        max_model_len=384, max_num_seqs=3, num_gpu_blocks_override=8, abort={4: 6}, **features
    )
    plain = run_v4(tiny_v4_models.noisy, prompts, max_tokens, **churn)
    run = run_v4(tiny_v4_models.noisy, prompts, max_tokens, dspark(K), **churn)

    aborted = min(len(plain.token_ids[4]), len(run.token_ids[4]))
    assert aborted < max_tokens[4]
    assert run.token_ids[4][:aborted] == plain.token_ids[4][:aborted]
    assert run.token_ids[:4] + run.token_ids[5:] == plain.token_ids[:4] + plain.token_ids[5:]
    # The comparison means something only if drafts were accepted and rejected and the
    # scheduler preempted.
    assert (
        0
        < run.metrics["vllm:spec_decode_num_accepted_tokens"]
        < run.metrics["vllm:spec_decode_num_draft_tokens"]
    )
    assert run.metrics["vllm:num_preemptions"] >= 1


# --- No cross-request contamination ----------------------------------------------------------

# Seven requests for three slots: slots are reused, the 8-block cache preempts, request 4 is
# aborted mid-flight and the others finish at different steps, so batch rows move.
CHURN_LENGTHS = [240, 245, 7, 250, 12, 236, 150]
CHURN_MAX_TOKENS = [30, 40, 24, 36, 40, 28, 25]
CHURN = dict(max_model_len=384, max_num_seqs=3, num_gpu_blocks_override=8)


def drafts_alone_and_churning(target, tmp_path) -> tuple[dict, dict]:
    """Every request's logged drafts by anchor: run alone, and among the others with churn."""
    from dspark_fixtures.engine import read_draft_log

    prompts = cycle_prompts(CHURN_LENGTHS)
    crowded_log = tmp_path / "crowded.jsonl"
    crowded = run_v4(
        target,
        prompts,
        CHURN_MAX_TOKENS,
        dspark(K, dspark_draft_log=str(crowded_log)),
        abort={4: 6},
        **CHURN,
    )
    assert crowded.metrics["vllm:num_preemptions"] >= 1, "the crowded run must preempt"
    alone = {}
    for index, (prompt, n) in enumerate(zip(prompts, CHURN_MAX_TOKENS, strict=True)):
        log = tmp_path / f"alone-{index}.jsonl"
        run_v4(target, [prompt], [n], dspark(K, dspark_draft_log=str(log)), **CHURN)
        (alone[str(index)],) = read_draft_log(log).values()
    return alone, read_draft_log(crowded_log)


def contaminated_requests(alone: dict, crowded: dict) -> list[str]:
    """Requests whose drafts differ at an anchor both runs drafted from."""
    shared = {request: alone[request].keys() & crowded[request].keys() for request in alone}
    # Comparable: every request drafted from some anchor in both runs (preemption shifts them).
    assert all(shared.values()) and sum(map(len, shared.values())) >= 20, shared
    return [
        request
        for request, anchors in shared.items()
        if any(alone[request][a]["drafts"] != crowded[request][a]["drafts"] for a in anchors)
    ]


def test_each_request_drafts_alike_alone_and_among_churning_requests(tiny_v4_models, tmp_path):
    """The ring draft reads only its own request's entries, however slots are reused and rows
    move (the oracle draft's drafts depend on which ring entries it reads)."""
    alone, crowded = drafts_alone_and_churning(tiny_v4_models.oracle, tmp_path)
    assert contaminated_requests(alone, crowded) == []


def test_contamination_check_fails_with_row_indexed_slots(tiny_v4_models, tmp_path, monkeypatch):
    """The check above has teeth: with batch rows as slots, requests read each other's rings."""
    from vllm.v1.spec_decode.dspark import ring_proposer

    monkeypatch.setattr(ring_proposer, "SlotTable", RowIndexedSlots)
    alone, crowded = drafts_alone_and_churning(tiny_v4_models.oracle, tmp_path)
    assert contaminated_requests(alone, crowded)
