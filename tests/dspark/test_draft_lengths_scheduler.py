"""Async scheduling: reported draft lengths shrink the verify rows the scheduler plans.

vLLM's CPU platform never schedules asynchronously, so this drives vLLM's real `AsyncScheduler` the
way `EngineCore.step_with_batch_queue` does (schedule step N+1 before step N's output is processed)
and plays the model runner: every scheduled draft is accepted and each output reports a length per
request. Lengths reported by step N's output shape the verification scheduled at step N+2.
"""

from collections import deque

import pytest
import torch

from dspark_demo.tiny_models import build_qwen3_target
from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

K = 4
MAX_TOKENS = 40
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    return str(build_qwen3_target(tmp_path_factory.mktemp("tiny-qwen3")))


def make_scheduler(model: str, monkeypatch) -> AsyncScheduler:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    vllm_config = EngineArgs(
        model=model,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        enable_prefix_caching=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": K},
    ).create_engine_config()
    num_blocks = 64
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=32, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    return AsyncScheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


def drive(scheduler: AsyncScheduler, report_lengths: bool):
    """Runs 3 requests to completion with a batch queue of 2; returns per-step records."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(3):
        prompt = list(range(10 + i, 18 + 2 * i))
        scheduler.add_request(
            Request(f"r{i}", prompt_token_ids=prompt, sampling_params=params, pooling_params=None)
        )
    queue: deque = deque()
    steps = []  # (step, rows per request, drafts per request, lengths known when scheduled)
    known: dict[str, int] = {}
    generated = {f"r{i}": 0 for i in range(3)}
    step = 0
    while scheduler.has_requests() or queue:
        if scheduler.has_requests():
            step += 1
            output = scheduler.schedule()
            drafts = {r: len(t) for r, t in output.scheduled_spec_decode_tokens.items()}
            steps.append((step, dict(output.num_scheduled_tokens), drafts, dict(known)))
            queue.append((step, output))
            if len(queue) < 2:
                continue
        done_step, done = queue.popleft()
        req_ids = list(done.num_scheduled_tokens)
        sampled = [[7] * (1 + len(done.scheduled_spec_decode_tokens.get(r, ()))) for r in req_ids]
        lengths = [(done_step + i) % (K + 1) for i in range(len(req_ids))]
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            draft_token_lengths=lengths if report_lengths else None,
        )
        for engine_outputs in scheduler.update_from_output(done, runner_output).values():
            for out in engine_outputs.outputs:
                generated[out.request_id] += len(out.new_token_ids)
        known = dict(zip(req_ids, lengths, strict=True)) if report_lengths else {}
    return steps, generated


def test_reported_lengths_shape_the_step_after_next(tiny_qwen3, monkeypatch):
    steps, generated = drive(make_scheduler(tiny_qwen3, monkeypatch), report_lengths=True)
    checked = set()
    for _, rows, drafts, known in steps:
        for req_id, num_rows in rows.items():
            if req_id in known:  # Decoding, with a length reported two steps back.
                assert (num_rows, drafts.get(req_id, 0)) == (1 + known[req_id], known[req_id])
                checked.add(known[req_id])
    assert checked == set(range(K + 1))  # Every length, 0 included, was scheduled.
    # Placeholder bookkeeping stays exact: every request stops at exactly max_tokens.
    assert generated == {"r0": MAX_TOKENS, "r1": MAX_TOKENS, "r2": MAX_TOKENS}


def test_without_lengths_every_decode_step_verifies_k(tiny_qwen3, monkeypatch):
    steps, generated = drive(make_scheduler(tiny_qwen3, monkeypatch), report_lengths=False)
    decode = [(rows, drafts) for _, rows, drafts, _ in steps if drafts]
    assert decode
    for rows, drafts in decode:
        assert all(rows[r] == 1 + n for r, n in drafts.items())
    # Each request verifies k drafts on every decode step except a final partial one.
    assert sum(n == K for _, drafts in decode for n in drafts.values()) >= len(decode)
    assert generated == {"r0": MAX_TOKENS, "r1": MAX_TOKENS, "r2": MAX_TOKENS}
