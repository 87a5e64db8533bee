"""DSpark for DeepSeek-V4 on V1, with the draft context kept by the proposer itself.

A per-request ring of projected target positions ("ring"), addressed through a
request-stable slot table so that V1's row reordering and condensing can never
hand one request another's window. It subclasses ``EagleProposer`` because the
V1 runner already treats ``dspark`` as an EAGLE-family method: it hands the
drafter the tapped target features, next tokens and rejected-row counts.

The draft step's tensors stay on the device (slots are uploaded from pinned
host memory without a sync) and its inputs live in persistent buffers, which is
the structure CUDA-graph capture needs; graphs are not captured yet.
"""

import torch
from torch import nn

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.utils import (
    get_draft_load_config,
    process_weights_after_loading,
)
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.attention.backends.utils import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.dspark.deepseek_v4 import (
    build_deepseek_v4_draft_model,
    checkpoint_draft_tensors,
    load_deepseek_v4_draft,
)
from vllm.v1.spec_decode.dspark.draft_log import append_draft_log
from vllm.v1.spec_decode.dspark.draft_model import DSparkDraftModel
from vllm.v1.spec_decode.dspark.drafter import BlockDrafter, DraftOutput
from vllm.v1.spec_decode.dspark.markov import position_sampler
from vllm.v1.spec_decode.dspark.options import (
    DEEPSEEK_V4_UNSUPPORTED,
    RING_PROPOSER_UNSUPPORTED,
    DSparkOptions,
)
from vllm.v1.spec_decode.dspark.ring import ContextRing
from vllm.v1.spec_decode.dspark.scheduling import schedule_lengths
from vllm.v1.spec_decode.dspark.slot_table import SlotTable
from vllm.v1.spec_decode.eagle import EagleProposer
from vllm.v1.utils import CpuGpuBuffer

logger = init_logger(__name__)


