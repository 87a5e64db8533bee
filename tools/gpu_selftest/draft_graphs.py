# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The engine checks' reading of the DSpark draft CUDA graphs (a proposer's `draft_graphs`):
the capture plan, and whether replaying a captured graph drafts what the eager draft does."""

from __future__ import annotations

import dataclasses

AGREEMENT_TEMPERATURE = 0.8
"""The temperature of the sampled agreement check's requests."""


def _captured(drafter) -> bool:
    graphs = getattr(drafter, "draft_graphs", None)
    return graphs is not None and bool(graphs.captured())


def greedy_agreement(drafter) -> dict[int, bool]:
    """Per captured request count of a loaded `DSparkRingProposer`: whether replaying its greedy
    graph drafts exactly what the eager draft does for the same inputs (the scratch slot,
    distinct anchors and anchor tokens); empty when nothing was captured (the graph counts say
    so). It writes nothing but the scratch slot's block buffers."""
    return _agreement(drafter, sampled=False, seed=0) if _captured(drafter) else {}


def sampled_agreement(drafter, seed: int) -> dict[int, bool]:
    """As `greedy_agreement` for the sampled graphs, at `AGREEMENT_TEMPERATURE`: both drafts
    drawn from the generator reseeded with `seed`, tokens and distributions compared. It also
    writes the distributions buffer."""
    return _agreement(drafter, sampled=True, seed=seed) if _captured(drafter) else {}


def _agreement(proposer, sampled: bool, seed: int) -> dict[int, bool]:
    import torch

    from vllm.v1.spec_decode.dspark.markov import greedy_sample

    graphs, drafter = proposer.draft_graphs, proposer._drafter
    device = drafter.ring.tags.device
    agree = {}
    for size in graphs.captured(sampled):
        slots = torch.full((size,), drafter.scratch_slot, dtype=torch.int64, device=device)
        anchors = torch.arange(size, dtype=torch.int64, device=device) * 7
        anchor_tokens = torch.arange(size, dtype=torch.int64, device=device) + 1
        metadata = None
        sample = greedy_sample
        if sampled:
            metadata = dataclasses.replace(
                proposer._runner.input_batch.sampling_metadata,
                temperature=torch.full((size,), AGREEMENT_TEMPERATURE, device=device),
                all_greedy=False,
                all_random=True,
            )
            sample = proposer._position_sampler(metadata)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            with proposer._draft_context(size):
                eager = drafter.draft(
                    slots, anchors, anchor_tokens, graphs.num_drafts, sample=sample
                )
            eager_probs = None if eager.probs is None else eager.probs.clone()
            torch.manual_seed(seed)
            replayed = graphs.draft(slots, anchors, anchor_tokens, size, metadata)
        same = torch.equal(eager.token_ids, replayed.token_ids)
        if sampled:
            same = same and torch.equal(eager_probs, replayed.probs)
        agree[size] = bool(same)
    return agree


def capture_plan(runner) -> dict:
    """The graphs the runner captures for the target (its final cudagraph mode and capture
    sizes, read after start-up) and for the drafter: DSpark's FULL graphs (the ring draft's
    `DraftGraphs`, the paged draft's `ChainGraphs`: planned and captured request counts) and a
    vLLM drafter's dispatcher keys (token counts per mode), or a Model Runner V2 speculator's
    captured token counts."""
    compilation = runner.vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    plan: dict = {
        "target": {
            "mode": getattr(mode, "name", str(mode)),
            "sizes": list(compilation.cudagraph_capture_sizes or []),
        }
    }
    drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
    graphs = getattr(drafter, "draft_graphs", None)
    dispatcher = getattr(drafter, "cudagraph_dispatcher", None)
    manager = getattr(drafter, "query_cudagraph_manager", None)
    plan["draft"] = {}
    if dispatcher is not None:
        plan["draft"] = {
            f"{mode.name} tokens": sorted(d.num_tokens for d in descriptors)
            for mode, descriptors in dispatcher.get_capture_descs()
        }
    elif manager is not None:
        plan["draft"] = {"captured tokens": manager.captured_token_counts()}
    if graphs is not None:
        plan["draft"]["FULL requests planned"] = list(graphs.sizes)
        plan["draft"]["captured"] = graphs.captured()
    return plan
