# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DSpark for DeepSeek-V4 on V1, with the draft context kept by the proposer itself.

A per-request ring of projected target positions ("ring"), addressed through a
request-stable slot table so that V1's row reordering and condensing can never
hand one request another's window. It subclasses ``EagleProposer`` because the
V1 runner already treats ``dspark`` as an EAGLE-family method: it hands the
drafter the tapped target features, next tokens and rejected-row counts.

The draft step's tensors stay on the device (slots are uploaded from a fresh
pinned host tensor per step, without a sync). On CUDA the block draft (ring read, stages,
Markov chain, greedy or sampled) replays FULL CUDA graphs captured per padded
request count (``cudagraph.DraftGraphs``); the context write and the slot table
stay eager, on the host side of the graph.
"""

from contextlib import nullcontext

import torch
from torch import nn
from typing_extensions import override

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.utils import (
    get_draft_load_config,
    process_weights_after_loading,
)
from vllm.platforms import current_platform
from vllm.utils.torch_utils import async_tensor_h2d, set_default_torch_dtype
from vllm.v1.attention.backends.utils import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.dspark.cudagraph import DraftGraphs, draft_graph_sizes
from vllm.v1.spec_decode.dspark.deepseek_v4.draft import (
    build_deepseek_v4_draft_model,
    load_deepseek_v4_draft,
)
from vllm.v1.spec_decode.dspark.deepseek_v4.loader import checkpoint_draft_tensors
from vllm.v1.spec_decode.dspark.draft_model import DSparkRingDraft
from vllm.v1.spec_decode.dspark.drafter import BlockDrafter
from vllm.v1.spec_decode.dspark.markov import greedy_sample, plain_markov_weights
from vllm.v1.spec_decode.dspark.proposer_base import DSparkProposerMixin, reads_checkpoint
from vllm.v1.spec_decode.dspark.refusal import records_refusal
from vllm.v1.spec_decode.dspark.ring import ContextRing
from vllm.v1.spec_decode.dspark.slot_table import SlotTable
from vllm.v1.spec_decode.dspark.spec import draft_spec
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
        spec = draft_spec(vllm_config)
        assert spec.deepseek_v4 is not None, "the ring proposer runs DeepSeek-V4 drafts"
        super().__init__(vllm_config, device, runner)
        self._init_dspark(spec, runner)
        self._slot_table = SlotTable(self.max_batch_size)
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
            fresh = async_tensor_h2d(assignment.fresh, self.device, dtype=torch.int64)
            self._drafter.ring.invalidate(fresh)
        return assignment.slots

    def release_request(self, req_id: str) -> None:
        """The runner calls this when a request finishes or is aborted."""
        self._slot_table.release(req_id)

    # Model ------------------------------------------------------------------
    @override
    @records_refusal
    def load_model(self, target_model: nn.Module) -> None:
        model = self._build_draft_model()
        if self.device.type != "meta":  # built without memory: no weights to process
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
            sample_from_anchor=self.spec.samples_from_anchor,
            draft_topk=self.options.draft_topk,
            markov_bias_gathered=model.markov_head.apply_bias_gathered,
            draft_probs=draft_probs,
            markov_weights=plain_markov_weights(model.markov_head, model.logits_processor),
        )
        ring_mib = ring.values.numel() * ring.values.element_size() / 2**20
        logger.info(
            "DSpark V1 proposer: %s, window %d, %d slots, ring %.1f MiB, k=%d.",
            type(backbone).__name__,
            backbone.window,
            self._slot_table.capacity,
            ring_mib,
            self.num_speculative_tokens,
        )

    def _build_draft_model(self) -> DSparkRingDraft:
        """Build the draft from vLLM's DeepSeek-V4 modules and load it strictly, as shipped
        (or with the loader's own values when the load format reads no checkpoint,
        ``reads_checkpoint``)."""
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
        if reads_checkpoint(loader):
            weights = checkpoint_draft_tensors(loader, self.draft_model_config)
            load_deepseek_v4_draft(model, weights, self.draft_model_config.hf_config)
        else:
            loader.load_weights(model, self.draft_model_config)
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
        """Plan the draft's graphs from the runner's final capture sizes (the runner calls this
        after resolving them). No keys for EAGLE's token-count dispatcher: the draft's graphs
        are ``DraftGraphs``, keyed by padded request count."""
        self.cudagraph_dispatcher.initialize_cudagraph_keys(CUDAGraphMode.NONE)
        self.draft_graphs = None
        sizes = draft_graph_sizes(
            self.vllm_config, cudagraph_mode, current_platform.is_cuda_alike()
        )
        if self._drafter is None or not sizes:
            return
        self.draft_graphs = DraftGraphs(
            self._drafter,
            self.vllm_config,
            sizes,
            self.num_speculative_tokens,
            with_confidence=self.options.scheduling.needs_confidence,
            sample_from_logits=self._sample_from_logits if self.options.probabilistic else None,
        )

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
        # The draft's graphs are FULL graphs of their own: captured at the first call of any of
        # the runner's capture passes, whatever ``use_cudagraphs`` says (which is False outside
        # its PIECEWISE pass, for EAGLE's piecewise graphs).
        if is_graph_capturing and self.draft_graphs is not None:
            self.draft_graphs.capture_missing(self._runner.input_batch.sampling_metadata)

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
        common_attn_metadata: CommonAttentionMetadata,
        sampling_metadata: SamplingMetadata,
        mm_embed_inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        assert self._drafter is not None, "load_model() must run before propose()"
        req_ids = self._runner.input_batch.req_ids
        live_requests = self._runner.requests
        if len(self._slot_table.req_id_to_slot) > len(live_requests):
            # Safety net for finishes the release hook did not see.
            self._slot_table.reconcile(live_requests.keys())
        num_requests = len(req_ids)
        # A fresh pinned host tensor per step, copied without a sync (vLLM's async_tensor_h2d),
        # as the runner does where it cannot guard a buffer: under async scheduling the next
        # step's host code runs before this copy has executed, and would rewrite a reused
        # buffer under it (the draft would then write and read another step's slots).
        slots = self._row_to_slot(req_ids)
        request_slots = async_tensor_h2d(slots, self.device, dtype=torch.int64)

        sample = self._position_sampler(sampling_metadata)
        sampled = sample is not greedy_sample
        step_inputs = (
            request_slots,
            target_hidden_states,
            target_positions.long(),
            common_attn_metadata.query_start_loc[: num_requests + 1],
            num_rejected_tokens_gpu,
        )
        anchor_tokens = next_token_ids[:num_requests]
        size = self._graph_size(num_requests, num_speculative_tokens, sampled)
        self._draft_cudagraph_mode = CUDAGraphMode.NONE if size is None else CUDAGraphMode.FULL
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
            output = self.draft_graphs.draft(
                request_slots,
                anchors,
                anchor_tokens,
                size,
                sampling_metadata if sampled else None,
            )
        # Read by the runner (take_last_draft_probs) for rejection sampling.
        self._last_draft_probs = output.probs
        if output.confidence is not None:
            self._schedule(output.confidence, num_speculative_tokens)
        if self.options.draft_log is not None:
            self._log_drafts(output.anchors, anchor_tokens, output.token_ids)
        return output.token_ids

    def _graph_size(self, num_requests: int, num_drafts: int, sampled: bool) -> int | None:
        """The captured draft graph this step replays, or None to draft eagerly."""
        graphs = self.draft_graphs
        if graphs is None or num_drafts != graphs.num_drafts:
            return None
        return graphs.padded_size(num_requests, sampled)


def _profile_sampler(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands in for vLLM's probabilistic draft sampler in the profile run: a ``[B, V]`` float32
    distribution per position, written to the proposer's buffer like the real ones."""
    probs = logits.float().softmax(dim=-1)
    return probs.argmax(dim=-1), probs
