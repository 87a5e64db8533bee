# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The engine checks' only door into the DSpark draft CUDA graphs (`DraftGraphs` and the checks
that ship beside it): where those live or what they are called changes here and nowhere else."""

from __future__ import annotations


def _graphs_module():
    from vllm.v1.spec_decode.dspark import cudagraph

    return cudagraph


def _captured(drafter) -> bool:
    graphs = getattr(drafter, "draft_graphs", None)
    return graphs is not None and bool(graphs.captured())


def greedy_agreement(drafter) -> dict[int, bool]:
    """Per captured request count: whether replaying its graph drafts exactly what the eager
    draft does for the same inputs (`graph_and_eager_drafts_agree`); empty when nothing was
    captured (the graph counts say so)."""
    if not _captured(drafter):
        return {}
    return _graphs_module().graph_and_eager_drafts_agree(drafter)


def sampled_agreement(drafter, seed: int) -> dict[int, bool]:
    """Per captured request count: whether drafts drawn through the graph equal eager drafts
    drawn with the same random numbers (seeded with `seed`); empty when nothing was captured."""
    if not _captured(drafter):
        return {}
    return _graphs_module().sampled_graph_and_eager_drafts_agree(drafter, seed)


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
    graphs = getattr(drafter, "draft_graphs", None) or getattr(drafter, "chain_graphs", None)
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
