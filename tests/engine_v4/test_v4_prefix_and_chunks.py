# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""Prefix caching and chunked prefill with a DeepSeek-V4 target, in the real engine.

vLLM's CPU platform switches both off for DeepSeek-V4 unless the CPU has AMX tiles
(``CpuPlatform.check_and_update_config``: ``amx_mla_or_dsv4_enabled``), although its own comment
says the V4 CPU kernels support both. The ``gate_lifted`` fixture (conftest) keeps what the engine
was asked for; ``test_target_alone_is_unchanged_by_the_lifted_gate`` shows the target's greedy
output is the same with chunked prefill and prefix caching as without, so the kernels run both on
this CPU.

A request that starts from a prefix-cache hit fills its ring from the recomputed tokens alone, so
the hit must leave at least the window W to recompute. V1's own margin does not: with V4's 64-token
hash blocks a 540-token prompt extending a cached 530-token one hits 448 tokens, 92 recomputed.
``patches/*/scheduler.patch`` and ``kv-cache-manager.patch`` cap the hit at the prompt length less
W (``dspark.spec.prefix_hit_recompute_tokens``). ``window_shortfalls`` checks the ring itself:
after every draft step, how many of the last W positions (up to the anchor) each request's slot
lacks.
"""

from typing import Any

import pytest
import torch

from dspark_fixtures.checkpoints.deepseek_v4 import PERIOD, cycle_prompt
from dspark_fixtures.engine import TinyEngine, read_draft_log
from tests.engine_v4.v4_harness import V4_ENGINE_ARGS, dspark, run_v4

K = 4
V4_BLOCK = 256
WINDOW = 128
CACHING = dict(enable_prefix_caching=True, enable_chunked_prefill=False, max_num_seqs=2)


@pytest.fixture
def window_shortfalls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Per request and draft step: positions of its window its ring slot does not hold."""
    from vllm.v1.spec_decode.dspark.drafter import BlockDrafter

    shortfalls: list[int] = []
    step = BlockDrafter.step

    def checked_step(self, request_slots, *args, **kwargs):
        output = step(self, request_slots, *args, **kwargs)
        window, anchors = self.ring.window, output.anchors[:, None]
        tags = self.ring.tags[request_slots.long()]
        held = ((tags > anchors - window) & (tags <= anchors)).sum(-1)
        shortfalls.extend((torch.clamp(anchors[:, 0] + 1, max=window) - held).tolist())
        return output

    monkeypatch.setattr(BlockDrafter, "step", checked_step)
    return shortfalls


def accepted_all(metrics: dict[str, Any]) -> bool:
    drafted = metrics["vllm:spec_decode_num_draft_tokens"]
    return drafted > 0 and metrics["vllm:spec_decode_num_accepted_tokens"] == drafted


# Prompts that extend or resend a cached one, one engine, one after another (vLLM keeps
# sliding-window state only where a resend or an extension can hit).
LENGTHS = [2 * V4_BLOCK + 18, 2 * V4_BLOCK + 28, 700, 900, 2 * V4_BLOCK + 18, 700]
NEW_TOKENS = 8


def serve_one_by_one(target, speculative_config, min_recomputed_tokens: int | None = None):
    """Each prompt's tokens, prefix-cache hit and the spec-decode counters of the last.
    ``min_recomputed_tokens`` overrides what the scheduler patch set (the control)."""
    tokens, hits = [], []
    with TinyEngine(target, speculative_config, **{**V4_ENGINE_ARGS, **CACHING}) as engine:
        if min_recomputed_tokens is not None:
            scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
            scheduler.kv_cache_manager.min_recomputed_tokens = min_recomputed_tokens
        before = 0
        for n in LENGTHS:
            run = engine.generate_stepwise([cycle_prompt(10, n)], [NEW_TOKENS])
            tokens.append(run.token_ids[0])
            hits.append(run.metrics["vllm:prefix_cache_hits"] - before)
            before = run.metrics["vllm:prefix_cache_hits"]
    return tokens, hits, run.metrics


def test_target_alone_is_unchanged_by_the_lifted_gate(tiny_v4_models, gate_lifted):
    prompts = [cycle_prompt(10, n) for n in (530, 700)] + [cycle_prompt(300, 90)]
    gated = run_v4(tiny_v4_models.noisy, prompts, [30, 30, 30], max_num_seqs=4)
    chunked = run_v4(
        tiny_v4_models.noisy,
        prompts,
        [30, 30, 30],
        max_num_seqs=4,
        enable_chunked_prefill=True,
        max_num_batched_tokens=128,
    )
    assert chunked.token_ids == gated.token_ids
    with TinyEngine(tiny_v4_models.noisy, **{**V4_ENGINE_ARGS, **CACHING}) as engine:
        engine.generate_stepwise(prompts[:1], [8])
        cached = engine.generate_stepwise(prompts[1:2], [30])
    assert cached.metrics["vllm:prefix_cache_hits"] > 0
    assert cached.token_ids[0] == gated.token_ids[1]


@pytest.mark.each_vllm  # kv-cache-manager.patch differs between the versions
def test_after_a_prefix_hit_the_ring_holds_the_whole_window(
    tiny_v4_models, gate_lifted, window_shortfalls
):
    """Every hit leaves at least W tokens to recompute and no draft step finds its ring short;
    hits still happen. The control puts back V1's own margin: a hit leaves fewer than W tokens
    and the ring is short. The output is the cycle in both."""
    expected = [cycle_prompt(10, n + NEW_TOKENS)[n:] for n in LENGTHS]
    tokens, hits, metrics = serve_one_by_one(tiny_v4_models.oracle, dspark(K))
    assert tokens == expected
    assert sum(hits) > 0
    assert all(n - hit >= WINDOW for n, hit in zip(LENGTHS, hits, strict=True) if hit)
    assert window_shortfalls and max(window_shortfalls) == 0
    assert accepted_all(metrics)

    window_shortfalls.clear()
    tokens, hits, _ = serve_one_by_one(tiny_v4_models.oracle, dspark(K), min_recomputed_tokens=1)
    assert tokens == expected
    assert any(0 < n - hit < WINDOW for n, hit in zip(LENGTHS, hits, strict=True) if hit)
    assert max(window_shortfalls) > 0


def test_chunked_prefill_fills_the_ring_as_one_prefill_does(
    tiny_v4_models, gate_lifted, window_shortfalls, tmp_path
):
    """Prompts of up to 610 tokens prefilled in chunks of at most 128 tokens give the drafts of
    unchunked prefill at every step after the prompt; every ring holds its window and every
    draft is accepted."""
    prompts = [cycle_prompt(10 + PERIOD * i, n) for i, n in enumerate([300, 610, 450, 90])]
    max_tokens = [20, 28, 17, 33]
    runs, logs = {}, {}
    for chunked in (False, True):
        logs[chunked] = tmp_path / f"chunked-{chunked}.jsonl"
        runs[chunked] = run_v4(
            tiny_v4_models.oracle,
            prompts,
            max_tokens,
            dspark(K, dspark_draft_log=str(logs[chunked])),
            max_num_seqs=4,
            enable_chunked_prefill=chunked,
            max_num_batched_tokens=128 if chunked else None,
        )
    assert runs[True].token_ids == runs[False].token_ids
    assert accepted_all(runs[True].metrics)
    assert max(window_shortfalls) == 0
    # Partial prefills draft too (their drafts are discarded); compare the steps both have.
    whole, in_chunks = read_draft_log(logs[False]), read_draft_log(logs[True])
    assert whole.keys() == in_chunks.keys()
    for req, records in whole.items():
        for anchor, record in records.items():
            assert in_chunks[req][anchor]["drafts"] == record["drafts"], (req, anchor)
