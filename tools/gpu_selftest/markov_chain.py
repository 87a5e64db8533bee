# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The fused Markov chain (`markov_kernel`) on this GPU, at the Qwen3-8B draft's real size:
the per-position kernels draft what the torch chain drafts (float32, where sums agree to the
last bit that matters); the one-launch chain is turned on by the check the proposers run at
start-up (`markov_kernel.use_whole_chain`: bf16, greedy and sampled, eagerly and replayed from
a CUDA graph); and each way's time per chain, replayed from CUDA graphs as the draft's graphs
replay it. Neither kernel has run on a GPU in this project's CI (Triton's interpreter runs them
on its CPUs, one program at a time), so this is where their barrier and speed are seen."""

from __future__ import annotations

import argparse

from tools.gpu_selftest.report import FAILED, PASSED, Outcome

# DeepSpec's Qwen3-8B block-7 draft: vocabulary and Markov rank.
VOCAB, RANK, POSITIONS = 151936, 256, 7
TIMED_REPLAYS = 50


def chain_microseconds(run, replays: int = TIMED_REPLAYS) -> float:
    """Mean time of one `run()` replayed from a CUDA graph."""
    import torch

    run()  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def check_markov_chain(args: argparse.Namespace) -> Outcome:
    import torch
    from torch.nn import functional

    from vllm.v1.spec_decode.dspark import markov_kernel
    from vllm.v1.spec_decode.dspark.markov import markov_chain

    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    w1 = torch.randn(VOCAB, RANK, generator=g, device=device) / 4
    w2 = torch.randn(VOCAB, RANK, generator=g, device=device) / 4
    base = 4 * torch.randn(4, POSITIONS, VOCAB, generator=g, device=device)
    anchors = torch.randint(VOCAB, (4,), generator=g, device=device)
    drafts = torch.empty(4, POSITIONS, dtype=torch.int64, device=device)
    markov_kernel._per_position_chain(base, anchors, w1, w2, drafts, None)
    expected = markov_chain(
        base,
        anchors,
        lambda tokens: functional.embedding(tokens, w1),
        lambda embeds: functional.linear(embeds, w2),
        with_embeds=False,
    ).token_ids
    if not torch.equal(drafts, expected):
        return Outcome(
            FAILED,
            "the fused per-position Markov kernels draft otherwise than the torch chain at "
            f"float32 ({int((drafts != expected).sum())} of {drafts.numel()} drafts)",
        )
    w1, w2 = w1.bfloat16(), w2.bfloat16()
    multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
    resident = 1 << (multiprocessors.bit_length() - 1)
    off = markov_kernel.use_whole_chain(device, resident, w1, w2)
    base = base[:1].bfloat16()
    one = drafts[:1]
    per_position_us = chain_microseconds(
        lambda: markov_kernel._per_position_chain(base, anchors[:1], w1, w2, one, None)
    )
    facts = {"resident_programs": resident, "per_position_us": round(per_position_us, 1)}
    timing = f"batch 1, k = {POSITIONS}, bf16: per position {per_position_us:.0f} us"
    if off:
        facts["one_launch"] = f"off: {off}"
        return Outcome(
            PASSED,
            f"per-position kernels = torch chain; the one-launch chain is off ({off}), so "
            f"drafts take k + 1 launches; {timing} a chain",
            facts,
        )
    one_launch_us = chain_microseconds(
        lambda: markov_kernel._whole_chain(
            base, anchors[:1], w1, w2, one, None, markov_kernel._whole_chains[device]
        )
    )
    facts["one_launch"] = "on"
    facts["one_launch_us"] = round(one_launch_us, 1)
    return Outcome(
        PASSED,
        f"per-position kernels = torch chain; the one-launch chain is on ({resident} programs "
        f"resident) and drafts what they do; {timing}, one launch {one_launch_us:.0f} us a chain",
        facts,
    )
