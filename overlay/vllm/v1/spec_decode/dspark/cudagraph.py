"""FULL CUDA graphs of the ring draft's block step, one per padded request count.

The V1 runner loads the drafter before it resolves its CUDA-graph mode and capture sizes
(``resolve_cudagraph_mode_and_sizes`` rounds them to multiples of k + 1), then calls the
drafter's ``initialize_cudagraph_keys``: the draft plans its graphs there, from the final
sizes. The runner hands the drafter ``use_cudagraphs=True`` only in its PIECEWISE capture
pass (EAGLE's drafters capture piecewise graphs); these graphs are FULL graphs of their own,
captured at the first call of any capture pass, so every cudagraph mode that captures the
target captures them.

A graph replays greedy or sampled drafts: per-request temperatures sit in a fixed buffer
written before replay, and vLLM's draft sampler draws its noise from the default generator,
which CUDA graphs advance on every replay.
"""

import bisect
import copy
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import BatchDescriptor, set_forward_context
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.dspark.drafter import BlockDrafter, DraftOutput
from vllm.v1.spec_decode.dspark.family import draft_family
from vllm.v1.spec_decode.dspark.markov import greedy_sample
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

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
    if speculative_config.enforce_eager or not on_cuda or cudagraph_mode == CUDAGraphMode.NONE:
        return []
    query_len = vllm_config.uniform_decode_query_len
    max_requests = vllm_config.scheduler_config.max_num_seqs
    sizes = vllm_config.compilation_config.cudagraph_capture_sizes or []
    return sorted({size // query_len for size in sizes if 1 <= size // query_len <= max_requests})


class FixedTemperatureSampler:
    """vLLM's draft sampler reading per-request temperatures from a fixed buffer, so that one
    captured graph samples any batch. Both batch flags are off, which takes the sampler's
    general path for every batch: rows below vLLM's greedy threshold take the argmax, as they
    do eagerly in a batch that mixes greedy and sampled requests. Padding rows sample at
    temperature 1 and are dropped."""

    def __init__(
        self, sample_from_logits: SampleFromLogits, max_requests: int, device: torch.device
    ) -> None:
        self._sample_from_logits = sample_from_logits
        self.temperature = torch.ones(max_requests, dtype=torch.float32, device=device)
        self._template: SamplingMetadata | None = None

    def write(self, sampling_metadata: SamplingMetadata, num_requests: int, size: int) -> None:
        """Take the batch's temperatures (rows past ``num_requests`` up to ``size`` pad)."""
        if num_requests:
            assert sampling_metadata.temperature is not None
            self.temperature[:num_requests].copy_(sampling_metadata.temperature[:num_requests])
        self.temperature[num_requests:size].fill_(1.0)
        self._template = sampling_metadata

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._template is not None, "write() must run before sampling"
        metadata = dataclasses.replace(
            self._template,
            temperature=self.temperature[: logits.shape[0]],
            all_greedy=False,
            all_random=False,
        )
        return self._sample_from_logits(logits, metadata)


class DraftGraphs:
    """FULL CUDA graphs of ``BlockDrafter.draft`` per padded request count, captured and replayed
    by vLLM's ``CUDAGraphWrapper`` (keyed by a ``BatchDescriptor``, as vLLM's own graphs are):
    one set for greedy drafts and, with probabilistic drafts, one for sampled ones.

    The graphs read fixed buffers (slots, anchors, anchor tokens, temperatures); rows past the
    batch draft from the scratch slot and are dropped. Sampled graphs write their
    distributions into the drafter's ``draft_probs`` buffer, as the eager draft does.
    """

    def __init__(
        self,
        drafter: BlockDrafter,
        vllm_config: VllmConfig,
        sizes: list[int],
        num_drafts: int,
        with_confidence: bool,
        sample_from_logits: SampleFromLogits | None = None,
    ) -> None:
        """``sample_from_logits``: vLLM's draft sampler, for graphs of sampled drafts too."""
        self.sizes = sorted(sizes)
        self.num_drafts = num_drafts
        self._drafter = drafter
        self._vllm_config = vllm_config
        self._with_confidence = with_confidence
        device, largest = drafter.ring.tags.device, self.sizes[-1]
        self._slots = torch.full((largest,), drafter.scratch_slot, dtype=torch.int64, device=device)
        self._anchors = torch.zeros(largest, dtype=torch.int64, device=device)
        self._anchor_tokens = torch.zeros(largest, dtype=torch.int64, device=device)
        self.sampler = (
            None
            if sample_from_logits is None
            else FixedTemperatureSampler(sample_from_logits, largest, device)
        )
        self._graphs = {
            sampled: CUDAGraphWrapper(
                functools.partial(self._draft_from_buffers, sampled=sampled),
                vllm_config,
                CUDAGraphMode.FULL,
            )
            for sampled in ((False, True) if self.sampler is not None else (False,))
        }

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple("sampled" if sampled else "greedy" for sampled in self._graphs)

    def captured(self, sampled: bool = False) -> list[int]:
        """Sizes the wrapper holds a graph for. vLLM's CUDA-graph memory profile captures and
        then clears every wrapper's graphs; the runner's capture pass captures them again."""
        return sorted(
            descriptor.num_tokens
            for descriptor, entry in self._graphs[sampled].concrete_cudagraph_entries.items()
            if entry.cudagraph is not None
        )

    def padded_size(self, num_requests: int, sampled: bool = False) -> int | None:
        """The smallest captured size that holds ``num_requests``; None: it drafts eagerly."""
        captured = self.captured(sampled)
        index = bisect.bisect_left(captured, num_requests)
        return captured[index] if index < len(captured) else None

    def capture_missing(self, sampling_metadata: SamplingMetadata) -> list[int]:
        """Capture every planned size not captured yet, largest first (smaller graphs reuse its
        memory pool), each after vLLM's number of warm-up runs; inside the runner's
        capture pass. ``sampling_metadata``: any batch's (its fields other than the
        temperatures are not read). Returns the sizes now captured for every variant."""
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
        return sorted(set.intersection(*(set(self.captured(s)) for s in self._graphs)))

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
        self._load(num_requests, size, sampling_metadata)
        sampled = sampling_metadata is not None
        with self._context(size, CUDAGraphMode.FULL):
            # The next replay overwrites the graph's outputs; the runner may still read these.
            outputs = [t[:num_requests].clone() for t in self._graphs[sampled](size)]
        probs = None
        if sampled:
            assert self._drafter.draft_probs is not None
            probs = self._drafter.draft_probs[:num_requests, : self.num_drafts]
        return DraftOutput(
            token_ids=outputs[0],
            confidence=outputs[1] if self._with_confidence else None,
            anchors=anchors,
            probs=probs,
        )

    def _load(
        self, num_requests: int, size: int, sampling_metadata: SamplingMetadata | None
    ) -> None:
        """Pad the fixed inputs past ``num_requests`` up to ``size``; write the temperatures."""
        self._slots[num_requests:size].fill_(self._drafter.scratch_slot)
        self._anchors[num_requests:size].zero_()
        self._anchor_tokens[num_requests:size].zero_()
        if sampling_metadata is not None:
            assert self.sampler is not None
            self.sampler.write(sampling_metadata, num_requests, size)

    def _draft_from_buffers(self, size: int, sampled: bool) -> tuple[torch.Tensor, ...]:
        output = self._drafter.draft(
            self._slots[:size],
            self._anchors[:size],
            self._anchor_tokens[:size],
            self.num_drafts,
            with_confidence=self._with_confidence,
            sample=self.sampler if sampled and self.sampler is not None else greedy_sample,
        )
        if output.confidence is None:
            return (output.token_ids,)
        return output.token_ids, output.confidence

    def _context(self, size: int, mode: CUDAGraphMode):
        return set_forward_context(
            None,
            self._vllm_config,
            num_tokens=size * self.num_drafts,
            cudagraph_runtime_mode=mode,
            batch_descriptor=BatchDescriptor(num_tokens=size),
        )


def graph_and_eager_drafts_agree(proposer, sampled: bool = False) -> dict[int, bool]:
    """For each captured size: whether replaying its graph drafts exactly what the eager draft
    does for the same inputs (the scratch slot, distinct anchors and anchor tokens). With
    ``sampled``: the sampled graphs at temperature 0.8, both drafts drawn from the same
    generator state (reseeded), tokens and distributions compared. A GPU self-test calls this
    on a loaded ``DSparkRingProposer`` after the runner captured its graphs; it writes nothing
    but the scratch slot's block buffers and the distributions buffer."""
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
            torch.manual_seed(size)
            with proposer._draft_context(size):
                eager = drafter.draft(
                    slots, anchors, anchor_tokens, graphs.num_drafts, sample=sample
                )
            eager_probs = None if eager.probs is None else eager.probs.clone()
            torch.manual_seed(size)
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
    draft_mode: CUDAGraphMode
    """FULL: the ring draft's block step; PIECEWISE: the paged draft's forward (upstream
    DFlash's graphs; its Markov chain and confidence head run eagerly); NONE: no graphs."""
    draft: tuple[int, ...]
    """Ring family: request counts; paged family: query tokens of the draft's forward."""
    draft_variants: tuple[str, ...]

    def lines(self) -> list[str]:
        """The plan as a few lines for a start-up report."""
        lines = [f"target cudagraph mode {self.mode.name}"]
        lines += [f"  {mode.name} pass: {list(sizes)} tokens" for mode, sizes in self.target]
        if not self.draft:
            lines.append("draft: no CUDA graphs (every draft step runs eagerly)")
        elif self.draft_mode == CUDAGraphMode.FULL:
            lines.append(
                f"draft: FULL graphs for {list(self.draft)} requests "
                f"({' and '.join(self.draft_variants)} drafts)"
            )
        else:
            lines.append(
                f"draft: {self.draft_mode.name} graphs of the forward for {list(self.draft)} "
                "query tokens; the Markov chain and the confidence head run eagerly"
            )
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
    variants: tuple[str, ...] = ()
    if draft_family(speculative_config.draft_model_config) == "deepseek_v4":
        draft_mode = CUDAGraphMode.FULL
        draft = draft_graph_sizes(vllm_config, mode, on_cuda)
        sampled = speculative_config.draft_sample_method == "probabilistic"
        variants = ("greedy", "sampled") if sampled else ("greedy",)
    else:
        # Upstream's drafter dispatcher; the runner captures its keys in PIECEWISE passes only.
        draft_mode = CUDAGraphMode.PIECEWISE
        drafter = _DrafterKeys(vllm_config)
        SpecDecodeBaseProposer.initialize_cudagraph_keys(drafter, mode)
        runner_passes = {pass_mode for pass_mode, _ in target} if on_cuda else set()
        draft = [
            size
            for pass_mode, sizes in _descriptor_sizes(drafter.cudagraph_dispatcher)
            if pass_mode in runner_passes
            for size in sizes
        ]
    return CapturePlan(
        mode=mode,
        target=target,
        draft_mode=draft_mode if draft else CUDAGraphMode.NONE,
        draft=tuple(sorted(draft)),
        draft_variants=variants if draft else (),
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
