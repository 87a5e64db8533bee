# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DSpark for DeepSeek-V4 on V1, with the draft context kept by the proposer itself.

A per-request ring of projected target positions ("ring"), addressed through a
request-stable slot table so that V1's row reordering and condensing can never
hand one request another's window. It subclasses ``EagleProposer`` because the
V1 runner already treats ``dspark`` as an EAGLE-family method: it hands the
drafter the tapped target features, next tokens and rejected-row counts.

The draft step's tensors stay on the device (slots are uploaded from fresh
pinned host memory without a sync). On CUDA the block draft (ring read, stages,
Markov chain) replays FULL CUDA graphs captured per padded request count
(``DraftGraphs``); the context write and the slot table stay eager, on the host
side of the graph.
"""

import bisect
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch import nn
from typing_extensions import override

from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import BatchDescriptor, set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.utils import (
    get_draft_load_config,
    process_weights_after_loading,
)
from vllm.platforms import current_platform
from vllm.utils.platform_utils import is_pin_memory_available
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.attention.backends.utils import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.dspark.block import trained_block_size
from vllm.v1.spec_decode.dspark.checks import DEEPSEEK_V4_UNSUPPORTED, RING_PROPOSER_UNSUPPORTED
from vllm.v1.spec_decode.dspark.deepseek_v4.draft import (
    build_deepseek_v4_draft_model,
    load_deepseek_v4_draft,
)
from vllm.v1.spec_decode.dspark.deepseek_v4.loader import checkpoint_draft_tensors
from vllm.v1.spec_decode.dspark.draft_model import DSparkRingDraft
from vllm.v1.spec_decode.dspark.drafter import BlockDrafter, DraftOutput
from vllm.v1.spec_decode.dspark.family import draft_family
from vllm.v1.spec_decode.dspark.markov import greedy_sample
from vllm.v1.spec_decode.dspark.proposer_base import DSparkProposerMixin
from vllm.v1.spec_decode.dspark.ring import ContextRing
from vllm.v1.spec_decode.dspark.slot_table import SlotTable
from vllm.v1.spec_decode.eagle import EagleProposer

logger = init_logger(__name__)

# EAGLE's per-token input buffers; the ring draft reads the runner's tensors and its own
# block buffers instead (the hidden-states one alone is max_num_tokens x hidden per rank).
_UNUSED_BASE_BUFFERS = (
    "input_ids",
    "positions",
    "hidden_states",
    "inputs_embeds",
    "is_rejected_token_mask",
    "is_masked_token_mask",
    "_slot_mapping_buffer",
)


def draft_graph_sizes(vllm_config: VllmConfig, max_num_requests: int, on_cuda: bool) -> list[int]:
    """Request counts whose block draft is captured in a CUDA graph: the runner's capture sizes
    up to ``max_num_requests``. None with ``speculative_config.enforce_eager=True``, with a target
    that captures no graphs (``enforce_eager``, ``cudagraph_mode`` NONE) or off CUDA."""
    enforce_eager = vllm_config.speculative_config.enforce_eager
    mode = vllm_config.compilation_config.cudagraph_mode
    if enforce_eager or not on_cuda or mode is None or mode == CUDAGraphMode.NONE:
        return []
    sizes = vllm_config.compilation_config.cudagraph_capture_sizes or []
    return sorted({size for size in sizes if size <= max_num_requests})


class DraftGraphs:
    """FULL CUDA graphs of ``BlockDrafter.draft`` per padded request count, captured and replayed
    by vLLM's ``CUDAGraphWrapper`` (as vLLM's own graphs are, keyed by a ``BatchDescriptor``).

    The graph reads fixed buffers (slots, anchors, anchor tokens); rows past the batch draft from
    the scratch slot and are dropped. Only greedy drafts replay: a probabilistic sampler reads
    per-step sampling metadata that a graph would freeze at capture.
    """

    def __init__(
        self,
        drafter: BlockDrafter,
        vllm_config: VllmConfig,
        sizes: list[int],
        num_drafts: int,
        with_confidence: bool,
    ) -> None:
        self.sizes = sorted(sizes)
        self.num_drafts = num_drafts
        self._drafter = drafter
        self._vllm_config = vllm_config
        self._with_confidence = with_confidence
        device, largest = drafter.ring.tags.device, self.sizes[-1]
        self._slots = torch.full((largest,), drafter.scratch_slot, dtype=torch.int64, device=device)
        self._anchors = torch.zeros(largest, dtype=torch.int64, device=device)
        self._anchor_tokens = torch.zeros(largest, dtype=torch.int64, device=device)
        self._graph = CUDAGraphWrapper(self._draft_from_buffers, vllm_config, CUDAGraphMode.FULL)

    @property
    def captured(self) -> set[int]:
        """Sizes the wrapper holds a graph for. vLLM's CUDA-graph memory profile captures and
        then clears every wrapper's graphs; the runner's capture pass captures them again."""
        return {
            descriptor.num_tokens
            for descriptor, entry in self._graph.concrete_cudagraph_entries.items()
            if entry.cudagraph is not None
        }

    def padded_size(self, num_requests: int) -> int | None:
        """The captured size a batch of ``num_requests`` replays; None: it runs eagerly."""
        index = bisect.bisect_left(self.sizes, num_requests)
        if index == len(self.sizes) or self.sizes[index] not in self.captured:
            return None
        return self.sizes[index]

    def capture(self, size: int) -> None:
        """Capture the draft of ``size`` requests (inside the runner's graph-capture pass)."""
        with self._context(size):
            self._graph(size)

    def draft(
        self, slots: torch.Tensor, anchors: torch.Tensor, anchor_tokens: torch.Tensor, size: int
    ) -> DraftOutput:
        """``BlockDrafter.draft`` of ``len(slots)`` requests by replaying the ``size`` graph."""
        num_requests = slots.shape[0]
        self._slots[:num_requests].copy_(slots)
        self._slots[num_requests:size].fill_(self._drafter.scratch_slot)
        for buffer, values in ((self._anchors, anchors), (self._anchor_tokens, anchor_tokens)):
            buffer[:num_requests].copy_(values)
            buffer[num_requests:size].zero_()
        with self._context(size):
            # The next replay overwrites the graph's outputs; the runner may still read these.
            outputs = [t[:num_requests].clone() for t in self._graph(size)]
        confidence = outputs[1] if self._with_confidence else None
        return DraftOutput(token_ids=outputs[0], confidence=confidence, anchors=anchors)

    def _draft_from_buffers(self, size: int) -> tuple[torch.Tensor, ...]:
        output = self._drafter.draft(
            self._slots[:size],
            self._anchors[:size],
            self._anchor_tokens[:size],
            self.num_drafts,
            with_confidence=self._with_confidence,
        )
        if output.confidence is None:
            return (output.token_ids,)
        return output.token_ids, output.confidence

    def _context(self, size: int):
        return set_forward_context(
            None,
            self._vllm_config,
            num_tokens=size * self.num_drafts,
            cudagraph_runtime_mode=CUDAGraphMode.FULL,
            batch_descriptor=BatchDescriptor(num_tokens=size),
        )


def graph_and_eager_drafts_agree(proposer: "DSparkRingProposer") -> dict[int, bool]:
    """For each captured size: whether replaying its graph drafts exactly what the eager draft
    does for the same inputs (the scratch slot, distinct anchors and anchor tokens). A GPU
    self-test calls this on a loaded proposer after the runner captured its graphs; it writes
    nothing but the scratch slot's block buffers."""
    graphs, drafter = proposer.draft_graphs, proposer._drafter
    assert graphs is not None and drafter is not None, "no draft graphs were captured"
    agree = {}
    for size in sorted(graphs.captured):
        device = drafter.ring.tags.device
        slots = torch.full((size,), drafter.scratch_slot, dtype=torch.int64, device=device)
        anchors = torch.arange(size, dtype=torch.int64, device=device) * 7
        anchor_tokens = torch.arange(size, dtype=torch.int64, device=device) + 1
        with proposer._draft_context(size):
            eager = drafter.draft(slots, anchors, anchor_tokens, graphs.num_drafts)
        replayed = graphs.draft(slots, anchors, anchor_tokens, size)
        agree[size] = bool(torch.equal(eager.token_ids, replayed.token_ids))
    return agree


def upload_slots(slots: Sequence[int], device: torch.device) -> torch.Tensor:
    """Slot ids on ``device`` from a fresh pinned host tensor, copied without a sync.

    Fresh per call, as the runner does where it cannot guard a buffer: under async scheduling
    the next step's host code runs before this copy has executed, and would rewrite a reused
    buffer under it (the draft would then write and read another step's slots).
    """
    host = torch.tensor(slots, dtype=torch.int64, pin_memory=is_pin_memory_available())
    return host.to(device, non_blocking=True)


class DSparkRingProposer(DSparkProposerMixin, EagleProposer):
    """DSpark for DeepSeek-V4 checkpoints (``mtp.*`` stages, sliding window W): the draft
    context is a per-request ring of projected target positions behind a request-stable slot
    table."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        device: torch.device,
        runner=None,
    ) -> None:
        # Before the base class, whose first complaint about a wrong checkpoint
        # would be a missing mask token.
        draft_config = vllm_config.speculative_config.draft_model_config
        if draft_family(draft_config) != "deepseek_v4":
            raise ValueError(
                f"DSparkRingProposer serves DeepSeek-V4 DSpark checkpoints only; "
                f"'{draft_config.model}' is not one. Qwen3 DSpark drafts use the paged proposer."
            )
        super().__init__(vllm_config, device, runner)
        assert self.method == "dspark"
        self._init_dspark(
            vllm_config, runner, {**RING_PROPOSER_UNSUPPORTED, **DEEPSEEK_V4_UNSUPPORTED}
        )
        self._slot_table = SlotTable(self.max_batch_size)
        # Short names for the table's state (the same dict and heap list).
        self._req_id_to_slot = self._slot_table.req_id_to_slot
        self._free_slots = self._slot_table.free_slots
        for name in _UNUSED_BASE_BUFFERS:
            buffer = getattr(self, name, None)
            if buffer is not None:
                setattr(self, name, buffer.new_empty((0, *buffer.shape[1:])))
        self.model: DSparkRingDraft | None = None
        self._drafter: BlockDrafter | None = None
        self.draft_graphs: DraftGraphs | None = None

    # Slot table ---------------------------------------------------------------
    def _row_to_slot(self, req_ids: list[str]) -> list[int]:
        """Slot of ``req_ids[i]`` at index i; windows of slots that changed
        owner are invalidated before anything reads them."""
        assignment = self._slot_table.assign(req_ids)
        if assignment.fresh:
            assert self._drafter is not None
            self._drafter.ring.invalidate(upload_slots(assignment.fresh, self.device))
        return assignment.slots

    def release_request(self, req_id: str) -> None:
        """The runner calls this when a request finishes or is aborted."""
        self._slot_table.release(req_id)

    # Model ------------------------------------------------------------------
    @override
    def load_model(self, target_model: nn.Module) -> None:
        model = self._build_draft_model()
        process_weights_after_loading(model, self.draft_model_config, self.device)
        model.share_target(target_model)
        self._check_confidence_head(model.confidence_head is not None)
        self.model = model

        backbone = model.backbone
        ring = ContextRing(
            num_slots=self._slot_table.capacity + 1,
            window=backbone.window,
            entry_shape=backbone.ring_entry_shape,
            dtype=self.draft_model_config.dtype,
            device=self.device,
        )
        # Allocated before vLLM's memory profile, and touched by dummy_run.
        draft_probs = self._new_draft_probs()
        self._drafter = BlockDrafter(
            backbone,
            model,
            ring,
            noise_token_id=self.parallel_drafting_token_id,
            max_position=self.max_model_len - 1,
            max_num_drafts=self.num_speculative_tokens,
            sample_from_anchor=getattr(
                self.draft_model_config.hf_config, "sample_from_anchor", True
            ),
            draft_topk=self.options.draft_topk,
            markov_bias_gathered=model.markov_head.apply_bias_gathered,
            draft_probs=draft_probs,
        )
        graph_sizes = draft_graph_sizes(
            self.vllm_config, self.max_batch_size, current_platform.is_cuda_alike()
        )
        if graph_sizes:
            self.draft_graphs = DraftGraphs(
                self._drafter,
                self.vllm_config,
                graph_sizes,
                self.num_speculative_tokens,
                with_confidence=self.options.scheduling.needs_confidence,
            )
        ring_mib = ring.values.numel() * ring.values.element_size() / 2**20
        logger.info(
            "DSpark V1 proposer: %s, window %d, %d slots, ring %.1f MiB, k=%d, draft CUDA "
            "graphs for %s requests.",
            type(backbone).__name__,
            backbone.window,
            self._slot_table.capacity,
            ring_mib,
            self.num_speculative_tokens,
            graph_sizes or "no",
        )

    def _build_draft_model(self) -> DSparkRingDraft:
        """Build the draft from vLLM's DeepSeek-V4 modules and load it strictly, as shipped."""
        config = self.draft_model_config.hf_config
        block_size = trained_block_size(config)
        if block_size and self.num_speculative_tokens < block_size:
            logger.info(
                "DSpark draft trained with block size %d drafts k=%d tokens per step.",
                block_size,
                self.num_speculative_tokens,
            )
        loader = get_model_loader(get_draft_load_config(self.vllm_config))
        # The runner collects JIT warm-ups only while its target is built; the draft's mHC
        # variants join them here (compiled by the worker's kernel warm-up, before serving).
        registry = getattr(self._runner, "jit_warmup_registry", None)
        with (
            registry.activate() if registry is not None else nullcontext(),
            set_current_vllm_config(self.vllm_config),
            set_default_torch_dtype(self.draft_model_config.dtype),
            torch.device(self.device),
        ):
            model = build_deepseek_v4_draft_model(self.vllm_config)
        weights = checkpoint_draft_tensors(loader, self.draft_model_config)
        load_deepseek_v4_draft(model, weights, config)
        return model

    # Runner hooks -------------------------------------------------------------
    @override
    def initialize_attn_backend(
        self, kv_cache_config: KVCacheConfig, kernel_block_sizes: list[int] | None = None
    ) -> None:
        """The draft attends over the ring, not the paged cache: no backend or
        KV-cache group of its own. Group 0's metadata carries the batch layout
        (``query_start_loc``) the step needs."""
        self.kv_cache_gid = 0

    @override
    def initialize_cudagraph_keys(self, cudagraph_mode: CUDAGraphMode) -> None:
        """No keys for EAGLE's token-count dispatcher: the draft's graphs are ``DraftGraphs``,
        keyed by padded request count."""
        self.cudagraph_dispatcher.initialize_cudagraph_keys(CUDAGraphMode.NONE)

    @override
    @torch.inference_mode()
    def dummy_run(
        self,
        num_tokens: int,
        use_cudagraphs: bool = True,
        is_graph_capturing: bool = False,
        slot_mappings: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Run a whole draft step on the scratch slot so that memory profiling
        sees its activations: the context write of ``num_tokens`` target rows
        (``max_num_batched_tokens`` in the profile run), the block forward of
        up to ``max_num_seqs`` requests and, for probabilistic drafts, their
        distributions. Real slots are never touched."""
        if self._drafter is None:
            return
        num_tokens = max(1, num_tokens)
        num_requests = min(self.max_batch_size, num_tokens)
        device = self.device
        scratch = torch.full(
            (num_requests,), self._slot_table.scratch_slot, dtype=torch.int64, device=device
        )
        features = torch.zeros(
            num_tokens,
            self._drafter.backbone.feature_size,
            dtype=self.draft_model_config.dtype,
            device=device,
        )
        positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        # One row per request; the rest are padding rows, which the ring sends to its dump.
        query_start_loc = torch.arange(num_requests + 1, dtype=torch.int32, device=device)
        anchor_tokens = torch.zeros(num_requests, dtype=torch.int64, device=device)
        with self._draft_context(num_requests):
            self._drafter.step(
                scratch,
                features,
                positions,
                query_start_loc,
                None,
                anchor_tokens,
                self.num_speculative_tokens,
                with_confidence=self.options.scheduling.needs_confidence,
                sample=_profile_sampler if self._drafter.draft_probs is not None else greedy_sample,
            )
        graphs = self.draft_graphs
        if (
            is_graph_capturing
            and use_cudagraphs
            and graphs is not None
            and num_tokens in graphs.sizes
            and num_tokens not in graphs.captured
        ):
            graphs.capture(num_tokens)

    def _draft_context(self, num_requests: int):
        """vLLM's fused MoE layers look themselves up in the forward context."""
        return set_forward_context(
            None, self.vllm_config, num_tokens=num_requests * self.num_speculative_tokens
        )

    @override
    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        sampling_metadata: SamplingMetadata,
        common_attn_metadata: CommonAttentionMetadata,
        mm_embed_inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        assert self._drafter is not None, "load_model() must run before propose()"
        req_ids = self._runner.input_batch.req_ids
        live_requests = self._runner.requests
        if len(self._req_id_to_slot) > len(live_requests):
            # Safety net for finishes the release hook did not see.
            self._slot_table.reconcile(live_requests.keys())
        num_requests = len(req_ids)
        request_slots = upload_slots(self._row_to_slot(req_ids), self.device)

        sample = self._position_sampler(sampling_metadata)
        step_inputs = (
            request_slots,
            target_hidden_states,
            target_positions.long(),
            common_attn_metadata.query_start_loc[: num_requests + 1],
            num_rejected_tokens_gpu,
        )
        anchor_tokens = next_token_ids[:num_requests]
        size = self._graph_size(num_requests, num_speculative_tokens, sample)
        if size is None:
            with self._draft_context(num_requests):
                output = self._drafter.step(
                    *step_inputs,
                    anchor_tokens,
                    num_speculative_tokens,
                    with_confidence=self.options.scheduling.needs_confidence,
                    sample=sample,
                )
        else:
            assert self.draft_graphs is not None
            with self._draft_context(num_requests):
                anchors = self._drafter.write_context(*step_inputs)
            output = self.draft_graphs.draft(request_slots, anchors, anchor_tokens, size)
        # Read by the runner (take_last_draft_probs) for rejection sampling.
        self._last_draft_probs = output.probs
        if output.confidence is not None:
            self._schedule(output.confidence, num_speculative_tokens)
        if self.options.draft_log is not None:
            self._log_drafts(output.anchors, anchor_tokens, output.token_ids)
        return output.token_ids

    def _graph_size(self, num_requests: int, num_drafts: int, sample) -> int | None:
        """The captured draft graph this step replays, or None to draft eagerly."""
        graphs = self.draft_graphs
        if graphs is None or sample is not greedy_sample or num_drafts != graphs.num_drafts:
            return None
        return graphs.padded_size(num_requests)


def _profile_sampler(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands in for vLLM's probabilistic draft sampler in the profile run: a ``[B, V]`` float32
    distribution per position, written to the proposer's buffer like the real ones."""
    probs = logits.float().softmax(dim=-1)
    return probs.argmax(dim=-1), probs
