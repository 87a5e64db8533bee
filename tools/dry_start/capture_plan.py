# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The CUDA graphs a DSpark deployment captures, from vLLM's own dispatch code and the plan the
proposers follow (``draft_graph_sizes``), for a config no runner has resolved yet."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import cast

from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
from vllm.v1.spec_decode.dspark.cudagraph import draft_graph_sizes
from vllm.v1.spec_decode.dspark.family import draft_family
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer


@dataclass(frozen=True)
class CapturePlan:
    """The CUDA graphs a DSpark deployment captures, as the V1 runner will capture them."""

    mode: CUDAGraphMode
    """The target's resolved cudagraph mode."""
    target: tuple[tuple[CUDAGraphMode, tuple[int, ...]], ...]
    """The runner's capture passes: runtime mode and the token counts it captures."""
    draft_forward: tuple[int, ...]
    """Paged family: query-token counts of upstream DFlash's PIECEWISE graphs of the draft
    forward (captured in the runner's PIECEWISE pass only); ring family: none."""
    draft_requests: tuple[int, ...]
    """Request counts of the draft's FULL graphs: the ring family's block step, the paged
    family's stage after the forward (base logits, Markov chain, confidence head)."""
    draft_variants: tuple[str, ...]
    """``greedy`` and, with probabilistic drafts, ``sampled``."""

    def lines(self) -> list[str]:
        """The plan as a few lines for a start-up report."""
        lines = [f"target: cudagraph mode {self.mode.name}"]
        lines += [f"  {mode.name} pass: {list(sizes)} tokens" for mode, sizes in self.target]
        if self.draft_forward:
            lines.append(f"draft forward: PIECEWISE graphs for {list(self.draft_forward)} tokens")
        if self.draft_requests:
            lines.append(
                f"draft: FULL graphs for {list(self.draft_requests)} requests "
                f"({' and '.join(self.draft_variants)} drafts)"
            )
        if not self.draft_forward and not self.draft_requests:
            lines.append("draft: no CUDA graphs (every draft step runs eagerly)")
        return lines


def resolved_as_by_the_runner(
    vllm_config: VllmConfig, attention_support: AttentionCGSupport
) -> VllmConfig:
    """A copy of ``vllm_config`` whose compilation config is resolved as the V1 runner resolves
    it (``resolve_cudagraph_mode_and_sizes`` with the runner's arguments), for a config no
    runner has resolved yet; ``attention_support``: the minimum ``AttentionCGSupport`` of the
    deployment's attention backends."""
    # Shallow copies: resolving assigns new values, never mutates the originals'.
    config = copy.copy(vllm_config)
    config.compilation_config = copy.copy(vllm_config.compilation_config)
    config.compilation_config.resolve_cudagraph_mode_and_sizes(
        attention_support,
        None,
        config.uniform_decode_query_len,
        use_v2_model_runner=False,
        max_num_reqs=config.scheduler_config.max_num_seqs,
    )
    return config


def capture_plan(vllm_config: VllmConfig, on_cuda: bool = True) -> CapturePlan:
    """The target's and the draft's CUDA graphs for ``vllm_config`` as the V1 runner left it
    (a running engine's; before, ``resolved_as_by_the_runner``), from vLLM's own dispatch
    code."""
    mode = vllm_config.compilation_config.cudagraph_mode or CUDAGraphMode.NONE
    target = _capture_passes(vllm_config, mode)
    speculative_config = vllm_config.speculative_config
    assert speculative_config is not None
    forward: list[int] = []
    if draft_family(speculative_config.draft_model_config) != "deepseek_v4" and on_cuda:
        # Upstream's drafter dispatcher; the runner captures its keys in PIECEWISE passes only.
        drafter = _DrafterKeys(vllm_config)
        # Upstream's method on what it reads of a proposer (_DrafterKeys), without a model.
        SpecDecodeBaseProposer.initialize_cudagraph_keys(
            cast(SpecDecodeBaseProposer, drafter), mode
        )
        runner_passes = {pass_mode for pass_mode, _ in target}
        forward = [
            size
            for pass_mode, sizes in _descriptor_sizes(drafter.cudagraph_dispatcher)
            if pass_mode in runner_passes
            for size in sizes
        ]
    requests = draft_graph_sizes(vllm_config, mode, on_cuda)
    sampled = speculative_config.draft_sample_method == "probabilistic"
    return CapturePlan(
        mode=mode,
        target=target,
        draft_forward=tuple(sorted(forward)),
        draft_requests=tuple(requests),
        draft_variants=(("greedy", "sampled") if sampled else ("greedy",)) if requests else (),
    )


@dataclass
class _DrafterKeys:
    """What ``SpecDecodeBaseProposer.initialize_cudagraph_keys`` reads of a proposer."""

    vllm_config: VllmConfig

    def __post_init__(self) -> None:
        self.speculative_config = self.vllm_config.speculative_config
        self.cudagraph_dispatcher = CudagraphDispatcher(self.vllm_config)


def _capture_passes(
    vllm_config: VllmConfig, mode: CUDAGraphMode
) -> tuple[tuple[CUDAGraphMode, tuple[int, ...]], ...]:
    """The runner's capture passes (its dispatcher's keys for ``mode``)."""
    dispatcher = CudagraphDispatcher(vllm_config)
    dispatcher.initialize_cudagraph_keys(mode, vllm_config.uniform_decode_query_len)
    return _descriptor_sizes(dispatcher)


def _descriptor_sizes(
    dispatcher: CudagraphDispatcher,
) -> tuple[tuple[CUDAGraphMode, tuple[int, ...]], ...]:
    return tuple(
        (mode, tuple(sorted(d.num_tokens for d in descriptors)))
        for mode, descriptors in dispatcher.get_capture_descs()
    )