class DSparkRingProposer(EagleProposer):
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
        from vllm.v1.spec_decode.dspark_proposer import draft_family

        draft_config = vllm_config.speculative_config.draft_model_config
        if draft_family(draft_config) != "deepseek_v4":
            raise ValueError(
                f"DSparkRingProposer serves DeepSeek-V4 DSpark checkpoints only; "
                f"'{draft_config.model}' is not one. Qwen3 DSpark drafts use the paged proposer."
            )
        super().__init__(vllm_config, device, runner)
        assert self.method == "dspark"
        self._runner = runner
        self.options = DSparkOptions.from_config(
            self.speculative_config,
            async_scheduling=vllm_config.scheduler_config.async_scheduling,
            target_tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
            unsupported={**RING_PROPOSER_UNSUPPORTED, **DEEPSEEK_V4_UNSUPPORTED},
        )
        self._slot_table = SlotTable(self.max_batch_size)
        self._slot_buffer = CpuGpuBuffer(
            self.max_batch_size, dtype=torch.int64, device=device, with_numpy=True
        )
        self._fresh_slot_buffer = CpuGpuBuffer(
            self.max_batch_size, dtype=torch.int64, device=device, with_numpy=True
        )
        self.model: DSparkDraftModel | None = None
        self._drafter: BlockDrafter | None = None
        self._draft_token_lengths: torch.Tensor | None = None

    # Slot table: the seed's API --------------------------------------------
    @property
    def _req_id_to_slot(self) -> dict[str, int]:
        return self._slot_table.req_id_to_slot

    @property
    def _free_slots(self) -> list[int]:
        return self._slot_table.free_slots

    def _row_to_slot(self, req_ids: list[str]) -> list[int]:
        """Slot of ``req_ids[i]`` at index i; windows of slots that changed
        owner are invalidated before anything reads them."""
        assignment = self._slot_table.assign(req_ids)
        if assignment.fresh:
            assert self._drafter is not None
            num_fresh = len(assignment.fresh)
            self._fresh_slot_buffer.np[:num_fresh] = assignment.fresh
            self._drafter.ring.invalidate(self._fresh_slot_buffer.copy_to_gpu(num_fresh))
        return assignment.slots

    def release_request(self, req_id: str) -> None:
        """The runner calls this when a request finishes or is aborted."""
        self._slot_table.release(req_id)

    # Model ------------------------------------------------------------------
    def load_model(self, target_model: nn.Module) -> None:
        model = self._build_draft_model()
        process_weights_after_loading(model, self.draft_model_config, self.device)
        model.share_target(target_model)
        if self.options.scheduling.needs_confidence and model.confidence_head is None:
            raise ValueError(
                f"dspark_confidence_scheduler="
                f"{self.options.scheduling.scheduler!r} needs a draft with a "
                f"confidence head; '{self.draft_model_config.model}' has none."
            )
        self.model = model

        backbone = model.backbone
        ring = ContextRing(
            num_slots=self._slot_table.capacity + 1,
            window=backbone.window,
            entry_shape=backbone.ring_entry_shape,
            dtype=self.draft_model_config.dtype,
            device=self.device,
        )
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

    def _build_draft_model(self) -> DSparkDraftModel:
        """Build the draft from vLLM's DeepSeek-V4 modules and load it strictly, as shipped."""
        config = self.draft_model_config.hf_config
        self._validate_block_size(config)
        loader = get_model_loader(get_draft_load_config(self.vllm_config))
        with (
            set_current_vllm_config(self.vllm_config),
            set_default_torch_dtype(self.draft_model_config.dtype),
            torch.device(self.device),
        ):
            model = build_deepseek_v4_draft_model(self.vllm_config)
        weights = checkpoint_draft_tensors(loader, self.draft_model_config)
        load_deepseek_v4_draft(model, weights, config)
        return model

    def _validate_block_size(self, config) -> None:
        block_size = getattr(config, "block_size", None) or getattr(
            config, "dspark_block_size", None
        )
        if block_size and self.num_speculative_tokens > block_size:
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens} exceeds the "
                f"DSpark draft's trained block size {block_size}: it never learned "
                f"to predict that far. Use num_speculative_tokens <= {block_size}."
            )
        if block_size and self.num_speculative_tokens < block_size:
            logger.info(
                "DSpark draft trained with block size %d drafts k=%d tokens per step.",
                block_size,
                self.num_speculative_tokens,
            )

    # Runner hooks -------------------------------------------------------------
    def initialize_attn_backend(
        self, kv_cache_config: KVCacheConfig, kernel_block_sizes: list[int] | None = None
    ) -> None:
        """The draft attends over the ring, not the paged cache: no backend or
        KV-cache group of its own. Group 0's metadata carries the batch layout
        (``query_start_loc``) the step needs."""
        self.kv_cache_gid = 0

    def initialize_cudagraph_keys(self, cudagraph_mode: CUDAGraphMode) -> None:
        self.cudagraph_dispatcher.initialize_cudagraph_keys(CUDAGraphMode.NONE)

    @torch.inference_mode()
    def dummy_run(
        self,
        num_tokens: int,
        use_cudagraphs: bool = True,
        is_graph_capturing: bool = False,
        slot_mappings: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Run the draft on the scratch slot so that memory profiling sees
        its activations; real slots are never touched."""
        if self._drafter is None:
            return
        num_requests = min(self.max_batch_size, max(1, num_tokens))
        scratch = torch.full(
            (num_requests,), self._slot_table.scratch_slot, dtype=torch.int64, device=self.device
        )
        anchors = torch.zeros(num_requests, dtype=torch.int64, device=self.device)
        with self._draft_context(num_requests):
            self._drafter.draft(scratch, anchors, anchors, self.num_speculative_tokens)

    def _draft_context(self, num_requests: int):
        """vLLM's fused MoE layers look themselves up in the forward context."""
        return set_forward_context(
            None, self.vllm_config, num_tokens=num_requests * self.num_speculative_tokens
        )

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
        if len(self._slot_table.req_id_to_slot) > len(live_requests):
            # Safety net for finishes the release hook did not see.
            self._slot_table.reconcile(live_requests.keys())
        num_requests = len(req_ids)
        self._slot_buffer.np[:num_requests] = self._row_to_slot(req_ids)
        request_slots = self._slot_buffer.copy_to_gpu(num_requests)

        with self._draft_context(num_requests):
            output = self._drafter.step(
                request_slots,
                target_hidden_states,
                target_positions.long(),
                common_attn_metadata.query_start_loc[: num_requests + 1],
                num_rejected_tokens_gpu,
                next_token_ids[:num_requests],
                num_speculative_tokens,
                with_confidence=self.options.scheduling.needs_confidence,
                sample=position_sampler(
                    self.options.probabilistic, sampling_metadata, self.use_fp64_gumbel
                ),
            )
        # Read by the runner (take_last_draft_probs) for rejection sampling.
        self._last_draft_probs = output.probs
        if output.confidence is not None:
            # A fresh tensor each step: the runner may still be copying the last.
            self._draft_token_lengths = schedule_lengths(
                output.confidence, self.options.scheduling, num_speculative_tokens
            )
        if self.options.draft_log is not None:
            self._log_drafts(req_ids, next_token_ids[:num_requests], output)
        return output.token_ids

    def take_draft_token_lengths(self) -> torch.Tensor | None:
        """Per-request number of drafts to verify, ``[B]`` int32, or None to
        verify all of them. Read once per step by the runner."""
        lengths, self._draft_token_lengths = self._draft_token_lengths, None
        return lengths

    def _log_drafts(
        self, req_ids: list[str], anchor_tokens: torch.Tensor, output: DraftOutput
    ) -> None:
        append_draft_log(
            self.options.draft_log,
            req_ids,
            output.anchors,
            anchor_tokens,
            output.token_ids,
            self._draft_token_lengths,
        )
