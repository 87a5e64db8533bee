# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FULL CUDA graphs of the DSpark draft step, one per padded request count: the ring draft's
block step (``DraftGraphs``) and the paged draft's stage after its forward (``ChainGraphs``;
the forward itself replays upstream DFlash's piecewise graphs). Both proposers hold theirs as
``draft_graphs``.

The V1 runner loads the drafter before it resolves its CUDA-graph mode and capture sizes
(``resolve_cudagraph_mode_and_sizes`` rounds them to multiples of k + 1), then calls the
drafter's ``initialize_cudagraph_keys``: the draft plans its graphs there, from the final
sizes. The runner hands the drafter ``use_cudagraphs=True`` only in its PIECEWISE capture
pass (EAGLE's drafters capture piecewise graphs); these graphs are FULL graphs of their own,
captured at the first call of any capture pass, so every cudagraph mode that captures the
target captures them. Their request counts follow the target's decode graphs: a decode batch
of n requests pads to the target graph that holds it, its draft to the same request count.

A graph replays greedy or sampled drafts: per-request temperatures sit in a fixed buffer
written before replay, and vLLM's draft sampler (or the fused chain's seed) draws from the
default generator, which CUDA graphs advance on every replay.
"""

import bisect
import dataclasses
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from typing_extensions import override

from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import BatchDescriptor, set_forward_context
from vllm.logger import init_logger
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import _SAMPLING_EPS
from vllm.v1.spec_decode.dspark.drafter import BlockDrafter, DraftOutput
from vllm.v1.spec_decode.dspark.markov import DraftSampler, SampledDrafts, greedy_sample

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
    as the sampler's general path does. Padding rows sample at temperature 1 and are dropped.
    The fused chain reads the temperatures as written and applies the threshold itself."""

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
    the stage on them (``_run``); rows past the batch are padding and are dropped. The graphs
    write their drafts in place into one ``[max requests, k]`` buffer and sampled graphs their
    distributions into the proposer's ``draft_probs`` buffer, as the eager step does.

    The runner reads the drafts in the next step's inputs and copies them to the host on its
    own stream. Without async scheduling it waits for that copy before the next step, so the
    next replay cannot overwrite them first and a view of the buffer is handed out; under async
    scheduling nothing orders that copy before the next replay, so the drafts are cloned.
    Other outputs (the confidences) are read in the step that drafted them and never cloned.
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
        self._draft_tokens = torch.zeros(largest, num_drafts, dtype=torch.int64, device=device)
        self._clone_drafts = vllm_config.scheduler_config.async_scheduling
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
            descriptor.num_reqs
            for descriptor, entry in self._graphs[sampled].concrete_cudagraph_entries.items()
            if entry.cudagraph is not None and descriptor.num_reqs is not None
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
        self, num_requests: int, size: int, sampling_metadata: SamplingMetadata | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Replay the ``size`` graph for ``num_requests`` requests whose inputs the subclass
        wrote: their drafts, confidences (or None) and the distributions of sampled drafts."""
        self._load(num_requests, size, sampling_metadata)
        sampled = sampling_metadata is not None
        with self._context(size, CUDAGraphMode.FULL):
            replayed = self._graphs[sampled](size)
        assert replayed is not None
        confidence = [t[:num_requests] for t in replayed]
        drafts = self._draft_tokens[:num_requests]
        probs = None
        if sampled:
            assert self._draft_probs is not None
            probs = self._draft_probs[:num_requests, : self.num_drafts]
        drafts = drafts.clone() if self._clone_drafts else drafts
        return drafts, confidence[0] if confidence else None, probs

    def _load(
        self, num_requests: int, size: int, sampling_metadata: SamplingMetadata | None
    ) -> None:
        """Pad the fixed inputs past ``num_requests`` up to ``size``; write the temperatures."""
        if num_requests < size:
            self._pad(num_requests, size)
        if sampling_metadata is not None:
            assert self.sampler is not None
            self.sampler.write(sampling_metadata, num_requests, size)

    def _sample(self, sampled: bool, size: int) -> DraftSampler:
        """How a ``size`` graph picks its drafts: at the fixed temperatures when sampled."""
        if not sampled or self.sampler is None:
            return greedy_sample
        return SampledDrafts(self.sampler.temperature[:size], self.sampler.begin)

    @abstractmethod
    def _pad(self, num_requests: int, size: int) -> None:
        """Fill the subclass's fixed inputs past ``num_requests`` up to ``size``."""

    @abstractmethod
    def _run(self, size: int, sampled: bool) -> tuple[torch.Tensor, ...]:
        """The stage on the first ``size`` rows of the fixed inputs, drafts written into
        ``_draft_tokens``: the ``[size, k]`` confidences, or nothing."""

    def _context(self, size: int, mode: CUDAGraphMode):
        return set_forward_context(
            None,
            self._vllm_config,
            num_tokens=size * self.num_drafts,
            cudagraph_runtime_mode=mode,
            batch_descriptor=BatchDescriptor(
                num_tokens=size * self.num_drafts, num_reqs=size, uniform=True
            ),
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
        self._anchor_tokens = torch.zeros(largest, dtype=torch.int64, device=device)

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
        self._anchor_tokens[:num_requests].copy_(anchor_tokens)
        drafts, confidence, probs = self._replay(num_requests, size, sampling_metadata)
        return DraftOutput(token_ids=drafts, confidence=confidence, anchors=anchors, probs=probs)

    @override
    def _pad(self, num_requests: int, size: int) -> None:
        self._slots[num_requests:size].fill_(self._drafter.scratch_slot)
        self._anchors[num_requests:size].zero_()
        self._anchor_tokens[num_requests:size].zero_()

    @override
    def _run(self, size: int, sampled: bool) -> tuple[torch.Tensor, ...]:
        output = self._drafter.draft(
            self._slots[:size],
            self._anchors[:size],
            self._anchor_tokens[:size],
            self.num_drafts,
            with_confidence=self._with_confidence,
            sample=self._sample(sampled, size),
            drafts_out=self._draft_tokens,
        )
        return () if output.confidence is None else (output.confidence,)


DraftChain = Callable[
    [torch.Tensor, torch.Tensor, DraftSampler, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
]
"""``(hidden [B * k, H], anchor_tokens [B], sample, drafts_out) -> (drafts [B, k], confidence
[B, k] or None, distributions or None)``: the paged proposer's stage after the draft forward,
writing its drafts into ``drafts_out`` when given."""

AnchorTokens = Callable[[int], torch.Tensor]
"""``size -> [size]`` the anchor tokens of the first ``size`` requests, read from the
proposer's persistent input buffers (valid token ids in padding rows too)."""


class ChainGraphs(RequestGraphs):
    """The paged draft's stage after upstream's piecewise-graphed forward (base logits of the
    block's sampled rows, the Markov chain, the confidence head) per padded request count. Its
    input is the forward's sampled hidden states, copied into ``hidden``: a ``[max requests *
    k, H]`` buffer the proposer allocates before vLLM's memory profile; padding rows are
    zero. The graph reads the anchor tokens itself (``anchor_tokens``), as upstream's Model
    Runner V2 reads its inputs, so nothing is gathered or copied for them before a replay."""

    stage = "Markov chain"

    def __init__(
        self,
        chain: DraftChain,
        hidden: torch.Tensor,
        anchor_tokens: AnchorTokens,
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
        self._anchor_tokens = anchor_tokens

    def draft(
        self,
        hidden_states: torch.Tensor,
        size: int,
        sampling_metadata: SamplingMetadata | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The chain of the ``len(hidden_states) // k`` requests by replaying the ``size``
        graph."""
        self._hidden[: hidden_states.shape[0]].copy_(hidden_states)
        return self._replay(hidden_states.shape[0] // self.num_drafts, size, sampling_metadata)

    @override
    def _pad(self, num_requests: int, size: int) -> None:
        self._hidden[num_requests * self.num_drafts : size * self.num_drafts].zero_()

    @override
    def _run(self, size: int, sampled: bool) -> tuple[torch.Tensor, ...]:
        _, confidence, _ = self._chain(
            self._hidden[: size * self.num_drafts],
            self._anchor_tokens(size),
            self._sample(sampled, size),
            self._draft_tokens,
        )
        return () if confidence is None else (confidence,)
