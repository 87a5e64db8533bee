# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FULL CUDA graphs of the DSpark draft step, one per padded request count: the ring draft's
block step (``DraftGraphs``) and the paged draft's stage after its forward (``ChainGraphs``;
the forward itself replays upstream DFlash's piecewise graphs); and the capture plan of a
deployment (``capture_plan``).

The V1 runner loads the drafter before it resolves its CUDA-graph mode and capture sizes
(``resolve_cudagraph_mode_and_sizes`` rounds them to multiples of k + 1), then calls the
drafter's ``initialize_cudagraph_keys``: the draft plans its graphs there, from the final
sizes. The runner hands the drafter ``use_cudagraphs=True`` only in its PIECEWISE capture
pass (EAGLE's drafters capture piecewise graphs); these graphs are FULL graphs of their own,
captured at the first call of any capture pass, so every cudagraph mode that captures the
target captures them. Their request counts follow the target's decode graphs: a decode batch
of n requests pads to the target graph that holds it, its draft to the same request count.

A graph replays greedy or sampled drafts: per-request temperatures sit in a fixed buffer
written before replay, and vLLM's draft sampler draws its noise from the default generator,
which CUDA graphs advance on every replay.
"""

import bisect
import copy
import dataclasses
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from typing_extensions import override

from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import BatchDescriptor, set_forward_context
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import _SAMPLING_EPS
from vllm.v1.spec_decode.dspark.drafter import BlockDrafter, DraftOutput
from vllm.v1.spec_decode.dspark.family import draft_family
from vllm.v1.spec_decode.dspark.markov import PositionSampler, greedy_sample
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

logger = init_logger(__name__)

SampleFromLogits = Callable[[torch.Tensor, SamplingMetadata], tuple[torch.Tensor, torch.Tensor]]
"""vLLM's draft sampler (``SpecDecodeBaseProposer._sample_from_logits``)."""


def draft_graph_sizes(
    vllm_config: VllmConfig, cudagraph_mode: CUDAGraphMode, on_cuda: bool
) -> list[int]:
    """Request counts whose block draft is captured: for each of the runner's capture sizes,
    the uniform decode batch it holds (``size // (k + 1)`` requests), up to ``max_num_seqs``.
    A decode batch of n requests pads to the target graph that holds it, and its draft to
    the draft graph of that graph's request count. None with
    ``speculative_config.enforce_eager``, with a target that captures nothing (mode NONE), or
    off CUDA."""
    speculative_config = vllm_config.speculative_config
    assert speculative_config is not None
    if speculative_config.enforce_eager or not on_cuda or cudagraph_mode == CUDAGraphMode.NONE:
        return []
    query_len = vllm_config.uniform_decode_query_len
    max_requests = vllm_config.scheduler_config.max_num_seqs
    sizes = vllm_config.compilation_config.cudagraph_capture_sizes or []
    return sorted({size // query_len for size in sizes if 1 <= size // query_len <= max_requests})


class FixedTemperatureSampler:
    """vLLM's draft sampler reading per-request temperatures from a fixed buffer, so that one
    captured graph samples any batch. Rows below vLLM's greedy threshold take the argmax, as they
    do eagerly in a batch that mixes greedy and sampled requests; which rows those are, and
    their temperature of 1, is worked out once a block (``begin``) rather than at every position
    as the sampler's general path does. Padding rows sample at temperature 1 and are dropped."""

    def __init__(
        self, sample_from_logits: SampleFromLogits, max_requests: int, device: torch.device
    ) -> None:
        self._sample_from_logits = sample_from_logits
        self.temperature = torch.ones(max_requests, dtype=torch.float32, device=device)
        self._greedy = torch.zeros(max_requests, dtype=torch.bool, device=device)
        self._template: SamplingMetadata | None = None

    def write(self, sampling_metadata: SamplingMetadata, num_requests: int, size: int) -> None:
        """Take the batch's temperatures (rows past ``num_requests`` up to ``size`` pad)."""
        if num_requests:
            assert sampling_metadata.temperature is not None
            self.temperature[:num_requests].copy_(sampling_metadata.temperature[:num_requests])
        if num_requests < size:
            self.temperature[num_requests:size].fill_(1.0)
        self._template = sampling_metadata

    def begin(self, size: int) -> "FixedTemperatureSampler":
        """Before a block's first position: mark the greedy rows and give them temperature 1
        (what vLLM's sampler does at every position of a batch that is not all random)."""
        torch.lt(self.temperature[:size], _SAMPLING_EPS, out=self._greedy[:size])
        self.temperature[:size].masked_fill_(self._greedy[:size], 1.0)
        return self

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._template is not None, "write() must run before sampling"
        rows = logits.shape[0]
        metadata = dataclasses.replace(
            self._template,
            temperature=self.temperature[:rows],
            all_greedy=False,
            all_random=True,
        )
        token_ids, probs = self._sample_from_logits(logits, metadata)
        return torch.where(self._greedy[:rows], probs.argmax(dim=-1), token_ids), probs


class RequestGraphs(ABC):
    """FULL CUDA graphs of one stage of the draft step per padded request count, captured and
    replayed by vLLM's ``CUDAGraphWrapper`` (keyed by a ``BatchDescriptor``, as vLLM's own graphs
    are): one set for greedy drafts and, given vLLM's draft sampler, one for sampled ones.

    Subclasses name the stage (``stage``), hold its fixed inputs, pad them (``_pad``) and run
    the stage on them (``_run``); rows past the batch are padding and are dropped. Sampled
    graphs write their distributions into the proposer's ``draft_probs`` buffer, as the eager
    step does.
    """

    stage: str

    def __init__(
        self,
        vllm_config: VllmConfig,
        sizes: list[int],
        num_drafts: int,
        device: torch.device,
        sample_from_logits: SampleFromLogits | None = None,
        draft_probs: torch.Tensor | None = None,
    ) -> None:
        """``sample_from_logits`` and ``draft_probs`` (the ``[max requests, k, V]`` buffer):
        for graphs of sampled drafts too."""
        self.sizes = sorted(sizes)
        self.num_drafts = num_drafts
        self._vllm_config = vllm_config
        self._draft_probs = draft_probs
        largest = self.sizes[-1]
        self._anchor_tokens = torch.zeros(largest, dtype=torch.int64, device=device)
        self.sampler = (
            None
            if sample_from_logits is None
            else FixedTemperatureSampler(sample_from_logits, largest, device)
        )
        self._graphs = {
            sampled: CUDAGraphWrapper(
                functools.partial(self._run, sampled=sampled), vllm_config, CUDAGraphMode.FULL
            )
            for sampled in ((False, True) if self.sampler is not None else (False,))
        }

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple("sampled" if sampled else "greedy" for sampled in self._graphs)

    def captured(self, sampled: bool = False) -> list[int]:
        """Sizes the wrapper holds a graph for (none for a variant not planned). vLLM's CUDA-graph
        memory profile captures and then clears every wrapper's graphs; the runner's capture
        pass captures them again."""
        if sampled not in self._graphs:
            return []
        return sorted(
            descriptor.num_tokens
            for descriptor, entry in self._graphs[sampled].concrete_cudagraph_entries.items()
            if entry.cudagraph is not None
        )

    def padded_size(self, num_requests: int, sampled: bool = False) -> int | None:
        """The smallest captured size that holds ``num_requests``; None: it runs eagerly."""
        captured = self.captured(sampled)
        index = bisect.bisect_left(captured, num_requests)
        return captured[index] if index < len(captured) else None

    def capture_missing(self, sampling_metadata: SamplingMetadata) -> None:
        """Capture every planned size not captured yet, largest first (smaller graphs reuse its
        memory pool), each after vLLM's number of warm-up runs, then log the sizes captured;
        inside the runner's capture pass. ``sampling_metadata``: any batch's (its fields other
        than the temperatures are not read)."""
        if all(self.captured(sampled) == self.sizes for sampled in self._graphs):
            return
        warmups = self._vllm_config.compilation_config.cudagraph_num_of_warmups
        for sampled in self._graphs:
            for size in reversed(self.sizes):
                if size in self.captured(sampled):
                    continue
                self._load(0, size, sampling_metadata if sampled else None)
                for _ in range(warmups):
                    with self._context(size, CUDAGraphMode.NONE):
                        self._graphs[sampled](size)
                with self._context(size, CUDAGraphMode.FULL):
                    self._graphs[sampled](size)
        logger.info(
            "DSpark draft: FULL CUDA graphs of the %s captured for %s requests (%s drafts).",
            self.stage,
            sorted(set.intersection(*(set(self.captured(s)) for s in self._graphs))),
            " and ".join(self.variants),
        )

    def _replay(
        self,
        anchor_tokens: torch.Tensor,
        size: int,
        sampling_metadata: SamplingMetadata | None,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Replay the ``size`` graph for the ``len(anchor_tokens)`` requests whose other inputs
        the subclass wrote: its outputs, and the distributions of sampled drafts."""
        num_requests = anchor_tokens.shape[0]
        self._anchor_tokens[:num_requests].copy_(anchor_tokens)
        self._load(num_requests, size, sampling_metadata)
        sampled = sampling_metadata is not None
        with self._context(size, CUDAGraphMode.FULL):
            # The next replay overwrites the graph's outputs; the runner may still read these.
            replayed = self._graphs[sampled](size)
            assert replayed is not None
            outputs = [t[:num_requests].clone() for t in replayed]
        probs = None
        if sampled:
            assert self._draft_probs is not None
            probs = self._draft_probs[:num_requests, : self.num_drafts]
        return outputs, probs

    def _load(
        self, num_requests: int, size: int, sampling_metadata: SamplingMetadata | None
    ) -> None:
        """Pad the fixed inputs past ``num_requests`` up to ``size``; write the temperatures."""
        if num_requests < size:
            self._anchor_tokens[num_requests:size].zero_()
            self._pad(num_requests, size)
        if sampling_metadata is not None:
            assert self.sampler is not None
            self.sampler.write(sampling_metadata, num_requests, size)

    def _sample(self, sampled: bool, size: int) -> PositionSampler:
        """The per-position sampler of a ``size`` graph; inside it, before its first position."""
        return self.sampler.begin(size) if sampled and self.sampler is not None else greedy_sample

    @abstractmethod
    def _pad(self, num_requests: int, size: int) -> None:
        """Fill the subclass's fixed inputs past ``num_requests`` up to ``size``."""

    @abstractmethod
    def _run(self, size: int, sampled: bool) -> tuple[torch.Tensor, ...]:
        """The stage on the first ``size`` rows of the fixed inputs: ``[size, ...]`` outputs."""

    def _context(self, size: int, mode: CUDAGraphMode):
        return set_forward_context(
            None,
            self._vllm_config,
            num_tokens=size * self.num_drafts,
            cudagraph_runtime_mode=mode,
            batch_descriptor=BatchDescriptor(num_tokens=size),
        )


class DraftGraphs(RequestGraphs):
    """The ring draft's block step (``BlockDrafter.draft``: ring read, stages, Markov chain,
    confidence head) per padded request count; rows past the batch draft from the scratch
    slot."""

    stage = "block step"

    def __init__(
        self,
        drafter: BlockDrafter,
        vllm_config: VllmConfig,
        sizes: list[int],
        num_drafts: int,
        with_confidence: bool,
        sample_from_logits: SampleFromLogits | None = None,
    ) -> None:
        device = drafter.ring.tags.device
        super().__init__(
            vllm_config, sizes, num_drafts, device, sample_from_logits, drafter.draft_probs
        )
        self._drafter = drafter
        self._with_confidence = with_confidence
        largest = self.sizes[-1]
        self._slots = torch.full((largest,), drafter.scratch_slot, dtype=torch.int64, device=device)
        self._anchors = torch.zeros(largest, dtype=torch.int64, device=device)

    def draft(
        self,
        slots: torch.Tensor,
        anchors: torch.Tensor,
        anchor_tokens: torch.Tensor,
        size: int,
        sampling_metadata: SamplingMetadata | None = None,
    ) -> DraftOutput:
        """``BlockDrafter.draft`` of ``len(slots)`` requests by replaying the ``size`` graph:
        greedy, or with ``sampling_metadata`` sampled at its temperatures."""
        num_requests = slots.shape[0]
        self._slots[:num_requests].copy_(slots)
        self._anchors[:num_requests].copy_(anchors)
        outputs, probs = self._replay(anchor_tokens, size, sampling_metadata)
        return DraftOutput(
            token_ids=outputs[0],
            confidence=outputs[1] if self._with_confidence else None,
            anchors=anchors,
            probs=probs,
        )

    @override
    def _pad(self, num_requests: int, size: int) -> None:
        self._slots[num_requests:size].fill_(self._drafter.scratch_slot)
        self._anchors[num_requests:size].zero_()

    @override
    def _run(self, size: int, sampled: bool) -> tuple[torch.Tensor, ...]:
        output = self._drafter.draft(
            self._slots[:size],
            self._anchors[:size],
            self._anchor_tokens[:size],
            self.num_drafts,
            with_confidence=self._with_confidence,
            sample=self._sample(sampled, size),
        )
        if output.confidence is None:
            return (output.token_ids,)
        return output.token_ids, output.confidence


DraftChain = Callable[
    [torch.Tensor, torch.Tensor, PositionSampler],
    tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
]
"""``(hidden [B * k, H], anchor_tokens [B], sample) -> (drafts [B, k], confidence [B, k] or
None, distributions or None)``: the paged proposer's stage after the draft forward."""


class ChainGraphs(RequestGraphs):
    """The paged draft's stage after upstream's piecewise-graphed forward (base logits of the
    block's sampled rows, the Markov chain, the confidence head) per padded request count. Its
    input is the forward's sampled hidden states, copied into ``hidden``: a ``[max requests *
    k, H]`` buffer the proposer allocates before vLLM's memory profile; padding rows are
    zero."""

    stage = "Markov chain"

    def __init__(
        self,
        chain: DraftChain,
        hidden: torch.Tensor,
        vllm_config: VllmConfig,
        sizes: list[int],
        num_drafts: int,
        sample_from_logits: SampleFromLogits | None = None,
        draft_probs: torch.Tensor | None = None,
    ) -> None:
        super().__init__(
            vllm_config, sizes, num_drafts, hidden.device, sample_from_logits, draft_probs
        )
        self._chain = chain
        self._hidden = hidden

    def draft(
        self,
        hidden_states: torch.Tensor,
        anchor_tokens: torch.Tensor,
        size: int,
        sampling_metadata: SamplingMetadata | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The chain of ``len(anchor_tokens)`` requests by replaying the ``size`` graph."""
        self._hidden[: hidden_states.shape[0]].copy_(hidden_states)
        outputs, probs = self._replay(anchor_tokens, size, sampling_metadata)
        return outputs[0], outputs[1] if len(outputs) > 1 else None, probs

    @override
    def _pad(self, num_requests: int, size: int) -> None:
        self._hidden[num_requests * self.num_drafts : size * self.num_drafts].zero_()

    @override
    def _run(self, size: int, sampled: bool) -> tuple[torch.Tensor, ...]:
        drafts, confidence, _ = self._chain(
            self._hidden[: size * self.num_drafts],
            self._anchor_tokens[:size],
            self._sample(sampled, size),
        )
        return (drafts,) if confidence is None else (drafts, confidence)


def graph_and_eager_drafts_agree(proposer) -> dict[int, bool]:
    """For each captured size: whether replaying its greedy graph drafts exactly what the eager
    draft does for the same inputs (the scratch slot, distinct anchors and anchor tokens). A
    GPU self-test calls this on a loaded ``DSparkRingProposer`` after the runner captured its
    graphs; it writes nothing but the scratch slot's block buffers."""
    return _agreement(proposer, sampled=False, seed=0)


def sampled_graph_and_eager_drafts_agree(proposer, seed: int) -> dict[int, bool]:
    """As ``graph_and_eager_drafts_agree`` for the sampled graphs, at temperature 0.8: both
    drafts drawn from the generator reseeded with ``seed``, tokens and distributions compared.
    It also writes the distributions buffer."""
    return _agreement(proposer, sampled=True, seed=seed)


def _agreement(proposer, sampled: bool, seed: int) -> dict[int, bool]:
    graphs, drafter = proposer.draft_graphs, proposer._drafter
    assert graphs is not None and drafter is not None, "no draft graphs were captured"
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
                temperature=torch.full((size,), 0.8, device=device),
                all_greedy=False,
                all_random=True,
            )
            sample = functools.partial(proposer._sample_from_logits, sampling_metadata=metadata)
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
